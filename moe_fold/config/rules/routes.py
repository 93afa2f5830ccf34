"""The rules of route traces and router replay (docs/routes.md)."""

from __future__ import annotations

from ..schema import Config
from .common import _at_least, _fmt


def _check_routes(config: Config, out: list[str]) -> None:
    t, moe = config.train, config.moe
    _at_least(out, "train.route_trace_every", t.route_trace_every, 0)
    for dotted, value, on in (("train.route_trace_every", t.route_trace_every, t.route_trace_every > 0),
                              ("moe.router_replay", moe.router_replay, moe.router_replay is not None)):
        if on and config.parallel.dynamic_cp:
            out.append(f"{dotted}={_fmt(value)} cannot run with parallel.dynamic_cp=true: dynamic cp moves "
                       f"tokens between ranks by document, so a token's place in the data is not known where "
                       f"it is routed")
    if moe.router_replay is not None and not moe.router_replay.strip():
        out.append(f"moe.router_replay={_fmt(moe.router_replay)} must name a route trace or a routes file")
