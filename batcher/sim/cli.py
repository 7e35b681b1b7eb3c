"""`batcher plan` and `batcher sim {calibrate,run,validate,study}` argument parsing and entry
points. `batcher/app/cli.py` hooks them in with `add_plan_args` / `run_plan` and `add_sim_args` /
`run_sim`; `python -m batcher.sim.cli plan|sim ...` runs them standalone."""

from __future__ import annotations

import argparse
import json
import sys

from batcher.sim.run_args import DEFAULT_STEP_MODEL, fleet_args, fleet_from_args

__all__ = ["add_plan_args", "add_sim_args", "fleet_from_args", "run_plan", "run_sim"]


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


def add_sim_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="sim_command", required=True)
    c = sub.add_parser("calibrate", help="fit a step-time model to the real model runner")
    c.add_argument("--out", default="step_time.json", help="JSON file to write, for "
                   "--step-model (default: %(default)s in the current directory)")
    c.add_argument("--reps", type=int, default=3, help="timed repetitions per grid point "
                   "(default: %(default)s)")
    c.add_argument("--rounds", type=int, default=3, help="passes over the grid, the median "
                   "kept (default: %(default)s)")
    c.add_argument("--quick", action="store_true", help="a 10-point grid")
    c.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"],
                   help="dtype of the bundled model measured on this CPU (default: %(default)s)")
    fleet_args(sub.add_parser("run", help="simulate a fleet"))
    v = sub.add_parser("validate", help="one simulated replica vs the real engine")
    v.add_argument("--step-model", default=DEFAULT_STEP_MODEL, help="calibrated JSON "
                   "(default: the packaged CPU model)")
    v.add_argument("--workload", default=None, help="workload JSON (default: the packaged "
                   "chat64.json)")
    v.add_argument("--poisson-rate", type=float, default=None, help="also a Poisson run at "
                   "this many requests/s (default: none)")
    v.add_argument("--num-blocks", type=int, default=4096, help="KV blocks of the real and "
                   "the simulated engine (default: %(default)s)")
    v.add_argument("--runs", type=int, default=1, help="real runs per case (median taken)")
    v.add_argument("--no-append", action="store_true", help="do not append to BENCHMARKS.md "
                   "in the current directory")
    s = sub.add_parser("study", help="the docs/capacity.md studies")
    s.add_argument("name", choices=["policies", "policies-kv", "retry", "headroom", "cells",
                                    "speed", "routing", "cells-balancer"])
    s.add_argument("--step-model", default=DEFAULT_STEP_MODEL, help="calibrated JSON "
                   "(default: the packaged CPU model)")
    s.add_argument("--quick", action="store_true", help="smaller and shorter (for a smoke run)")
    s.add_argument("--out-dir", default=".", help="folder for the figures and tables "
                   "(default: the current directory; docs/img in a checkout for the docs)")
    s.add_argument("--replicas", type=int, default=None, help="routing: only the rows of this "
                   "fleet size")
    s.add_argument("--seeds", type=int, default=None, help="routing: runs per cell, seeds 0.., "
                   "averaged (default: 3 with --quick, else 1)")


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
    if args.name == "cells-balancer":
        from batcher.sim.cells_study import main as cells_main

        return cells_main(["--quick"] if args.quick else [])
    if args.name == "routing":
        from batcher.sim.routing_study import run_routing_study

        return run_routing_study(args.step_model, args.out_dir, args.quick, args.replicas,
                                 args.seeds)
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
