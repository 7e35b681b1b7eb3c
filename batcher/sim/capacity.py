"""What `--load` is a share of: the requests/s one simulated replica completes with a deep queue,
run with the same scheduler settings as the fleet's replicas (`FleetConfig.scheduler_config`).

The queue is kept deep by a closed loop: `depth` requests are in the replica from the start, and
each one that finishes is replaced at once by the next. Arrivals then spread over the run, as
steady traffic above capacity does, so the scheduler paces them as it paces real traffic: only
the first requests, all there at t = 0, are one burst (`burst_window_s`), and they finish before
the measured window. The rate is taken between the 20th and 80th percentile of completions (no
ramp-up, no lone tail).
"""

from __future__ import annotations

from batcher.core.request import Request
from batcher.core.sampling import SamplingParams
from batcher.sim.engine_sim import SimReplica, Timing
from batcher.sim.fleet_types import FleetConfig
from batcher.sim.stepmodel import StepModel
from batcher.sim.workload import RequestGen, ShapeSpec

_CAPACITY: dict[tuple, float] = {}


def capacity_replica(cfg: FleetConfig, model: StepModel) -> SimReplica:
    """The replica the capacity is measured on: a full-speed one of the fleet, same scheduler
    settings, same KV pool."""
    return SimReplica(0, cfg.scheduler_config(), cfg.num_blocks, cfg.block_size, model,
                      prefix_caching=cfg.prefix_caching)


def run_closed_loop(rep: SimReplica, requests: list[Request], depth: int) -> list[float]:
    """Run `requests` through `rep`, `depth` at a time: the first `depth` at t = 0, then one
    more each time one finishes. Returns the finish times, in order."""
    pending = iter(requests)
    now = 0.0
    ends: list[float] = []

    def admit(k: int) -> None:
        for _ in range(k):
            r = next(pending, None)
            if r is None:
                return
            r.arrival_time = now
            rep.add(r, Timing(r.request_id, now, r.num_prompt_tokens, r.sampling.max_tokens), now)

    admit(depth)
    while (end := rep.start_step(now)) is not None:
        now = end
        done = rep.finish_step(now)
        ends += [now] * len(done)
        admit(len(done))
    return ends


def replica_capacity(cfg: FleetConfig, model: StepModel, shape: ShapeSpec, n: int = 400,
                     seed: int = 0) -> float:
    """Requests/s one replica of `cfg` completes with a deep queue (2 x max_num_seqs requests in
    it), on its own scheduler settings."""
    key = (id(model), shape, repr(cfg.scheduler_config()), cfg.num_blocks, cfg.block_size,
           cfg.prefix_caching, n, seed)
    if key in _CAPACITY:
        return _CAPACITY[key]
    gen = RequestGen(shape, seed)
    reqs = []
    for i in range(n):
        p, o, g = gen.lengths()
        sp = SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True)
        reqs.append(Request(str(i), gen.prompt(i, p, g), sp))
    ends = run_closed_loop(capacity_replica(cfg, model), reqs, 2 * cfg.max_num_seqs)
    a, b = ends[n // 5], ends[4 * n // 5]
    _CAPACITY[key] = (4 * n // 5 - n // 5) / (b - a)
    return _CAPACITY[key]
