"""Pipeline schedules as static plans: the order of forward and backward steps on every pp
rank, and the points where activations and grads cross between ranks. Pure arithmetic;
:mod:`moe_fold.parallel.pipeline` runs a plan with torch.distributed.

Terms. ``pp`` ranks ``r = 0..pp-1`` each hold ``vpp`` model chunks; chunk ``c`` of rank
``r`` is virtual stage ``s = c*pp + r`` (Megatron's placement), so a micro-batch visits
the ranks ``vpp`` times round the ring. ``S = pp*vpp`` stages, ``m`` micro-batches.
``F(i, s)`` / ``B(i, s)`` are the forward / backward of micro-batch ``i`` on stage ``s``.

Orders (per rank, after Narayanan et al. 2021):

- ``1f1b`` (vpp = 1): ``min(pp - r - 1, m)`` warm-up forwards, then one forward and one
  backward in turn, then the remaining backwards. A rank holds at most ``pp - r``
  micro-batches' activations.
- ``interleaved`` (vpp >= 2): forwards take the micro-batches in groups of ``pp``: chunk 0
  for each micro-batch of the group, then chunk 1, ...; backwards the same with the
  chunks reversed. ``min(2*(pp - r - 1) + (vpp - 1)*pp, m*vpp)`` warm-up forwards, then
  forward/backward in turn, then the remaining backwards. A rank holds at most
  ``warm-up + 1`` chunk-micro-batches' activations. Needs ``m % pp == 0``
  (:func:`check_schedule`): with a short last group this order loses the textbook
  bubble and, for some ``(pp, vpp, m)`` (e.g. 4, 3, 5), deadlocks.

Timing and communication. The plan times every step by list scheduling: each rank runs
its order, forwards take ``FORWARD_UNITS`` and backwards ``BACKWARD_UNITS`` (the usual
backward = 2 x forward). Messages (the activation after ``F(i, s)``, the grad after
``B(i, s)``) leave at the end of their step's *unit*: every step is a unit of its own,
except interleaved's steady-state forward/backward pairs, which are one unit as in
Megatron-LM (there neighbouring ranks run steps of different lengths, so per-step
exchanges would often find the receiver in the middle of a step; with units a plan has at
most two such messages, see :meth:`Plan.misaligned`). A unit starts when the rank is free
and the inputs of its steps have arrived.

At each time some unit ends, the two ranks of every message sent then post their sides
together (one :func:`moe_fold.comm.batch_send_recv` each), and receivers keep what they
get until the step that needs it. Every rank goes through these exchanges in the same
global time order, and both ends list an exchange's messages in one order, so the plan
cannot deadlock even where a send waits for its receive to be posted (gloo, NCCL),
whatever the real step times are: they only change who waits. With real times in the
1:2 ratio, the idle fraction of every rank is the schedule's textbook bubble.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from moe_fold.config import choices, interleaved_micro_batches, require, schedule_chunks

__all__ = ["SCHEDULES", "FORWARD_UNITS", "BACKWARD_UNITS", "Step", "Message", "Exchange", "Plan",
           "check_schedule", "rank_stages", "rank_order", "make_plan"]

# parallel.pp_schedule's choices once auto is resolved (moe_fold.config.pipeline_schedule).
SCHEDULES = tuple(s for s in choices("parallel.pp_schedule") if s != "auto")
FORWARD_UNITS = 1
BACKWARD_UNITS = 2


@dataclass(frozen=True)
class Step:
    """``kind`` "F" or "B" of micro-batch ``microbatch`` on virtual stage ``stage``."""
    kind: str
    microbatch: int
    stage: int


@dataclass(frozen=True)
class Message:
    """An activation (``kind="act"``, from stage ``stage - 1`` to ``stage``) or a grad
    (``kind="grad"``, from stage ``stage + 1`` to ``stage``); ``src``/``dst`` are pp ranks."""
    kind: str
    microbatch: int
    stage: int
    src: int
    dst: int


@dataclass(frozen=True)
class Exchange:
    """The messages one rank sends or receives at plan time ``time``, posted together."""
    time: int
    messages: tuple[Message, ...]


@dataclass
class Plan:
    """``programs[r]``: what pp rank ``r`` does, in order (steps and exchanges);
    ``times[step] = (start, end)`` in plan units; ``makespan``: the end of the last step."""
    pp: int
    vpp: int
    num_microbatches: int
    forward_only: bool
    programs: list[list[Union[Step, Exchange]]]
    times: dict[Step, tuple[int, int]]
    makespan: int

    def busy(self, rank: int) -> int:
        """Plan units rank ``rank`` spends in steps."""
        return sum(end - start for step, (start, end) in self.times.items() if step.stage % self.pp == rank)

    def misaligned(self) -> int:
        """Messages whose receiver is inside a step at the exchange: where a send waits
        for its receive to be posted, the sender waits for that step to end."""
        count = 0
        for r, program in enumerate(self.programs):
            inside = [(a, b) for step, (a, b) in self.times.items() if step.stage % self.pp == r]
            for item in program:
                if isinstance(item, Exchange) and any(a < item.time < b for a, b in inside):
                    count += sum(1 for msg in item.messages if msg.dst == r)
        return count


def check_schedule(schedule: str, pp: int, vpp: int, num_microbatches: int) -> None:
    """Raise ValueError naming the argument, its value and the rule it breaks."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} must be one of {', '.join(SCHEDULES)}")
    for name, value in (("pp", pp), ("vpp", vpp), ("num_microbatches", num_microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    require(schedule_chunks, schedule, vpp)
    if schedule == "interleaved":
        require(interleaved_micro_batches, num_microbatches, pp)


def rank_stages(pp: int, vpp: int, rank: int) -> list[int]:
    """The virtual stages of pp rank ``rank``, one per model chunk: ``c*pp + rank``."""
    return [c * pp + rank for c in range(vpp)]


def _interleaved_steps(kind: str, pp: int, vpp: int, m: int, rank: int) -> list[Step]:
    """The forwards (or backwards) of ``rank`` in the interleaved order: micro-batches in
    groups of ``pp`` (the last may be short), each group through every chunk in turn."""
    chunks = range(vpp) if kind == "F" else range(vpp - 1, -1, -1)
    return [Step(kind, i, c * pp + rank)
            for first in range(0, m, pp) for c in chunks for i in range(first, min(first + pp, m))]


def _rank_units(schedule: str, pp: int, vpp: int, m: int, rank: int, forward_only: bool) -> list[list[Step]]:
    """The order of ``rank`` cut into units, the steps between two exchanges: every step
    alone, except the forward/backward pairs of interleaved's steady state."""
    check_schedule(schedule, pp, vpp, m)
    if schedule == "1f1b":
        forwards = [Step("F", i, rank) for i in range(m)]
        backwards = [Step("B", i, rank) for i in range(m)]
        warmup = min(pp - rank - 1, m)
    else:
        forwards = _interleaved_steps("F", pp, vpp, m, rank)
        backwards = _interleaved_steps("B", pp, vpp, m, rank)
        warmup = min(2 * (pp - rank - 1) + (vpp - 1) * pp, m * vpp)
    if forward_only:
        return [[f] for f in forwards]
    steady = list(zip(forwards[warmup:], backwards))
    units = [[f] for f in forwards[:warmup]]
    units += [[f, b] for f, b in steady] if schedule == "interleaved" else [[x] for pair in steady for x in pair]
    return units + [[b] for b in backwards[len(steady):]]


def rank_order(schedule: str, pp: int, vpp: int, num_microbatches: int, rank: int,
               forward_only: bool = False) -> list[Step]:
    """The steps of pp rank ``rank`` in the order it runs them (see the module doc)."""
    return [step for unit in _rank_units(schedule, pp, vpp, num_microbatches, rank, forward_only)
            for step in unit]


def _producer(step: Step, stages: int) -> Union[Step, None]:
    """The step whose output ``step`` consumes from another stage (None: its own input)."""
    if step.kind == "F":
        return Step("F", step.microbatch, step.stage - 1) if step.stage > 0 else None
    if step.stage < stages - 1:
        return Step("B", step.microbatch, step.stage + 1)
    return None


def _message(step: Step, stages: int, pp: int) -> Union[Message, None]:
    """What ``step`` sends to another rank (None: nothing, or a hand-over on one rank)."""
    if step.kind == "F" and step.stage < stages - 1:
        msg = Message("act", step.microbatch, step.stage + 1, step.stage % pp, (step.stage + 1) % pp)
    elif step.kind == "B" and step.stage > 0:
        msg = Message("grad", step.microbatch, step.stage - 1, step.stage % pp, (step.stage - 1) % pp)
    else:
        return None
    return msg if msg.src != msg.dst else None


def make_plan(schedule: str, pp: int, vpp: int, num_microbatches: int, forward_only: bool = False) -> Plan:
    """Time every rank's units and place the exchanges (see the module doc)."""
    units = [_rank_units(schedule, pp, vpp, num_microbatches, r, forward_only) for r in range(pp)]
    stages = pp * vpp
    times: dict[Step, tuple[int, int]] = {}
    delivered: dict[Step, int] = {}  # step -> when its output reaches the other rank
    free, nxt = [0] * pp, [0] * pp
    while any(nxt[r] < len(units[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            while nxt[r] < len(units[r]):
                unit = units[r][nxt[r]]
                deps = [d for d in (_producer(step, stages) for step in unit) if d is not None and d.stage % pp != r]
                if any(d not in delivered for d in deps):
                    break
                t = max([free[r]] + [delivered[d] for d in deps])
                for step in unit:
                    times[step] = (t, t + (FORWARD_UNITS if step.kind == "F" else BACKWARD_UNITS))
                    t = times[step][1]
                for step in unit:
                    delivered[step] = t
                free[r] = t
                nxt[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: units[r][nxt[r]] for r in range(pp) if nxt[r] < len(units[r])}
            raise RuntimeError(f"{schedule} order with pp={pp}, vpp={vpp}, num_microbatches={num_microbatches} "
                               f"deadlocks at {stuck}")
    # Per rank: exchange time -> the messages it sends or receives then (the end of their unit).
    exchanges: list[dict[int, list[Message]]] = [{} for _ in range(pp)]
    for step, t in delivered.items():
        msg = _message(step, stages, pp)
        if msg is not None:
            exchanges[msg.src].setdefault(t, []).append(msg)
            exchanges[msg.dst].setdefault(t, []).append(msg)
    programs: list[list[Union[Step, Exchange]]] = []
    for r in range(pp):
        # An exchange at time t comes after the steps that end by t and before those that
        # start at t or later; a step running across t delays the exchange to its end.
        # Both ends list an exchange's messages in one sorted order, which is the order
        # that matches two messages between the same two ranks (pp=2, a unit sends both ways).
        events: list[tuple[int, int, Union[Step, Exchange]]] = []
        for unit in units[r]:
            events += [(times[step][0], 1, step) for step in unit]
        events += [(t, 0, Exchange(t, tuple(sorted(msgs, key=_message_key)))) for t, msgs in exchanges[r].items()]
        events.sort(key=lambda e: (e[0], e[1]))
        programs.append([item for _, _, item in events])
    return Plan(pp, vpp, num_microbatches, forward_only, programs, times, max(free))


def _message_key(msg: Message) -> tuple:
    return (msg.src, msg.dst, msg.kind, msg.microbatch, msg.stage)
