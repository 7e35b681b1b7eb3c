"""Decode step time and resident memory of the bundled model by `--quantization`.

Step time at batch 1 and 32, and resident memory after loading: each kind in its own process,
interleaved (none, int8, int4, int4 without its dense copy, none, ...), loading on the main thread
and stepping on a fresh one, as the engine does (intra-op threads tuned per step size, as in the
engine).

Usage: python -m scripts.bench quantization [--rounds 2] [--steps 20]
Prints the best median ms/step per kind and batch, its ratio to none, and the resident set size.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import threading
import time

from scripts.bench._shared import parser, rerun

# "int4-nocopy": int4 without the dense copy (--quantized-dense-above 0): packed kernels at every
# batch size.
KINDS = ("none", "int8", "int4", "int4-nocopy")
# torchao's int8 weight-only config applied to the bf16 model's decoder layers (`--torchao`; needs
# `pip install torchao`, which the server does not depend on). Its int4 weight-only formats have no
# CPU kernel in torchao 0.18 (plain_int32: "does not support device 'cpu'"; the others are GPU
# layouts), so there is no torchao int4 row on a CPU.
TORCHAO_KINDS = ("torchao-int8",)
BATCHES = (1, 32)


def _one(kind: str, steps: int) -> dict[str, float]:
    from batcher.models.loader import load_model
    from batcher.runtime.model_runner import ModelRunner

    if kind.startswith("torchao-"):
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        lm = load_model("smollm2-135m", dtype="bfloat16", device="cpu")
        # The decoder layers' linears, as --quantization packs them (not the tied LM head).
        quantize_(lm.model.layers, Int8WeightOnlyConfig())
    else:
        quant, _, variant = kind.partition("-")
        lm = load_model("smollm2-135m", dtype="bfloat16", device="cpu", quantization=quant,
                        **({"dense_above": None} if variant == "nocopy" else {}))
    runner = ModelRunner(lm, num_blocks=32 * 8, block_size=16)
    out: dict[str, float] = {}
    threading.Thread(target=_steps, args=(runner, steps, out)).start()  # joined below
    for t in threading.enumerate():
        if t is not threading.current_thread():
            t.join()
    import gc

    gc.collect()  # the dense load-time tensors are gone; what remains is the served footprint
    with open("/proc/self/statm") as f:
        out["rss_mib"] = int(f.read().split()[1]) * resource.getpagesize() / 2**20
    return out


def _steps(runner, steps: int, out: dict[str, float]) -> None:
    from batcher.core.outputs import ScheduledSeq, SchedulerOutput
    from batcher.core.sampling import SamplingParams

    greedy = SamplingParams(temperature=0.0)
    for batch in BATCHES:
        tables = [list(range(8 * i, 8 * i + 8)) for i in range(batch)]
        times = []
        for i in range(steps):
            sched = SchedulerOutput([ScheduledSeq(str(r), [7], 64 + i, tables[r], True, greedy)
                                     for r in range(batch)])
            t0 = time.perf_counter()
            runner.execute(sched)
            times.append(time.perf_counter() - t0)
        out[f"b{batch}"] = 1000 * statistics.median(times[steps // 4:])


def main(argv: list[str]) -> None:
    p = parser(__name__, __doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--torchao", action="store_true", help="also torchao's int4 and int8 "
                   "weight-only configs (needs torchao installed)")
    p.add_argument("--kind", choices=KINDS + TORCHAO_KINDS, help=argparse.SUPPRESS)  # one run
    a = p.parse_args(argv)
    if a.kind:
        print(json.dumps(_one(a.kind, a.steps)))
        return
    kinds = KINDS + (TORCHAO_KINDS if a.torchao else ())
    best: dict[str, dict[str, float]] = {k: {} for k in kinds}
    for _ in range(a.rounds):
        for k in kinds:
            res = subprocess.run(rerun(__name__, "--kind", k, "--steps", str(a.steps)),
                                 capture_output=True, text=True, check=True, timeout=900)
            print("#", k, res.stdout.splitlines()[-1], flush=True)  # each run, as it ends
            for key, v in json.loads(res.stdout.splitlines()[-1]).items():
                best[k][key] = min(best[k].get(key, float("inf")), v)
    for k in kinds:
        row = "  ".join(f"batch {b}: {best[k][f'b{b}']:6.1f} ms "
                        f"(x{best[k][f'b{b}'] / best['none'][f'b{b}']:.2f})" for b in BATCHES)
        print(f"{k:12s} {row}  RSS {best[k]['rss_mib']:.0f} MiB")

