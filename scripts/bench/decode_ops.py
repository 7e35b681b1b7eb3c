"""Where a decode step's CPU time goes, and what fusing its small ops buys (torch ops vs fused).

The bundled model at batch 1 and 32, bf16 dense and int4, torch's ops alone
(`BATCHER_CPU_KERNELS=0`) vs the fused C kernels (the default eager path) vs `--compile-decode`
(one-row decode steps as one torch.compile graph; batch 32 stays eager), and optionally this
tree's model file vs an earlier revision's. Each (quantization, variant) runs in its own process,
interleaved round by round; loading on the main thread and stepping on a fresh one, as the engine
does. Appends a table to BENCHMARKS.md.

Usage: python -m scripts.bench decode_ops [--rounds 2] [--steps 16] [--threads N]
       [--against REV] [--no-append]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from scripts.bench._shared import ROOT, command, parser, python_path, rerun

MODEL_FILE = "batcher/models/llama.py"
QUANTS = ("none", "int4")
BATCHES = (1, 32)
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::_weight_int4pack_mm_for_cpu",
              "aten::_weight_int8pack_mm")


def _split(prof, steps: int) -> dict[str, float]:
    # Self CPU time of the profiled steps by kind of op, and aten calls per step.
    kinds: Counter[str] = Counter()
    calls = 0
    for e in prof.key_averages():
        if e.key.startswith("aten::"):
            calls += e.count
        kind = ("matmul" if e.key in MATMUL_OPS else
                "sdpa" if "scaled_dot_product" in e.key else "other")
        kinds[kind] += e.self_cpu_time_total
    total = sum(kinds.values()) or 1.0
    return {"ops_per_step": calls / steps, **{f"{k}_pct": 100 * kinds[k] / total
                                               for k in ("matmul", "sdpa", "other")}}


def _layer_us(model) -> float:
    """Thread CPU us of one layer's attention half at one row, attention itself stubbed out:
    input norm + QKV matmul + RoPE + o_proj, where the small ops' share is largest."""
    import torch

    from batcher.models import llama

    layer, real = model.layers[0], llama.paged_attention
    attn_out = torch.zeros(1, layer.self_attn.q_size, dtype=model.norm.weight.dtype)
    llama.paged_attention = lambda *args: attn_out
    try:
        x = model.embed_tokens(torch.tensor([7]))
        cos, sin = model.rotary().lookup(torch.tensor([64]))
        best = float("inf")
        with torch.inference_mode():
            for _ in range(6):
                c0 = time.thread_time()
                for _ in range(500):
                    layer.self_attn(layer.input_layernorm(x), cos, sin, None, None)
                best = min(best, (time.thread_time() - c0) / 500 * 1e6)
        return best
    finally:
        llama.paged_attention = real


def _child(variant: str, quant: str, steps: int, threads: int | None) -> dict[str, object]:
    import torch

    import batcher
    from batcher.models.loader import load_model
    from batcher.runtime.model_runner import ModelRunner

    if threads:
        torch.set_num_threads(threads)
    lm = load_model("smollm2-135m", dtype="bfloat16", device="cpu", quantization=quant)
    out: dict[str, object] = {"tree": str(Path(batcher.__file__).parent.parent)}
    t0, c0 = time.perf_counter(), time.process_time()
    # (only when asked: an earlier revision's runner may not know the argument)
    runner = ModelRunner(lm, num_blocks=32 * 8, block_size=16,
                         **({"compile_decode": True} if variant == "compile" else {}))
    if variant == "compile":
        if runner.compiled is None:
            raise RuntimeError("--compile-decode did not compile (see the log)")
        out["compile_s"] = time.perf_counter() - t0
        out["compile_cpu_s"] = time.process_time() - c0
    else:
        out["layer_us"] = _layer_us(lm.model)
        # Its calls ran parallel regions on this thread: let that pool go before the steps
        # run on another (two pools on 2 CPUs slow both; `batcher.system.threads`).
        from batcher.system.threads import release_openmp_pool

        release_openmp_pool()
    runner.tune_threads = False  # the thread count under test, every step
    worker = threading.Thread(target=_steps, args=(runner, steps, out))
    worker.start()
    worker.join()
    return out


def _steps(runner, steps: int, out: dict[str, object]) -> None:
    import torch

    from batcher.core.outputs import ScheduledSeq, SchedulerOutput
    from batcher.core.sampling import SamplingParams

    greedy = SamplingParams(temperature=0.0)

    def sched(batch: int, i: int) -> SchedulerOutput:
        return SchedulerOutput([ScheduledSeq(str(r), [7], 64 + i, list(range(8 * r, 8 * r + 8)),
                                             True, greedy) for r in range(batch)])

    for batch in BATCHES:
        for i in range(3):
            runner.execute(sched(batch, i))
        wall, cpu = [], []
        for i in range(steps):
            s = sched(batch, i)
            t0, c0 = time.perf_counter(), time.process_time()
            runner.execute(s)
            cpu.append(time.process_time() - c0)
            wall.append(time.perf_counter() - t0)
        out[f"b{batch}"] = 1000 * statistics.median(wall)
        out[f"b{batch}_cpu"] = 1000 * statistics.median(cpu)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for i in range(4):
            runner.execute(sched(1, i))
    out.update(_split(prof, 4))


def _base_tree(rev: str, into: str) -> str:
    # This package with the model file as it was at `rev`, so the comparison is the model's ops
    # alone, whatever else differs between the two revisions. Its children import it first.
    path = Path(into) / "tree"
    shutil.copytree(ROOT / "batcher", path / "batcher",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (path / MODEL_FILE).write_bytes(subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:{MODEL_FILE}"], capture_output=True,
        check=True).stdout)
    return str(path)


def _run(variant: str, quant: str, steps: int, base: str | None,
         threads: int | None) -> dict[str, float]:
    env = dict(os.environ)
    if variant == "torch-ops":
        env["BATCHER_CPU_KERNELS"] = "0"
    cwd = None
    if variant == "base":
        # `python -m` puts the working directory first on the path: run from the other tree so
        # its `batcher` is the one imported; this checkout's root stays on the path for `scripts`.
        env["PYTHONPATH"], cwd = python_path(base), base
    res = subprocess.run(rerun(__name__, "--child", variant, quant, "--steps", str(steps),
                               *(["--threads", str(threads)] if threads else [])),
                         check=False, capture_output=True, text=True, env=env, cwd=cwd,
                         timeout=900)
    if res.returncode:
        raise RuntimeError(f"{variant}/{quant} failed:\n{res.stderr[-3000:]}")
    got = json.loads(res.stdout.splitlines()[-1])
    want = base if variant == "base" else str(ROOT)
    if Path(got.pop("tree")).resolve() != Path(want).resolve():  # the wrong package was timed
        raise RuntimeError(f"{variant} imported batcher from the wrong tree")
    return got


def _cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
    return names[0] if names else platform.machine()


def main(argv: list[str]) -> None:
    p = parser(__name__, __doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--against", metavar="REV",
                   help=f"also time this tree with {MODEL_FILE} as it was at this git revision")
    p.add_argument("--threads", type=int, help="torch threads per run (default: torch's own)")
    p.add_argument("--no-append", action="store_true", help="print only, no BENCHMARKS.md row")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)  # one (variant, quant) run
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(_child(a.child[0], a.child[1], a.steps, a.threads)))
        return
    variants = (["base"] if a.against else []) + ["torch-ops", "eager", "compile"]
    ref = variants[0]
    best: dict[tuple[str, str], dict[str, float]] = {}
    loads = []
    with tempfile.TemporaryDirectory() as tmp:
        base = _base_tree(a.against, tmp) if a.against else None
        for r in range(a.rounds):
            for quant in QUANTS:
                for v in variants:
                    loads.append(os.getloadavg()[0])
                    got = _run(v, quant, a.steps, base, a.threads)
                    print(f"# round {r + 1} {quant} {v} {json.dumps(got)}", flush=True)
                    cur = best.setdefault((quant, v), got)  # op split: the first round's
                    for k in ("b1", "b1_cpu", "b32", "b32_cpu", "compile_s", "compile_cpu_s",
                              "layer_us"):
                        if k in got:
                            cur[k] = min(cur[k], got[k])
    name = {"base": f"llama.py at {a.against}",
            "torch-ops": "this tree, eager, torch's ops only (BATCHER_CPU_KERNELS=0)",
            "eager": "this tree, eager (fused CPU kernels)",
            "compile": "this tree, --compile-decode"}
    lines = [("| quantization | model | batch 1 ms (wall / CPU) | CPU vs first | batch 32 ms "
              "(wall / CPU) | CPU vs first | aten ops per batch-1 step | matmul / SDPA / other "
              "% of op CPU | attention half of a layer, us | compile wall / CPU s |"),
             "|" + "---|" * 10]
    for quant in QUANTS:
        for v in variants:
            m, f = best[(quant, v)], best[(quant, ref)]
            comp = (f"{m['compile_s']:.1f} / {m['compile_cpu_s']:.1f}" if "compile_s" in m
                    else "")
            layer = f"{m['layer_us']:.1f}" if "layer_us" in m else ""
            lines.append(
                f"| {quant} | {name[v]} | {m['b1']:.1f} / {m['b1_cpu']:.1f} | "
                f"x{m['b1_cpu'] / f['b1_cpu']:.2f} | {m['b32']:.1f} / {m['b32_cpu']:.1f} | "
                f"x{m['b32_cpu'] / f['b32_cpu']:.2f} | {m['ops_per_step']:.0f} | "
                f"{m['matmul_pct']:.0f} / {m['sdpa_pct']:.0f} / {m['other_pct']:.0f} | "
                f"{layer} | {comp} |")
    table = "\n".join(lines)
    print(table)
    if a.no_append:
        return
    cmd = command(__name__, *argv)
    stamp = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    with open(ROOT / "BENCHMARKS.md", "a") as f:
        f.write(f"\n### Decode step: torch's ops vs fused CPU kernels vs --compile-decode, bundled "
                f"model, bf16 "
                f"(scripts/bench/decode_ops.py) — {stamp}\n\n`{cmd}` on {_cpu_name()}, {os.cpu_count()} cores, shared with other work (load "
                f"average {min(loads):.1f}-{max(loads):.1f} at the runs' starts)\n\n{table}\n\n"
                f"Best median step of {a.steps} per case over {a.rounds} rounds, each case in its "
                "own process, cases interleaved; CPU = process CPU time per step (all threads), "
                "the ratio to compare on a shared machine. Op split: self CPU time of 4 profiled "
                "batch-1 steps. Attention half of a layer: layer 0's input norm + QKV matmul + "
                "RoPE + o_proj at one row with attention stubbed out, best thread-CPU mean of "
                "6 x 500 calls. Compile: building the runner, which compiles the one-row step "
                "(inductor's cache warm or cold as it happens to be).\n")

