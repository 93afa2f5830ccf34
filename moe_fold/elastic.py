"""Elastic restarts: the layout a run takes on a world size its config does not fit.

Under ``torchrun --nnodes MIN:MAX`` a node that is gone for good makes torchrun restart
the survivors in a smaller world, and a node that comes back makes it restart everyone
in a larger one. With ``parallel.elastic=true`` each start calls :func:`choose_layout`
for the world it got, before any process group exists:

1. the configured layout, when it fits (``validate`` passes): a world that grew back to
   the configured size gets the configured layout again, whatever ran before;
2. else, with ``parallel.elastic_layouts``, the first entry that fits (each entry sets
   some of tp cp pp ep etp on top of the configured layout);
3. else the rule: tp, cp, pp and etp stay; dp is world/(tp*cp*pp); ep is the largest
   ep <= parallel.ep for which the config fits. "Fits" is everything ``validate``
   checks; for ep that is: ep divides moe.num_experts, etp*ep*pp divides the world
   (experts fold over dp*cp*tp), and moe.replicas still has somewhere to go. edp is
   world/(etp*ep*pp).

The global batch stays (``train.global_batch_size`` and ``train.micro_batch_size`` are
never changed): the number of micro-batches per step, global/(micro*dp), follows dp, and
a world where global/(micro*dp) is not whole fits no layout. Nothing is chosen silently:
the caller prints :attr:`ElasticChoice.reason` and logs :meth:`ElasticChoice.record`
(``moe_fold.cli.train``: ``<run_dir>/elastic.jsonl``). When nothing fits, ConfigError
lists why each candidate failed. Without ``parallel.elastic`` a world the config does not
fit fails in ``validate``, and :func:`elastic_hint` names the layout ``parallel.elastic=true``
would take there.

Pure arithmetic over the config; the checkpoint loads under any layout
(:mod:`moe_fold.training.checkpoint`), so the run continues where it stopped.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moe_fold.config import Config, ConfigError, etp_size, parse_elastic_layout, validate

__all__ = ["ElasticChoice", "choose_layout", "elastic_hint", "with_elastic_hint"]


@dataclass(frozen=True)
class ElasticChoice:
    """The layout :func:`choose_layout` took for a world, and why."""
    config: Config  # the run's config with the chosen parallel sizes
    world_size: int
    rule: str  # "configured", "elastic_layouts[i]" or "largest ep"
    reason: str  # one line for the user
    rejected: tuple[str, ...]  # "<candidate>: <first rule it breaks>", in the order tried

    def sizes(self) -> dict[str, int]:
        """Every parallel size of the chosen layout, and the micro-batches per step."""
        return _sizes(self.config, self.world_size)

    def record(self) -> dict:
        """One JSON-able row for the run folder's elastic.jsonl."""
        return {"world_size": self.world_size, "rule": self.rule, **self.sizes(), "reason": self.reason,
                "rejected": list(self.rejected)}


def _sizes(config: Config, world: int) -> dict[str, int]:
    p, t = config.parallel, config.train
    etp = etp_size(config)
    dp = world // (p.tp * p.cp * p.pp)
    return {"tp": p.tp, "cp": p.cp, "pp": p.pp, "dp": dp, "ep": p.ep, "etp": etp,
            "edp": world // (etp * p.ep * p.pp), "micro_batches": t.global_batch_size // (t.micro_batch_size * dp)}


def _micro_batches(n: int) -> str:
    return f"{n} micro-batch{'es' if n != 1 else ''}"


def _describe(config: Config) -> str:
    p = config.parallel
    return f"tp={p.tp} cp={p.cp} pp={p.pp} ep={p.ep} etp={etp_size(config)}"


def _with(config: Config, **sizes: int) -> Config:
    return dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, **sizes))


def _first_problem(config: Config, world: int) -> str | None:
    """None when ``config`` fits ``world``, else the first rule it breaks."""
    try:
        validate(config, world)
    except ConfigError as e:
        return e.problems[0]
    return None


def choose_layout(config: Config, world_size: int) -> ElasticChoice:
    """The layout ``config`` (``parallel.elastic=true``) runs on ``world_size`` ranks; see
    the module docstring for the rule. Raises ConfigError when no candidate fits, naming each
    candidate and the rule it breaks."""
    if not config.parallel.elastic:
        raise ConfigError(f"choose_layout needs parallel.elastic=true, got {config.parallel.elastic}")
    configured = _describe(config)
    problem = _first_problem(config, world_size)
    if problem is None:
        sizes = _sizes(config, world_size)
        return ElasticChoice(config, world_size, "configured",
                             f"world_size={world_size}: the configured layout ({configured}) fits: dp={sizes['dp']}, "
                             f"edp={sizes['edp']}, {_micro_batches(sizes['micro_batches'])} per step", ())
    misfit = problem
    rejected = [f"configured ({configured}): {problem}"]
    layouts = config.parallel.elastic_layouts
    if layouts is not None:
        candidates = [(f"elastic_layouts[{i}]", _with(config, **parse_elastic_layout(entry)))
                      for i, entry in enumerate(layouts)]
        why = "the first parallel.elastic_layouts entry that fits"
        tried = "any parallel.elastic_layouts entry"
    else:
        candidates = [("largest ep", _with(config, ep=ep)) for ep in range(config.parallel.ep - 1, 0, -1)]
        why = f"the largest ep <= parallel.ep={config.parallel.ep} that fits, keeping tp, cp, pp and etp"
        tried = f"any ep < parallel.ep={config.parallel.ep} (tp, cp, pp and etp kept)"
    for rule, candidate in candidates:
        problem = _first_problem(candidate, world_size)
        if problem is not None:
            rejected.append(f"{rule} ({_describe(candidate)}): {problem}")
            continue
        sizes = _sizes(candidate, world_size)
        reason = (f"world_size={world_size}: the configured layout ({configured}) does not fit ({misfit}); "
                  f"took {rule} ({_describe(candidate)}), {why}: dp={sizes['dp']}, edp={sizes['edp']}, "
                  f"{_micro_batches(sizes['micro_batches'])} of {config.train.micro_batch_size} per step "
                  f"(train.global_batch_size={config.train.global_batch_size} kept)")
        return ElasticChoice(candidate, world_size, rule, reason, tuple(rejected))
    raise ConfigError([f"parallel.elastic=true: no layout fits world_size={world_size}, neither the configured one "
                       f"nor {tried}:", *rejected])


def elastic_hint(config: Config, world_size: int) -> str | None:
    """For a config without ``parallel.elastic`` whose layout does not fit ``world_size``:
    one line naming the layout ``parallel.elastic=true`` would take there (None when the
    configured layout fits, or no layout would)."""
    if config.parallel.elastic or _first_problem(config, world_size) is None:
        return None
    try:
        choice = choose_layout(_with(config, elastic=True), world_size)
    except ConfigError:
        return None
    sizes = choice.sizes()
    return (f"parallel.elastic=true would take {choice.rule} ({_describe(choice.config)}) here: "
            f"dp={sizes['dp']}, edp={sizes['edp']}, {_micro_batches(sizes['micro_batches'])} per step "
            f"(--set parallel.elastic=true, or set those sizes)")


def with_elastic_hint(error: ConfigError, config: Config, world_size: int) -> ConfigError:
    """``error`` (``config`` refused for ``world_size``) with :func:`elastic_hint` added to
    its world-size problems (on a line of its own when the misfit is elsewhere); ``error``
    itself when there is no hint."""
    hint = elastic_hint(config, world_size)
    if hint is None:
        return error
    ours = f"world_size={world_size} "
    problems = [f"{p}; {hint}" if p.startswith(ours) else p for p in error.problems]
    return ConfigError(problems if problems != error.problems else [*problems, hint])
