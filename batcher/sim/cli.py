"""`batcher plan` and `batcher sim {calibrate,run,validate,study}` argument parsing and entry
points. `batcher/cli.py` hooks them in with `add_plan_args` / `run_plan` and `add_sim_args` /
`run_sim`; `python -m batcher.sim.cli plan|sim ...` runs them standalone."""

from __future__ import annotations

import argparse
import json
import math
import sys

DEFAULT_STEP_MODEL = "workloads/step_time_cpu.json"


def add_plan_args(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--example", choices=["source"], help="print the source's own figures and exit")
    a("--shape", action="append", default=[], metavar="NAME:IN:OUT:RATE",
      help="a request class: mean input and output tokens and requests/s (repeatable)")
    a("--input", type=float, default=1000.0, help="mean input tokens (default: %(default)s)")
    a("--output", type=float, default=250.0, help="mean output tokens (default: %(default)s)")
    a("--rate", type=float, default=1000.0, help="requests/s (default: %(default)s)")
    a("--prefill-rate", type=float, default=20_000.0, help="prefill tokens/s per replica "
      "(default: %(default)s)")
    a("--decode-rate", type=float, default=2_500.0, help="decode tokens/s per replica with "
      "every slot busy (default: %(default)s)")
    a("--slots", type=int, default=64, help="concurrent sequences per replica "
      "(default: %(default)s)")
    a("--from-step-model", default=None, metavar="JSON", help="take the prefill and decode "
      "rates from a calibrated step model (at --slots decodes, context --context)")
    a("--context", type=int, default=512, help="decode context for --from-step-model "
      "(default: %(default)s)")
    a("--utilisation", type=float, default=0.7, help="target utilisation (default: "
      "%(default)s)")
    a("--zones", type=int, default=3, help="zones (default: %(default)s)")
    a("--ttft", type=float, default=None, help="expected TTFT in s, queueing included, for "
      "Little's law (default: input / prefill rate)")
    a("--tpot", type=float, default=None, help="measured TPOT in s (default: slots / decode "
      "rate, the equal share of a full replica)")
    a("--json", action="store_true", help="print JSON instead of a table")


def run_plan(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from batcher.sim.plan import Replica, Shape, format_plans, plan, source_example

    if args.example == "source":
        plans = source_example()
    else:
        pre, dec = args.prefill_rate, args.decode_rate
        if args.from_step_model:
            from batcher.sim.calibrate import rates_from_model
            from batcher.sim.stepmodel import load_step_model

            pre, dec = rates_from_model(load_step_model(args.from_step_model), args.slots,
                                        args.context)
        rep = Replica(pre, dec, args.slots)
        shapes = []
        for spec in args.shape or [f"request:{args.input}:{args.output}:{args.rate}"]:
            name, i, o, r = spec.rsplit(":", 3)
            shapes.append(Shape(name, float(i), float(o), float(r), ttft=args.ttft,
                                tpot=args.tpot))
        plans = [plan(s, rep, args.utilisation, args.zones) for s in shapes]
    if args.json:
        print(json.dumps([asdict(p) for p in plans], indent=1))
    else:
        print(format_plans(plans))
    return 0


def _fleet_args(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--step-model", default=DEFAULT_STEP_MODEL, help="calibrated JSON, 'source' (the "
      "source's rates) or const:SECONDS (default: %(default)s)")
    a("--replicas", type=int, default=16)
    a("--zones", type=int, default=3)
    a("--duration", type=float, default=60.0, help="simulated seconds of arrivals")
    a("--warmup", type=float, default=10.0, help="arrivals before this are not measured")
    a("--policy", default="p2c-kv", help="p2c-kv, round-robin, random, least-loaded, oracle "
      "(least predicted TTFT from live state), or fleet (the fleet router's policy)")
    a("--arrivals", default="poisson", choices=["poisson", "burst", "diurnal", "all"])
    a("--rate", type=float, default=None, help="requests/s (default: from --load)")
    a("--load", type=float, default=0.85, help="offered load as a share of the fleet's "
      "measured capacity, when --rate is not given (default: %(default)s)")
    a("--count", type=int, default=None, help="requests for --arrivals all (default: the "
      "workload file's size, else 64)")
    a("--burst-size", type=int, default=32)
    a("--burst-interval", type=float, default=10.0)
    a("--amplitude", type=float, default=0.5, help="diurnal swing (share of the mean)")
    a("--period", type=float, default=600.0, help="diurnal period in s")
    a("--workload", default=None, help="a workload file (replaces the lognormal shape)")
    a("--input-median", type=float, default=256)
    a("--output-median", type=float, default=64)
    a("--sigma", type=float, default=0.6, help="lognormal spread of both lengths")
    a("--prefix-groups", type=int, default=0)
    a("--prefix-tokens", type=int, default=0)
    a("--max-num-seqs", type=int, default=64)
    a("--max-num-batched-tokens", type=int, default=320)
    a("--num-blocks", type=int, default=4096)
    a("--heartbeat-interval", type=float, default=1.0)
    a("--heartbeat-delay", type=float, default=0.05)
    a("--stale-after", type=float, default=3.0)
    a("--piggyback", action="store_true", help="responses refresh the router's view")
    a("--no-eject", action="store_true", help="keep routing to a replica that refused a "
      "connection until its heartbeats go stale")
    a("--no-reservations", action="store_true", help="the router forgets what it sent")
    a("--max-waiting", type=int, default=64, help="replica queue bound (final fit check)")
    a("--retry-ratio", default="0.1", help="retry budget share of requests, or 'none'")
    a("--max-attempts", type=int, default=5)
    a("--fail-zone", action="append", default=[], metavar="Z@T[:D]")
    a("--fail-replica", action="append", default=[], metavar="I@T[:D]")
    a("--slow-replicas", default=None, metavar="K:F", help="the first K replicas step F times "
      "slower")
    a("--small-kv", default=None, metavar="K:BLOCKS", help="the next K replicas have BLOCKS KV "
      "blocks")
    a("--stall", action="append", default=[], metavar="I@T:D", help="replica I takes no step "
      "from T for D seconds (repeatable)")
    a("--slo-ttft-ms", type=float, default=1000.0, help="goodput TTFT bound "
      "(default: %(default)s)")
    a("--slo-tpot-ms", type=float, default=200.0, help="goodput TPOT bound "
      "(default: %(default)s)")
    a("--seed", type=int, default=0)
    a("--json-out", default=None, help="write the summary as JSON here")
    a("--plot", default=None, help="write a PNG of the run here")


def add_sim_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="sim_command", required=True)
    c = sub.add_parser("calibrate", help="fit a step-time model to the real model runner")
    c.add_argument("--out", default=DEFAULT_STEP_MODEL)
    c.add_argument("--reps", type=int, default=3)
    c.add_argument("--rounds", type=int, default=3)
    c.add_argument("--quick", action="store_true", help="a 10-point grid")
    c.add_argument("--dtype", default="bfloat16")
    _fleet_args(sub.add_parser("run", help="simulate a fleet"))
    v = sub.add_parser("validate", help="one simulated replica vs the real engine")
    v.add_argument("--step-model", default=DEFAULT_STEP_MODEL)
    v.add_argument("--workload", default=None, help="default: workloads/chat64.json")
    v.add_argument("--poisson-rate", type=float, default=None, help="also a Poisson run")
    v.add_argument("--num-blocks", type=int, default=4096)
    v.add_argument("--runs", type=int, default=1, help="real runs per case (median taken)")
    v.add_argument("--no-append", action="store_true", help="do not write BENCHMARKS.md")
    s = sub.add_parser("study", help="the docs/capacity.md studies")
    s.add_argument("name", choices=["policies", "policies-kv", "retry", "headroom", "cells",
                                    "speed"])
    s.add_argument("--step-model", default=DEFAULT_STEP_MODEL)
    s.add_argument("--quick", action="store_true", help="smaller and shorter (for a smoke run)")
    s.add_argument("--out-dir", default="docs/img")


def parse_failures(args: argparse.Namespace) -> list:
    from batcher.sim.fleet_sim import Failure

    out = []
    for kind, specs in (("zone", args.fail_zone), ("replica", args.fail_replica)):
        for spec in specs:
            target, _, rest = spec.partition("@")
            at, _, dur = rest.partition(":")
            f = Failure(float(at), duration=float(dur) if dur else math.inf,
                        **{kind: int(target)})
            out.append(f)
    return out


def fleet_from_args(args: argparse.Namespace):
    """(FleetConfig, step model, ShapeSpec, ArrivalSpec) from `sim run` arguments."""
    from batcher.bench.common import load_workload
    from batcher.sim.fleet_sim import FleetConfig
    from batcher.sim.hetero import parse_pair, parse_stall
    from batcher.sim.stepmodel import load_step_model
    from batcher.sim.studies import replica_capacity
    from batcher.sim.workload import ArrivalSpec, ShapeSpec

    model = load_step_model(args.step_model)
    ratio = None if args.retry_ratio == "none" else float(args.retry_ratio)
    slow_k, slow_f = parse_pair(args.slow_replicas, "--slow-replicas") if args.slow_replicas \
        else (0, 1.0)
    small_k, small_b = parse_pair(args.small_kv, "--small-kv") if args.small_kv else (0, 0)
    cfg = FleetConfig(
        replicas=args.replicas, zones=args.zones, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, num_blocks=args.num_blocks,
        policy=args.policy, heartbeat_interval=args.heartbeat_interval,
        heartbeat_delay=args.heartbeat_delay, stale_after=args.stale_after,
        reservations=not args.no_reservations, piggyback=args.piggyback,
        eject_on_refused=not args.no_eject,
        max_waiting=args.max_waiting, retry_ratio=ratio, max_attempts=args.max_attempts,
        slo_ttft=args.slo_ttft_ms / 1e3, slo_tpot=args.slo_tpot_ms / 1e3,
        duration=args.duration, warmup=args.warmup, failures=parse_failures(args),
        slow_replicas=slow_k, slow_factor=slow_f, small_kv_replicas=small_k,
        small_kv_blocks=int(small_b), stalls=[parse_stall(x) for x in args.stall],
        seed=args.seed)
    shape = ShapeSpec(input_median=args.input_median, input_sigma=args.sigma,
                      output_median=args.output_median, output_sigma=args.sigma,
                      prefix_groups=args.prefix_groups, prefix_tokens=args.prefix_tokens,
                      workload_file=args.workload)
    count = args.count
    if count is None:
        count = len(load_workload(args.workload)) if args.workload else 64
    rate = args.rate
    if rate is None and args.arrivals == "all":
        rate = 1.0
    if rate is None:  # slow replicas bring 1/F of a replica's capacity each
        cap = replica_capacity(cfg, model, shape)
        rate = args.load * cap * (args.replicas - slow_k + slow_k / slow_f)
    arr = ArrivalSpec(args.arrivals, rate=rate, burst_size=args.burst_size,
                      burst_interval=args.burst_interval, amplitude=args.amplitude,
                      period=args.period, count=count)
    return cfg, model, shape, arr


def run_sim(args: argparse.Namespace) -> int:
    cmd = args.sim_command
    if cmd == "calibrate":
        from batcher.sim.calibrate import run_calibration

        m = run_calibration(args.out, reps=args.reps, rounds=args.rounds, quick=args.quick,
                            dtype=args.dtype)
        meta = m.meta
        print(f"wrote {args.out}: intercept {m.intercept * 1e3:.2f} ms, knot {m.knot}, "
              f"coef {[round(c, 6) for c in m.coef]}\nfit: R^2 {meta['r2']:.3f}, mean abs "
              f"error {meta['mape']:.1%} (max {meta['max_ape']:.1%}), cross-validated "
              f"{meta['cv_mape']:.1%}; outliers dropped: {meta['outliers'] or 'none'}")
        return 0
    if cmd == "run":
        from batcher.sim.fleet_sim import FleetSim
        from batcher.sim.metrics import format_summary

        cfg, model, shape, arr = fleet_from_args(args)
        print(f"{arr.kind} arrivals at {arr.rate:,.2f}/s onto {cfg.replicas} replicas",
              flush=True)
        res = FleetSim(cfg, model, shape, arr).run()
        print(format_summary(res.summary))
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(res.summary, f, indent=1, default=str)
        if args.plot:
            from batcher.sim.plots import plot_run

            plot_run(res, args.plot, f"{res.summary['policy']}, {cfg.replicas} replicas")
        return 0
    if cmd == "validate":
        from batcher.sim.validate import run_validation

        return run_validation(args)
    from batcher.sim.studies import run_study

    return run_study(args.name, args.step_model, args.out_dir, args.quick)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="batcher")
    sub = parser.add_subparsers(dest="command", required=True)
    add_plan_args(sub.add_parser("plan", help="capacity arithmetic"))
    add_sim_args(sub.add_parser("sim", help="fleet simulator"))
    args = parser.parse_args(argv)
    return run_plan(args) if args.command == "plan" else run_sim(args)


if __name__ == "__main__":
    sys.exit(main())
