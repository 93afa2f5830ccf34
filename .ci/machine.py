"""Where this run is: the CPU, the instruction sets the math libraries choose kernels by,
MKL's version and reproducibility branch, ATen's vector width, the torch build. Printed at
the top of a CI run so that a failure report says which code paths it took. Every field is
best effort: one that cannot be read prints as "unknown", never stops the run."""

import os
import platform
import re
import subprocess
import sys

FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512_bf16", "amx_tile")


def cpu():
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return platform.processor() or "unknown", "unknown"
    model = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    flags = re.search(r"^flags\s*:\s*(.+)$", text, re.M)
    have = set(flags.group(1).split()) if flags else set()
    isa = " ".join(f"{f}={'yes' if f in have else 'no'}" for f in FLAGS) if flags else "unknown"
    return (model.group(1).strip() if model else "unknown"), isa


def main():
    model, isa = cpu()
    print(f"machine: {model}; {os.cpu_count()} logical CPUs; {platform.system()} {platform.release()}")
    print(f"isa: {isa}")
    for name in ("MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY", "OMP_NUM_THREADS"):
        print(f"env: {name}={os.environ.get(name, '(unset)')}")
    try:
        import torch
    except Exception as e:  # the report still says where it ran
        print(f"torch: not importable ({type(e).__name__}: {e})")
        return
    print(f"torch: {torch.__version__}, cuda {torch.version.cuda}, git {getattr(torch.version, 'git_version', 'unknown')}")
    for label, read in (("mkl", lambda: torch.backends.mkl.is_available()),
                        ("mkldnn", lambda: torch.backends.mkldnn.is_available()),
                        ("aten cpu capability", lambda: torch.backends.cpu.get_cpu_capability()),
                        ("threads", lambda: torch.get_num_threads())):
        try:
            value = read()
        except Exception as e:
            value = f"unknown ({type(e).__name__})"
        print(f"torch {label}: {value}")
    try:
        config = torch.__config__.show()
    except Exception as e:
        config = f"unknown ({type(e).__name__})"
    for line in config.splitlines():
        if re.search(r"Math Kernel|MKL-DNN|oneDNN|OpenMP|CPU capability", line):
            print(f"torch build: {line.strip().lstrip('- ')}")
        elif "Build settings" in line:
            keep = re.findall(r"\b((?:BLAS_INFO|USE_MKL|USE_MKLDNN|USE_OPENMP)=[^,]*)", line)
            print(f"torch build: {', '.join(keep) or 'unknown'}")
    print(f"mkl branch: {mkl_branch()}")


def mkl_branch():
    """The reproducibility branch and version MKL reports for one sgemm (MKL_VERBOSE):
    CNR:OFF is its default dispatch by CPU; a MKL_CBWR branch the CPU does not take shows
    as CNR:AUTO."""
    probe = "import torch; a = torch.ones(8, 8); a @ a"
    try:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "MKL_VERBOSE": "1"})
    except Exception as e:
        return f"unknown ({type(e).__name__})"
    text = out.stdout + out.stderr
    cnr = re.search(r"CNR:(\S+)", text)
    version = re.search(r"MKL_VERBOSE (oneMKL [^,]*?|Intel\(R\) MKL [^,]*?)(?: Product| for|,)", text)
    if cnr is None:
        return "unknown (no MKL_VERBOSE line: BLAS is not MKL, or MKL did not run)"
    return f"CNR:{cnr.group(1)} ({version.group(1) if version else 'version unknown'})"


if __name__ == "__main__":
    main()
