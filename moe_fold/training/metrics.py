"""What a training run reports: ``<run_dir>/metrics.jsonl``, wandb, the console.

:class:`RoutingCollector` watches every :class:`~moe_fold.dispatch.router.Router` of a
model through a forward hook (the router's output carries its load statistics), adds them
up over a step's micro-batches and reduces them over the ranks. It only reads: a run
without it (``train(..., metrics=False)``) takes the same steps, bit for bit
(tests/training/test_train.py::test_metrics_off_take_the_same_steps).

- ``expert_load``: per MoE layer (in layer order), the assignments each expert kept in the global batch
  (all tokens of all micro-batches on all ranks), ``[layers][experts]``, held experts only;
- ``dropped_fraction``: assignments dropped by capacity / assignments routed, all layers.
  With ``moe.zero_experts`` the assignments to zero experts are neither loads nor drops:
  wandb's per-layer ``zero_expert_fraction`` reports their share.

The step itself (:mod:`moe_fold.training.step_losses`) adds its loss fields:

- ``aux_loss``: per layer, the load-balancing losses that are enabled (``aux`` +
  ``seq_aux`` + ``global_aux``, without coefficients), mean over micro-batches and dp
  ranks, then mean over layers (``global_aux`` is the step's exact value from
  ``Router.finish_step``); ``z_loss`` the same for the z-loss. null when no layer has
  that loss enabled.
- ``mtp_loss``: with multi-token prediction (``model.mtp_num_layers`` = D), one value per
  depth, each depth's mean cross-entropy over the global batch; null without MTP. The MTP
  depths' MoE blocks report their routing as layers ``num_layers + k`` (the index
  DeepSeek-V3 checkpoints give them).
- ``indexer_loss``: with DSA (``model.dsa``), the lightning indexers' KL loss, mean over
  their layers, micro-batches and ranks; null without.
- the step's ``loss`` is ``lm_loss`` plus these losses times their coefficients, summed
  over layers, plus ``model.mtp_loss_weight`` times the mean of ``mtp_loss``: the
  objective the gradient follows.

:class:`MetricsLogger` (rank 0 does the writing) appends one JSON object per step to
``metrics.jsonl``, logs the same scalars plus per-layer MoE metrics (max/mean load,
dropped fraction, aux and z losses, expert-bias norm, tokens per expert) to wandb, and
every ``wandb.heatmap_every`` steps writes an expert-load heatmap PNG (MoE layers x
experts, :func:`moe_fold.training.plots.heatmap_figure`) to ``<run_dir>/heatmaps/`` and to
the wandb run. ``wandb.mode=offline`` writes the run
under ``<run_dir>/wandb`` without network (``wandb sync`` uploads it later). A validation
(:mod:`moe_fold.training.evaluate`) is a row of its own (``step``, ``valid_loss``,
``valid_ppl``, ``valid_tokens``: no ``loss`` key), in wandb at its step, and a console line.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from torch import nn

from moe_fold.comm import all_reduce_
from moe_fold.config import Config, config_to_dict, dp_size, edp_size, etp_size, moe_layer_indices
from moe_fold.layout import ProcessGroups
from moe_fold.training.step_losses import StepLossValues, router_rows
from moe_fold.training.plots import write_heatmap

__all__ = ["RoutingCollector", "MetricsLogger", "config_changes", "read_wandb_history"]


def config_changes(config: Config, defaults: Config) -> dict[str, Any]:
    """``section.field`` -> value of every field where ``config`` differs from ``defaults``,
    in the config's order."""
    base = config_to_dict(defaults)
    return {f"{section}.{key}": value for section, fields in config_to_dict(config).items()
            for key, value in fields.items() if base[section][key] != value}

class RoutingCollector:
    """Per-step routing numbers of every router in ``model``; see the module docstring. It
    only reads: the step closes the routers (expert-bias update, ``global_aux``) and
    computes the losses (:class:`~moe_fold.training.step_losses.StepLosses`) before it.

    Rows are indexed by the model's MoE layers in order (all of them, also those on other
    pipeline stages: a stage fills its own rows and the reduction over pp fills the rest).
    """

    def __init__(self, model: nn.Module, config: Config):
        self.config = config
        self.moe_layers = moe_layer_indices(config)
        self.routers = router_rows(model, config)
        self.device = next(model.parameters()).device
        self._recording = False
        # Each hook's row is a one-element index tensor, not a Python int: under
        # train.compile=blocks the blocks share one compiled forward, which an int would
        # specialise per layer (and a 0-d tensor index would read back to the host).
        self._hooks = [m.register_forward_hook(self._hook(torch.tensor([row], device=self.device)),
                                               with_kwargs=True) for row, m in self.routers]
        self.layer_metrics: dict[str, float] = {}
        self.expert_load: list[list[int]] = []
        self.start_step()

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Let the hooks count the forwards run inside (the training step's, not a
        recompute's second call)."""
        self._recording = True
        try:
            yield
        finally:
            self._recording = False

    def start_step(self) -> None:
        L, E = len(self.moe_layers), self.config.moe.num_experts
        # On the model's device: the hooks add to them without a host sync per layer
        # (on a GPU each would stall the kernel queue); the step reads them once.
        zeros = dict(dtype=torch.float64, device=self.device)
        self._kept = torch.zeros(L, E, **zeros)  # [L, E]
        self._routed = torch.zeros(L, **zeros)
        # Assignments to zero experts (moe.zero_experts): routed, neither dropped nor held.
        self._zero = torch.zeros(L, **zeros)

    def _hook(self, row: torch.Tensor):
        def hook(module, args, kwargs, output):
            if not self._recording:
                return
            # Padding of packed samples (loss_mask False) is routed but not counted.
            mask = kwargs.get("loss_mask")
            num_tokens = args[0].shape[0] if mask is None else mask.sum()
            if output.stats is not None:
                self._kept[row] += output.stats.tokens_per_expert.detach().double()
                self._zero[row] += output.stats.zero_expert_tokens.detach()
            else:
                self._kept[row] += output.routing_map.sum(dim=0).double()
            self._routed[row] += num_tokens * module.topk
        return hook

    def reduce(self, groups: ProcessGroups) -> torch.Tensor:
        """This step's counts reduced over the ranks and the expert biases' norms (as the
        step left them), packed on the device and not read: ``[L * E + 3 * L]`` float64
        (:meth:`read` takes them once on the host; the step copies them there with its
        own scalars, in one read). Every rank must call it."""
        L, E = self._kept.shape
        # A bias is the same on every rank of tp x dp x cp: it enters divided by its size,
        # so that one sum over it (and over pp, which holds other layers) gives it back.
        same = 1.0 / groups.size("tp_dp_cp")
        bias_norm = torch.zeros(L, dtype=torch.float64, device=self.device)
        for row, router in self.routers:
            if router.expert_bias is not None:
                bias_norm[row] = router.expert_bias.double().norm() * same
        # Counts add up over the ranks that route distinct tokens (tp x dp x cp).
        packed = torch.cat([self._kept.flatten(), self._routed, self._zero, bias_norm])
        if L:
            all_reduce_(packed, groups.tp_dp_cp)
            all_reduce_(packed, groups.pp)
        return packed

    def read(self, packed: torch.Tensor, losses: StepLossValues) -> dict[str, Any]:
        """The record fields from :meth:`reduce`'s tensor, copied to the host; ``losses``:
        the step's loss values, for the per-layer metrics."""
        L, E = self._kept.shape
        if L == 0:
            self.layer_metrics, self.expert_load = {}, []
            return {"dropped_fraction": 0.0, "expert_load": []}
        kept, routed, zero, bias_norm = packed.split([L * E, L, L, L])
        kept = kept.view(L, E)
        dropped = 1.0 - float(kept.sum() + zero.sum()) / max(float(routed.sum()), 1.0)
        self.expert_load = [[int(round(x)) for x in row] for row in kept.tolist()]

        metrics: dict[str, float] = {}
        for i, layer in enumerate(self.moe_layers):
            row = kept[i]
            prefix = f"moe/layer{layer}"
            metrics[f"{prefix}/max_load"] = float(row.max())
            metrics[f"{prefix}/mean_load"] = float(row.mean())
            metrics[f"{prefix}/max_over_mean_load"] = float(row.max() / row.mean()) if row.mean() > 0 else 1.0
            metrics[f"{prefix}/dropped_fraction"] = 1.0 - float(row.sum() + zero[i]) / max(float(routed[i]), 1.0)
            if self.config.moe.zero_experts:
                # The share of the layer's assignments that cost no expert compute.
                metrics[f"{prefix}/zero_expert_fraction"] = float(zero[i]) / max(float(routed[i]), 1.0)
            for kind, v in losses.per_layer.items():
                metrics[f"{prefix}/{kind}_loss"] = float(v[i])
            if self.config.moe.expert_bias:
                metrics[f"{prefix}/expert_bias_norm"] = float(bias_norm[i])
            if E <= 64:
                for e in range(E):
                    metrics[f"{prefix}/tokens_expert{e}"] = float(row[e])
        self.layer_metrics = metrics
        return {"dropped_fraction": dropped, "expert_load": self.expert_load}

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


# --------------------------------------------------------------------------- the logger

class MetricsLogger:
    """Rank 0's metrics.jsonl, wandb run, progress bar and start/end messages; other
    ranks' logger does nothing. ``start_step`` > 0 (a resume) keeps the records up to that
    step and drops any later ones (written after the checkpoint by the run that stopped)."""

    def __init__(self, config: Config, groups: ProcessGroups, console: Any = None, progress: bool = True,
                 start_step: int = 0):
        self.config = config
        self.groups = groups
        self.console = console
        self.active = groups.rank == 0
        self.run_dir = Path(config.train.run_dir)
        self.moe_layer_ids = moe_layer_indices(config)
        self.wandb_dir: Optional[str] = None
        self._run = None
        self._progress = None
        self._file = None
        self.last_heatmap: Optional[Path] = None
        if not self.active:
            return
        path = self.run_dir / "metrics.jsonl"
        kept = []
        if start_step > 0 and path.exists():
            kept = [line for line in path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= start_step]
        path.write_text("".join(line + "\n" for line in kept))
        self._file = path.open("a")
        if config.wandb.mode != "disabled":
            self._start_wandb(resume=start_step > 0)
        # A progress bar only where it can redraw; a log file gets one line per log_every steps.
        if console is not None and progress and console.is_terminal:
            self._start_progress(start_step)

    def _start_wandb(self, resume: bool) -> None:
        import wandb
        from wandb.sdk.lib import runid

        w = self.config.wandb
        id_file = self.run_dir / "wandb_id.txt"
        run_id = id_file.read_text().strip() if resume and id_file.exists() else runid.generate_id()
        id_file.write_text(run_id)
        # Environment: wandb's own switch for its start-up banner (unless the user set it).
        os.environ.setdefault("WANDB_SILENT", "true")
        self._run = wandb.init(project=w.project, name=w.name or self.run_dir.name, mode=w.mode,
                               dir=str(self.run_dir), id=run_id, resume="allow", config=config_to_dict(self.config),
                               settings=wandb.Settings(console="off", x_disable_stats=True))
        self.wandb_dir = str(Path(self._run.dir).parent)

    def _start_progress(self, start_step: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        validation = [TextColumn("valid {task.fields[valid]}")] if self.config.train.eval_every > 0 else []
        self._progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"), *validation, TextColumn("{task.fields[tps]} tok/s"),
            TextColumn("ETA"), TimeRemainingColumn(), console=self.console, transient=False)
        self._task = self._progress.add_task("train", total=self.config.train.steps, completed=start_step,
                                             loss="-", valid="-", tps="-")
        self._progress.start()

    def print_start(self, world_size: int, resumed_from: Optional[str], defaults: Config) -> None:
        """What the run's config changes in ``defaults`` (the preset or file it came from,
        with the ``--set`` overrides and the resolved kernel backends; the whole config is
        the run's config.yaml) and both layouts of the world."""
        changes = config_changes(self.config, defaults)
        c = self.console
        c.print(f"[bold]config[/bold] ({len(changes)} changed; all of it: {self.run_dir / 'config.yaml'})")
        for key, value in changes.items():
            c.print(f"  {key}: {value}", markup=False, highlight=False)
        p = self.config.parallel
        dp = dp_size(self.config, world_size)
        edp = edp_size(self.config, world_size)
        c.print(f"[bold]attention layout[/bold] tp={p.tp} x cp={p.cp} x dp={dp} x pp={p.pp} = {world_size} ranks"
                f"  groups dp: {self.groups.layout.groups('dp')}")
        layout = self.groups.layout
        c.print(f"[bold]expert layout[/bold]    etp={etp_size(self.config)} x ep={p.ep} x edp={edp} x pp={p.pp} = "
                f"{world_size} ranks  groups ep: {layout.groups('ep')} edp: {layout.groups('edp')}")
        c.print(f"run dir: {self.run_dir}" + (f"  (resumed from {resumed_from})" if resumed_from else ""))

    def log(self, record: dict, collector: Optional[RoutingCollector]) -> None:
        """The step's row; ``collector``: its per-layer metrics and heatmaps (None: none)."""
        if not self.active:
            return
        step = record["step"]
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._run is not None:
            scalars = {k: v for k, v in record.items()
                       if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
            scalars.update({f"mtp/depth{k + 1}_loss": v for k, v in enumerate(record.get("mtp_loss") or [])})
            self._run.log({**scalars, **(collector.layer_metrics if collector is not None else {})}, step=step)
        last = step == self.config.train.steps
        if collector is not None and collector.expert_load and (step % self.config.wandb.heatmap_every == 0 or last):
            self._heatmap(step, collector.expert_load)
        if self._progress is not None:
            self._progress.update(self._task, completed=step, loss=f"{record['loss']:.4f}",
                                  tps=f"{record['tokens_per_s']:.0f}")
        elif self.console is not None and (step % self.config.train.log_every == 0 or last):
            self.console.print(f"step {step}/{self.config.train.steps} loss {record['loss']:.4f} "
                               f"lr {record['lr']:.2e} grad_norm {record['grad_norm']:.3f} "
                               f"tokens/s {record['tokens_per_s']:.0f}")

    def log_event(self, record: dict, message: Optional[str] = None) -> None:
        """A row of metrics.jsonl that is not a step's (``step`` and the event's fields: a
        rollback, the checkpoint interval in use), and ``message`` on the console."""
        if not self.active:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if message is not None and self.console is not None:
            self.console.print(message, markup=False, highlight=False)

    def log_eval(self, record: dict) -> None:
        """A validation row (``step``, ``valid_loss``, ``valid_ppl``, ``valid_tokens``):
        its own line of metrics.jsonl, the same scalars to wandb at that step, and a line
        on the console (above the progress bar when there is one)."""
        if not self.active:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._run is not None:
            self._run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])
        if self._progress is not None:
            self._progress.update(self._task, valid=f"{record['valid_loss']:.4f}")
        if self.console is not None:
            self.console.print(f"step {record['step']}/{self.config.train.steps} validation loss "
                               f"{record['valid_loss']:.4f} ppl {record['valid_ppl']:.2f} "
                               f"({record['valid_tokens']} tokens)")

    def _heatmap(self, step: int, load: list[list[int]]) -> None:
        folder = self.run_dir / "heatmaps"
        folder.mkdir(exist_ok=True)
        path = write_heatmap(folder / f"expert_load_step{step:07d}.png", load, step, self.moe_layer_ids)
        self.last_heatmap = path
        if self._run is not None:
            import wandb

            # wandb.Image needs Pillow; without it the PNG goes into the run's files.
            try:
                import PIL  # noqa: F401
            except ModuleNotFoundError:
                self._run.save(str(path), base_path=str(self.run_dir), policy="now")
            else:
                self._run.log({"moe/expert_load_heatmap": wandb.Image(str(path))}, step=step)

    def print_summary(self, result: Any) -> None:
        c = self.console
        c.print("[bold]done[/bold]")
        c.print(f"  final loss   {result.final_loss:.4f}" + (
            f" (first step {result.losses[0]:.4f})" if result.losses else ""))
        c.print(f"  tokens/s     {result.tokens_per_s:.0f}")
        c.print(f"  time         {result.seconds:.1f} s")
        c.print(f"  run dir      {self.run_dir}")
        c.print(f"  metrics      {self.run_dir / 'metrics.jsonl'}")
        c.print(f"  checkpoint   {result.checkpoint}")
        if self.last_heatmap is not None:
            c.print(f"  heatmap      {self.last_heatmap}")
        if result.plots:
            c.print(f"  plots        {Path(result.plots[0]).parent}/ ({', '.join(Path(p).name for p in result.plots)})")
        c.print(f"  wandb        {result.wandb_dir or 'disabled'}" + (
            "  (offline: `wandb sync` it to upload)" if self.config.wandb.mode == "offline" else ""))

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._run is not None:
            self._run.finish()
            self._run = None


def read_wandb_history(run_folder: str | os.PathLike) -> list[dict]:
    """The logged rows of an offline wandb run folder (``.../wandb/offline-run-*``), read
    back from its ``.wandb`` file: one dict per ``log`` call, keys as logged.

    The file is a LevelDB-style log (what wandb's own reader parses): a 7-byte header
    (``:W&B``, magic, version), then 32 KiB blocks of records, each a 7-byte header
    (crc32, length, type: 1 full, 2 first, 3 middle, 4 last piece) and a piece of one
    serialized ``Record`` protobuf; a block's tail shorter than a header is padding."""
    from wandb.proto import wandb_internal_pb2

    files = list(Path(run_folder).glob("*.wandb"))
    if len(files) != 1:
        raise FileNotFoundError(f"expected one .wandb file in {run_folder}, found {len(files)}")
    data = files[0].read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{files[0]} is not a wandb run file (header {data[:7]!r})")
    block, pos, pieces, payloads = 32768, 7, b"", []
    while pos + 7 <= len(data):
        space = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if space < 7 or kind == 0:
            pos += space
            continue
        piece = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            payloads.append(piece)
        elif kind == 2:
            pieces = piece
        elif kind == 3:
            pieces += piece
        elif kind == 4:
            payloads.append(pieces + piece)
    rows = []
    for payload in payloads:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows
