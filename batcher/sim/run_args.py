"""`batcher sim run` flags and what they build: the fleet's configuration, step model, request
shape and arrival process. Shared by the CLI, the routing study and tests."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

from batcher.fleet.router.retry_flags import add_retry_budget_args
from batcher.workloads import DEFAULT_STEP_MODEL as PACKAGED_STEP_MODEL
from batcher.sim.hetero import parse_pair, parse_stall

DEFAULT_STEP_MODEL = str(PACKAGED_STEP_MODEL)  # the calibrated CPU model, shipped in the package


def _arg(parse: Callable[..., Any], *extra: str) -> Callable[[str], Any]:
    """An argparse `type` from a parser that raises ValueError: a usage error, not a trace."""
    def convert(text: str) -> Any:
        try:
            return parse(text, *extra)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return convert


def fleet_args(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--step-model", default=DEFAULT_STEP_MODEL, help="calibrated JSON, 'source' (the "
      "source's rates) or const:SECONDS (default: %(default)s)")
    a("--replicas", type=int, default=16, help="replicas in the fleet (default: %(default)s)")
    a("--zones", type=int, default=3, help="failure zones the replicas are spread over "
      "(default: %(default)s)")
    a("--duration", type=float, default=60.0, help="simulated seconds of arrivals "
      "(default: %(default)s)")
    a("--warmup", type=float, default=10.0, help="simulated seconds at the start "
      "whose arrivals are not measured (default: %(default)s)")
    a("--policy", default="fleet", help="p2c-kv, round-robin, random, least-loaded, oracle "
      "(least predicted TTFT from live state), or fleet (the fleet router's policy)")
    a("--arrivals", default="poisson", choices=["poisson", "burst", "diurnal", "all"],
      help="arrival process; 'all' sends --count requests at t=0 (default: %(default)s)")
    a("--rate", type=float, default=None, help="requests/s (default: from --load)")
    a("--load", type=float, default=0.85, help="offered load as a share of the fleet's "
      "capacity, measured on one replica with the replicas' own scheduler settings and a deep "
      "queue, when --rate is not given (default: %(default)s)")
    a("--count", type=int, default=None, help="requests for --arrivals all (default: the "
      "workload file's size, else 64)")
    a("--burst-size", type=int, default=32, help="requests per burst for --arrivals burst "
      "(default: %(default)s)")
    a("--burst-interval", type=float, default=10.0, help="seconds between bursts "
      "(default: %(default)s)")
    a("--amplitude", type=float, default=0.5, help="diurnal swing as a share of the mean "
      "rate (default: %(default)s)")
    a("--period", type=float, default=600.0, help="diurnal period in seconds "
      "(default: %(default)s)")
    a("--workload", default=None, help="a workload file (replaces the lognormal shape)")
    a("--input-median", type=float, default=256, help="median prompt length in tokens "
      "(default: %(default)s)")
    a("--output-median", type=float, default=64, help="median output length in tokens "
      "(default: %(default)s)")
    a("--sigma", type=float, default=0.6, help="lognormal sigma of both lengths "
      "(default: %(default)s)")
    a("--prefix-groups", type=int, default=0, help="groups of requests sharing a prompt "
      "prefix; 0 = none (default: %(default)s)")
    a("--prefix-tokens", type=int, default=0, help="tokens in each shared prefix "
      "(default: %(default)s)")
    a("--max-num-seqs", type=int, default=64, help="sequences per replica step "
      "(default: %(default)s)")
    a("--max-num-batched-tokens", type=int, default=320, help="upper bound on tokens per "
      "replica step (default: %(default)s)")
    a("--num-blocks", type=int, default=4096, help="KV blocks per replica "
      "(default: %(default)s)")
    a("--heartbeat-interval", type=float, default=1.0, help="seconds between a replica's "
      "heartbeats (default: %(default)s)")
    a("--heartbeat-delay", type=float, default=0.05, help="seconds a heartbeat takes to "
      "reach the router (default: %(default)s)")
    a("--stale-after", type=float, default=3.0, help="seconds without a heartbeat before "
      "the router stops routing to a replica (default: %(default)s)")
    a("--piggyback", action=argparse.BooleanOptionalAction, default=True,
      help="each stream's first answer refreshes the router's view of its replica, as the "
      "fleet router reads `X-Replica-State` (default: on)")
    a("--no-eject", action="store_true", help="keep routing to a replica that refused a "
      "connection until its heartbeats go stale")
    a("--no-reservations", action="store_true", help="the router forgets what it sent")
    a("--max-waiting", type=int, default=64, help="replica queue bound (final fit check)")
    a("--admission", action="store_true", help="replicas admit as `batcher serve` does: a "
      "request only when its predicted TTFT is within --slo-ttft-ms and one more stream keeps "
      "--slo-tpot-ms, else a 503 the router retries elsewhere")
    add_retry_budget_args(p, unlimited=True)
    a("--max-attempts", type=int, default=5, help="tries per request, first included "
      "(default: %(default)s)")
    a("--fail-zone", action="append", default=[], metavar="Z@T[:D]",
      help="zone Z fails at T seconds for D seconds (forever without D); repeatable")
    a("--fail-replica", action="append", default=[], metavar="I@T[:D]",
      help="replica I fails at T seconds for D seconds (forever without D); repeatable")
    a("--slow-replicas", type=_arg(parse_pair, "--slow-replicas"), default=(0, 1.0),
      metavar="K:F", help="the first K replicas step F times "
      "slower")
    a("--small-kv", type=_arg(parse_pair, "--small-kv"), default=(0, 0), metavar="K:BLOCKS",
      help="the next K replicas have BLOCKS KV blocks")
    a("--stall", type=_arg(parse_stall), action="append", default=[], metavar="I@T:D",
      help="replica I takes no step from T for D seconds (repeatable)")
    a("--slo-ttft-ms", type=float, default=1000.0, help="goodput TTFT bound, and the SLO "
      "the replicas' schedulers pace first tokens to, as `batcher serve --slo-ttft-ms` is both "
      "(default: %(default)s)")
    a("--slo-tpot-ms", type=float, default=200.0, help="goodput TPOT bound (and "
      "admission's, with --admission); the replicas' schedulers have no TPOT target, as "
      "`batcher serve` at its defaults (default: %(default)s)")
    a("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    a("--json-out", default=None, help="write the summary as JSON here")
    a("--plot", default=None, help="write a PNG of the run here")


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
    from batcher.sim.stepmodel import load_step_model
    from batcher.sim.capacity import replica_capacity
    from batcher.sim.workload import ArrivalSpec, ShapeSpec

    model = load_step_model(args.step_model)
    slow_k, slow_f = args.slow_replicas
    small_k, small_b = args.small_kv
    cfg = FleetConfig(
        replicas=args.replicas, zones=args.zones, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, num_blocks=args.num_blocks,
        policy=args.policy, heartbeat_interval=args.heartbeat_interval,
        heartbeat_delay=args.heartbeat_delay, stale_after=args.stale_after,
        reservations=not args.no_reservations, piggyback=args.piggyback,
        eject_on_refused=not args.no_eject,
        max_waiting=args.max_waiting, admission=args.admission,
        retry_ratio=args.retry_ratio, retry_floor=args.retry_floor,
        retry_window=args.retry_window,
        max_attempts=args.max_attempts,
        slo_ttft=args.slo_ttft_ms / 1e3, slo_tpot=args.slo_tpot_ms / 1e3,
        duration=args.duration, warmup=args.warmup, failures=parse_failures(args),
        slow_replicas=slow_k, slow_factor=slow_f, small_kv_replicas=small_k,
        small_kv_blocks=int(small_b), stalls=list(args.stall),
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


