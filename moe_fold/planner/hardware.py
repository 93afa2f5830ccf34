"""The GPUs the layout planner knows: peak dense BF16 FLOP/s, memory, and link bandwidths.

Every figure is per GPU, from the vendor's published specification, and is what
:mod:`moe_fold.planner.estimate` divides by: FLOP/s without 2:4 structured sparsity (NVIDIA's
headline tensor numbers assume sparsity; dense is half), bandwidths in bytes per second
in ONE direction (NVIDIA quotes NVLink bidirectional: 900 GB/s bidirectional is 450 GB/s
each way).

- H100 SXM5: 989 TFLOP/s dense BF16 (datasheet: 1,979 with sparsity; dense FP8 1,979), 80 GB HBM3 at
  3.35 TB/s, NVLink 4 900 GB/s bidirectional. NVIDIA H100 Tensor Core GPU datasheet.
- H200 SXM: the same GH100 compute (989 TFLOP/s dense BF16), 141 GB HBM3e at 4.8 TB/s,
  NVLink 4 900 GB/s bidirectional. NVIDIA H200 Tensor Core GPU datasheet.
- V100 SXM2 32GB (DGX-2H, as Megatron-LM 2019 used it): 125 TFLOP/s FP16 tensor-core peak
  (no BF16 on Volta; its mixed-precision training ran in FP16), 32 GB HBM2 at 900 GB/s,
  NVLink 2 300 GB/s per GPU bidirectional through NVSwitch (DGX-2: 16 GPUs per node, 2 PFLOP/s
  tensor and 14.4 TB/s HBM in all), eight 100 Gb/s EDR InfiniBand NICs per 16-GPU node:
  6.25 GB/s per GPU each way. NVIDIA Tesla V100 specification table; DGX-2 announcement.
- A100 SXM4 80GB (DGX A100, as Narayanan et al. 2021 used it on Selene): 312 TFLOP/s dense
  BF16 (624 with sparsity), 80 GB HBM2e at 2.039 TB/s, NVLink 3 600 GB/s bidirectional
  (300+300), eight 200 Gb/s HDR InfiniBand NICs per 8-GPU node: 25 GB/s per GPU each way.
  NVIDIA A100 datasheet (tabulated at https://glennklockwood.com/garden/processors/A100).
- B200 (HGX, 1,000 W): 2,250 TFLOP/s dense BF16 (4,500 with sparsity), HBM3e at 8 TB/s,
  NVLink 5 1.8 TB/s bidirectional. NVIDIA HGX B200 / DGX B200 datasheets (tabulated per
  data type at https://glennklockwood.com/garden/processors/B200). Memory: the B200 die
  carries 192 GB; DGX B200 exposes 1,440 GB for 8 GPUs, 180 GB each, which we use.

Flash attention (``flash_forward``, ``flash_backward``: the share of ``peak_flops`` a fused
attention kernel reaches on the causal products it computes, head dim 128, BF16). H100 and
H200: FlashAttention-3 (Shah et al. 2024, arXiv 2407.08608) reaches 590 TFLOP/s forward at
sequence 4,096 and head dim 128 (PyTorch benchmark commit ff65cb67, the FA3 paper's shapes),
0.60 of 989, and up to 740 (75%) at 16K; its backward runs at about 0.7 of its forward
throughput in the paper's figures: 0.42. cuDNN's fused attention, which Transformer Engine
runs on Hopper, is of the same order. A100: FlashAttention-2 (Dao 2023, arXiv 2307.08691)
reaches "50-73% of the theoretical maximum FLOPs/s" forward and about 0.45 backward.
B200: no published training-kernel figure here; it takes H100's shares (an assumption). V100
has no flash kernel (FlashAttention needs sm80+): a plan that asks for one is refused.

Inter-node network, an assumption stated here once for H100, H200 and B200: one 400 Gb/s
InfiniBand NIC per GPU (ConnectX-7, as in DGX H100, DGX H200 and DGX B200), 50 GB/s each
way; V100 and A100 get their DGX systems' NICs above. An 800 Gb/s (ConnectX-8) B200 system
is ``replace(GPUS["b200"], inter_node_bw=100e9)``. Eight GPUs per node share one NVLink
domain (sixteen on the DGX-2H).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GPU", "GPUS", "get_gpu"]


@dataclass(frozen=True)
class GPU:
    name: str
    # Dense BF16 tensor-core peak, FLOP/s: the MFU denominator.
    peak_flops: float
    # Memory a run may use, bytes.
    memory: float
    # HBM bandwidth, bytes/s (the optimizer step is bound by it).
    hbm_bw: float
    # NVLink bandwidth per GPU, bytes/s, one direction.
    nvlink_bw: float
    # Network bandwidth per GPU between nodes, bytes/s, one direction.
    inter_node_bw: float
    gpus_per_node: int = 8
    # Dense FP8 tensor-core peak, FLOP/s (0: the GPU has no FP8 tensor cores). Used for the
    # linear layers' GEMMs when a plan assumes FP8 training; the MFU denominator stays BF16's.
    fp8_flops: float = 0.0
    # What a fused (flash) attention kernel reaches of peak_flops on the products it really
    # computes, forward and backward (0: no flash kernel for this GPU). Kernel benchmarks,
    # not fitted on training runs: see the module doc.
    flash_forward: float = 0.0
    flash_backward: float = 0.0


GB = 1e9

GPUS: dict[str, GPU] = {
    "v100": GPU("V100 SXM2 32GB (DGX-2H)", 125e12, 32 * GB, 0.9e12, 150 * GB, 6.25 * GB, gpus_per_node=16),
    "a100": GPU("A100 SXM4 80GB", 312e12, 80 * GB, 2.039e12, 300 * GB, 25 * GB,
                flash_forward=0.60, flash_backward=0.45),
    "h100": GPU("H100 SXM 80GB", 989e12, 80 * GB, 3.35e12, 450 * GB, 50 * GB, fp8_flops=1979e12,
                flash_forward=0.60, flash_backward=0.42),
    "h200": GPU("H200 SXM 141GB", 989e12, 141 * GB, 4.8e12, 450 * GB, 50 * GB, fp8_flops=1979e12,
                flash_forward=0.60, flash_backward=0.42),
    "b200": GPU("B200 (HGX) 180GB", 2250e12, 180 * GB, 8.0e12, 900 * GB, 50 * GB,
                flash_forward=0.60, flash_backward=0.42),
}


def get_gpu(name: str) -> GPU:
    """The GPU named ``name`` (``v100``, ``a100``, ``h100``, ``h200``, ``b200``; case-insensitive)."""
    key = name.lower()
    if key not in GPUS:
        raise ValueError(f"gpu={name!r} is unknown; known GPUs: {', '.join(GPUS)}")
    return GPUS[key]
