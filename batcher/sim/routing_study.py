"""`batcher sim study routing`: the fleet router's policy against round-robin, random and the
oracle, on equal and on mixed replicas, at several heartbeat ages and fleet sizes.

Each scenario is a `sim run` command line (the table prints it), run once per policy and seed
(`--seeds`, averaged), so every policy sees the same arrivals and request sizes. The verdict per
row applies the routing contract to the means: the router's policy is never worse than round-robin (goodput within 0.5
points), within 2 points of the oracle, and where replicas differ better than round-robin by 5
points of goodput or a p99 TTFT at most 0.7 times round-robin's.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from batcher.sim.fleet_sim import FleetSim
from batcher.sim.run_args import fleet_args, fleet_from_args

POLICIES = ("round-robin", "random", "fleet", "oracle")
# (name, replicas, flags, replicas differ)
SCENARIOS_32 = [
    ("chat", "--load 0.85", False),
    ("heavy tail", "--sigma 1.0 --load 0.85", False),
    ("long prompts", ("--input-median 2000 --output-median 40 --load 0.8 --duration 60 "
     "--warmup 10"), False),
    ("bursts", "--arrivals burst --load 0.8", False),
    ("8 of 32 at half speed", "--load 0.85 --slow-replicas 8:2", True),
    # NOTE: overloaded for every policy, so measured in steady state: over a short window the
    # queues round-robin piles on slow replicas have not grown yet
    ("8 of 32 at half speed, long prompts",
     ("--input-median 2000 --output-median 40 --load 0.8 --slow-replicas 8:2 "
     "--duration 60 --warmup 10"), True),
    ("8 of 32 with 300 KV blocks", "--load 0.85 --small-kv 8:300", True),
    ("one replica stalls 5 s", "--load 0.85 --stall 3@12:5", True),
]
SCENARIOS_256 = [
    ("chat", "--load 0.85", False),
    ("64 of 256 at half speed", "--load 0.85 --slow-replicas 64:2", True),
]


def run_one(flags: str) -> dict:
    p = argparse.ArgumentParser()
    fleet_args(p)
    args = p.parse_args(flags.split())
    cfg, model, shape, arrivals = fleet_from_args(args)
    return FleetSim(cfg, model, shape, arrivals).run().summary


def run_seeds(flags: str, seeds: int) -> dict:
    """`run_one` at seeds 0 .. seeds-1; goodput and p99 TTFT are their means, every run's
    summary is kept under `runs`."""
    runs = [run_one(f"{flags} --seed {s}") for s in range(seeds)]
    if seeds == 1:
        return runs[0]
    return {"goodput": sum(r["goodput"] for r in runs) / seeds,
            "ttft_p99": sum(r["ttft_p99"] for r in runs) / seeds, "runs": runs}


def verdict(r: dict, differ: bool) -> str:
    rr, fl, orc = r["round-robin"], r["fleet"], r["oracle"]
    fails = []
    if fl["goodput"] < rr["goodput"] - 0.005:
        fails.append("below round-robin")
    if fl["goodput"] < orc["goodput"] - 0.02:
        fails.append("> 2 points below the oracle")
    # NOTE: 5 points better where round-robin leaves that much to gain; where it already
    # meets the SLO for more than 90%, at least half of what it leaves and a lower p99
    gain = min(0.05, (1 - rr["goodput"]) / 2)
    if differ and not ((fl["goodput"] >= rr["goodput"] + gain
                        and (gain == 0.05 or fl["ttft_p99"] < rr["ttft_p99"]))
                       or fl["ttft_p99"] <= 0.7 * rr["ttft_p99"]):
        fails.append("not clearly better than round-robin")
    return "pass" if not fails else "FAIL: " + ", ".join(fails)


def study_grid(quick: bool) -> list[tuple[str, int, float, str, bool]]:
    """(scenario, replicas, heartbeat interval, flags, replicas differ) per row. Every
    scenario with beats every second; the first two also every 0.1 s and every 2 s."""
    if quick:
        return [(name, 8, 1.0, flags.replace("8:", "2:").replace("3@12", "3@8"), differ)
                for name, flags, differ in SCENARIOS_32]
    grid = [(name, 32, 1.0, flags, differ) for name, flags, differ in SCENARIOS_32]
    for hb in (0.1, 2.0):
        grid += [(name, 32, hb, flags, differ) for name, flags, differ in SCENARIOS_32[:1]]
        grid += [(name, 32, hb, flags, differ) for name, flags, differ in SCENARIOS_32[4:5]]
    grid += [(name, 256, 1.0, flags, differ) for name, flags, differ in SCENARIOS_256]
    return grid


def _shown_path(path: str) -> str:
    """`path` as the table records it: relative to a checkout when it is the packaged model, so
    the recorded commands name no machine's folders."""
    root = Path(__file__).resolve().parent.parent.parent
    try:
        return str(Path(path).resolve().relative_to(root))
    except ValueError:
        return path


def run_routing_study(step_model: str, out_dir: str, quick: bool = False,
                      replicas: int | None = None, seeds: int | None = None) -> int:
    """Run the grid (only the rows of `replicas` replicas when given) and print the table.
    Each cell is the mean of `seeds` runs (default: 3 for the quick grid, whose few hundred
    requests per run put a single run's goodput about 2 points either way, else 1)."""
    t0 = time.perf_counter()
    seeds = seeds or (3 if quick else 1)
    if seeds < 1:
        raise ValueError("seeds must be >= 1")
    grid = [g for g in study_grid(quick) if replicas is None or g[1] == replicas]
    rows = []
    lines = ["| scenario | replicas | beat s | " + " | ".join(
        f"{p} goodput / p99 TTFT" for p in POLICIES) + " | verdict |",
        "|---|---|---|" + "---|" * (len(POLICIES) + 1)]
    shown = _shown_path(step_model)
    for name, n, hb, flags, differ in grid:
        # NOTE: the simulator's cost grows with the fleet; 256 replicas run a shorter window
        dur = "--duration 20 --warmup 4" if n <= 32 else "--duration 12 --warmup 4"
        cmd = f"--replicas {n} {dur} --heartbeat-interval {hb} --step-model {{}} {flags}"
        res = {p: run_seeds(f"{cmd.format(step_model)} --policy {p}", seeds) for p in POLICIES}
        v = verdict(res, differ)
        rows.append({"scenario": name, "replicas": n, "heartbeat_interval": hb, "seeds": seeds,
                     "flags": cmd.format(shown),
                     "verdict": v, **{p: res[p] for p in POLICIES}})
        cells = " | ".join(f"{res[p]['goodput']:.1%} / {res[p]['ttft_p99']:.2f} s"
                           for p in POLICIES)
        lines.append(f"| {name} | {n} | {hb:g} | {cells} | {v} |")
        print(lines[-1], flush=True)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = "capacity_routing" + (f"-{replicas}" if replicas else "") + ".json"
    (out / name).write_text(json.dumps(rows, indent=1, default=str) + "\n")
    print("\n".join(lines))
    print(f"study routing took {time.perf_counter() - t0:,.0f} s wall")
    return 0
