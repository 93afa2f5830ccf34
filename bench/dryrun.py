"""How long `moe-fold dryrun` takes on the full-size presets at their named layouts, all
default ranks.

    OMP_WAIT_POLICY=PASSIVE python -m bench.dryrun [--presets mixtral-8x22b:128,deepseek-v3:1024] [--jobs N]

Runs the command as a user would (a fresh process each, ``--json``) and prints one JSON
line per preset: the wall time, the CPU time of the process and its workers, the ranks
traced, and the load average of the machine before and after (the wall time on a shared
machine depends on it; the CPU time much less).
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="mixtral-8x22b:128,deepseek-v3:1024",
                        help="comma-separated PRESET:WORLD pairs")
    parser.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)))
    args = parser.parse_args()
    for item in args.presets.split(","):
        preset, world = item.split(":")
        load = os.getloadavg()
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "moe_fold.cli", "dryrun", "--config", preset, "--world", world,
                              "--jobs", str(args.jobs), "--json"], check=True, capture_output=True, text=True).stdout
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        print(json.dumps({"preset": preset, "world": int(world), "jobs": args.jobs,
                          "ranks": len(json.loads(out)["ranks"]), "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
                          "load_before": [round(x, 1) for x in load],
                          "load_after": [round(x, 1) for x in os.getloadavg()]}), flush=True)


if __name__ == "__main__":
    main()
