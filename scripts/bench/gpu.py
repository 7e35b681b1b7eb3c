"""The GPU path in one go: decode step vs the bandwidth floor, chat64 vs transformers batching.

Decode step time against the memory-bandwidth floor, and chat64 through the engine against
`transformers` static batching on the same device, dtype, weights and prompts.

    python -m scripts.bench gpu            # both, the bundled model, appended to BENCHMARKS.md
    python -m scripts.bench gpu --only decode --model llama-3.1-8b --load-format dummy \\
        --batches 32 --ctx 2048 --json decode-8b.json
    python -m scripts.bench gpu --device cpu --model tiny --dtype float32 --requests 4 \\
        --max-tokens 8 --batches 2 --ctx 32 --hf-batches 2 --no-append   # a smoke run, no GPU

The engine is built as `batcher serve` builds it at its default flags (`batcher.app.serve.
build_engine`). The baseline is `transformers`' LlamaForCausalLM holding our model's weights (so a
random-weight `--load-format dummy` model has a twin too), fed the same token ids left-padded in
static batches in arrival order; each batch decodes to its longest member with EOS suppressed
(`min_new_tokens`), so every request gets at least its own token count, and both sides are
credited with exactly the requests' counts.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import time
from pathlib import Path

import torch

from batcher.bench.common import append_rows, load_workload, pct
from batcher.core.outputs import ScheduledSeq, SchedulerOutput
from batcher.core.request import Request
from batcher.core.sampling import SamplingParams
from batcher.models.loader import load_model
from batcher.runtime.model_runner import ModelRunner
from scripts.bench._shared import left_padded, parser

# Peak memory bandwidth by device name (the vendors' figures, bytes/s), most specific first.
BANDWIDTH = [("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12), ("H800", 3.35e12),
             ("A100-SXM4-80GB", 2.039e12), ("A100 80GB", 1.935e12), ("A100", 1.555e12),
             ("L40S", 0.864e12), ("L4", 0.3e12), ("A10G", 0.6e12), ("A10", 0.6e12)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read plus written per second by a large device-to-device copy."""
    n = 2**28 if device.type == "cuda" else 2**26
    x = torch.empty(n, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    sync(device)
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    sync(device)
    return 2 * n * 10 / (time.perf_counter() - t)


def bandwidth(device: torch.device) -> tuple[float, str]:
    """The card's peak bandwidth from the table by its name, else a measured copy."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, bw in BANDWIDTH:
            if key.lower() in name.lower():
                return bw, f"{name}: {bw / 1e12:.2f} TB/s (vendor figure)"
    else:
        name = "CPU"
    bw = copy_bandwidth(device)
    return bw, f"{name}: {bw / 1e9:.0f} GB/s (measured copy)"


def weight_bytes_read(loaded) -> int:
    """Bytes of weights one decode step reads: every matrix once; the embedding table only where
    it is also the output head (a step looks up just its rows otherwise)."""
    seen: set[int] = set()
    total = 0
    for name, p in loaded.model.named_parameters(remove_duplicate=False):
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        if name == "embed_tokens.weight" and not loaded.config.tie_word_embeddings:
            continue
        total += p.numel() * p.element_size()
    return total


# The prompt chunk of the mixed step timed beside each decode batch.
MIXED_CHUNK = 64


def decode_step_ms(runner: ModelRunner, batch: int, ctx: int, reps: int = 20) -> float:
    """Mean time of a decode-only step: `batch` sequences, each `ctx` tokens already cached."""
    return step_ms(runner, bench_step(runner, batch, ctx), reps)


def bench_step(runner: ModelRunner, batch: int, ctx: int, chunk: int = 0) -> SchedulerOutput:
    """`batch` decode rows, each `ctx` tokens already cached; with `chunk`, also a new prompt's
    first `chunk` tokens (a mixed step)."""
    sp = SamplingParams(temperature=0.0)
    nb = -(-(ctx + 1) // runner.block_size)
    seqs = [ScheduledSeq(str(i), [7], ctx, list(range(i * nb, (i + 1) * nb)), True, sp)
            for i in range(batch)]
    if chunk:
        first = batch * nb
        seqs.append(ScheduledSeq("prompt", [7] * chunk, 0,
                                 list(range(first, first + -(-chunk // runner.block_size))),
                                 True, sp))
    return SchedulerOutput(seqs)


def step_ms(runner: ModelRunner, sched: SchedulerOutput, reps: int) -> float:
    """Mean time of `runner` executing `sched`, after three unmeasured runs."""
    for _ in range(3):
        runner.execute(sched)
    sync(runner.device)
    t = time.perf_counter()
    for _ in range(reps):
        runner.execute(sched)
    sync(runner.device)
    return (time.perf_counter() - t) / reps * 1000


def run_decode(args: argparse.Namespace, bw: float) -> list[dict]:
    fmt = {} if args.load_format == "auto" else {"load_format": args.load_format}
    loaded = load_model(args.model, dtype=args.dtype, device=args.device, **fmt)
    batches = [int(b) for b in args.batches.split(",")]
    nb = -(-(args.ctx + 1) // 16)
    # One sequence more than the largest batch: the mixed step's prompt beside it.
    runner = ModelRunner(loaded, num_blocks=max(batches) * nb + MIXED_CHUNK // 16,
                         block_size=16, max_graph_batch=max(batches) + 1,
                         max_model_len=args.ctx + 16)
    for k, v in runner.kv_caches:  # defined values (random bits could be NaN in bf16)
        k.zero_()
        v.zero_()
    weights = weight_bytes_read(loaded)
    kv_tok = loaded.config.kv_bytes_per_token(loaded.dtype)
    out = []
    for b in batches:
        ms = decode_step_ms(runner, b, args.ctx)
        kv = b * args.ctx * kv_tok
        floor = (weights + kv) / bw * 1000
        row = {"model": loaded.name, "load_format": args.load_format,
               "dtype": str(loaded.dtype).removeprefix("torch."), "batch": b,
               "ctx": args.ctx, "step_ms": ms, "floor_ms": floor, "ratio": ms / floor,
               "weight_bytes": weights, "kv_bytes": kv, "tok_s": b / ms * 1000}
        print(f"decode {loaded.name} batch {b} ctx {args.ctx}: {ms:.3f} ms, floor "
              f"{floor:.3f} ms, x{ms / floor:.2f}", flush=True)
        row.update(mixed_step(runner, b, args.ctx))
        out.append(row)
    return out


def mixed_step(runner: ModelRunner, batch: int, ctx: int, reps: int = 20) -> dict:
    """The batch's decode rows beside a MIXED_CHUNK-token prompt chunk: replayed from a token
    bucket's graph and run eagerly, side by side (empty where no bucket's graph holds it)."""
    graphs = runner.mixed_graphs
    sched = bench_step(runner, batch, ctx, chunk=MIXED_CHUNK)
    if graphs is None or not graphs.can_run(sched):
        return {}
    graphed = step_ms(runner, sched, reps)
    runner.mixed_graphs = None
    try:
        eager = step_ms(runner, sched, reps)
    finally:
        runner.mixed_graphs = graphs
    print(f"mixed step, batch {batch} + a {MIXED_CHUNK}-token chunk: {graphed:.3f} ms "
          f"graphed, {eager:.3f} ms eager", flush=True)
    return {"mixed_chunk": MIXED_CHUNK, "mixed_ms": graphed, "mixed_eager_ms": eager}


def engine_for(args: argparse.Namespace):
    """The engine `batcher serve` builds at its default flags for this model and device."""
    from batcher.app.serve import build_engine
    from batcher.app.serve_flags import add_serve_args
    from batcher.engine.metrics import Metrics

    p = argparse.ArgumentParser()
    add_serve_args(p)
    flags = ["--model", args.model, "--device", args.device, "--dtype", args.dtype,
             "--embedding-model", "none"]
    if args.load_format != "auto":
        flags += ["--load-format", args.load_format]
    serve = p.parse_args(flags)
    return build_engine(serve, Metrics())


async def run_engine(engine, work: list[dict]) -> dict:
    """All of `work` at t=0 through the engine, after an unmeasured pass of the same prompts
    with 4 tokens each (compiles, graph captures and allocator growth are not billed)."""
    await engine.start()
    try:
        async def one(r: dict, tag: str, n: int, lat: list, ttft: list, exact: list) -> None:
            sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            got = 0
            async for ev in engine.generate(Request(f"{tag}{r['id']}", r["prompt_ids"], sp)):
                got += len(ev.token_ids)
                if ev.finished:
                    lat.append(time.perf_counter() - t0)
                    ttft.append(ev.ttft)
            exact.append(got == n)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(r, "warm-", 4, [], [], []) for r in work))
        lat: list[float] = []
        ttft: list[float] = []
        exact: list[bool] = []
        t0 = time.perf_counter()
        await asyncio.gather(*(one(r, "", r["max_new_tokens"], lat, ttft, exact) for r in work))
        wall = time.perf_counter() - t0
    finally:
        await engine.stop()
    tokens = sum(r["max_new_tokens"] for r in work)
    return {"wall": wall, "tok_s": tokens / wall, "p50": pct(lat, 50), "p99": pct(lat, 99),
            "ttft50": pct(ttft, 50), "exact": all(exact) and len(exact) == len(work),
            "max_num_seqs": engine.scheduler.config.max_num_seqs}


def hf_twin(loaded):
    """transformers' Llama holding `loaded`'s weights, on its device in its dtype."""
    from transformers import LlamaForCausalLM

    from tests.hf_reference import hf_config

    cfg = loaded.config
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    state = {}
    for name, t in loaded.model.state_dict().items():
        key = name if name.startswith("lm_head") else f"model.{name}"
        if ".qkv_proj." in key:
            for part, x in zip("qkv", t.split([q, kv, kv], 0)):
                state[key.replace("qkv_proj", f"{part}_proj")] = x
        elif ".gate_up_proj." in key:
            gate, up = t.split([cfg.intermediate_size] * 2, 0)
            state[key.replace("gate_up_proj", "gate_proj")] = gate
            state[key.replace("gate_up_proj", "up_proj")] = up
        else:
            state[key] = t
    with torch.device(loaded.device):
        model = LlamaForCausalLM(hf_config(cfg)).to(loaded.dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    model.tie_weights()
    return model.eval()


def run_hf_static(model, work: list[dict], batch: int, device: torch.device) -> dict:
    """Left-padded static batches in arrival order; each decodes to its longest member."""
    lat: list[float] = []
    exact = True
    sync(device)
    t0 = time.perf_counter()
    for i in range(0, len(work), batch):
        group = work[i:i + batch]
        ids, mask, new = left_padded(group)
        with torch.inference_mode():
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                 max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 pad_token_id=0)
        sync(device)
        exact &= out.shape[1] - ids.shape[1] == new
        lat += [time.perf_counter() - t0] * len(group)
    wall = time.perf_counter() - t0
    tokens = sum(r["max_new_tokens"] for r in work)
    return {"wall": wall, "tok_s": tokens / wall, "p50": pct(lat, 50), "p99": pct(lat, 99),
            "exact": exact}


def run_chat(args: argparse.Namespace) -> dict:
    work = load_workload(args.workload, args.requests)
    if args.max_tokens:
        for r in work:
            r["max_new_tokens"] = min(r["max_new_tokens"], args.max_tokens)
    engine = engine_for(args)
    loaded = engine.runner.loaded
    ours = asyncio.run(run_engine(engine, work))
    print(f"engine: {ours}", flush=True)
    del engine  # its KV pool and graphs: the baseline gets the memory back
    gc.collect()
    if loaded.device.type == "cuda":
        torch.cuda.empty_cache()
    model = hf_twin(loaded)
    with torch.inference_mode():  # CUDA context, kernels and allocator, as the engine had
        model.generate(input_ids=torch.tensor([work[0]["prompt_ids"]], device=loaded.device),
                       max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    hf = {}
    for b in [int(x) for x in args.hf_batches.split(",") if x]:
        hf[b] = run_hf_static(model, work, b, loaded.device)
        print(f"transformers static batch {b}: {hf[b]}", flush=True)
    best = max(hf, key=lambda b: hf[b]["tok_s"]) if hf else None
    return {"model": loaded.name, "load_format": args.load_format, "requests": len(work),
            "dtype": str(loaded.dtype).removeprefix("torch."), "engine": ours,
            "hf": {str(b): r for b, r in hf.items()}, "best_hf_batch": best,
            "speedup": ours["tok_s"] / hf[best]["tok_s"] if best else None}


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = parser(__name__, __doc__, raw=True)
    ap.add_argument("--only", choices=["all", "decode", "chat"], default="all")
    ap.add_argument("--device", default="cuda", help="(default: %(default)s)")
    ap.add_argument("--model", default="smollm2-135m", help="a model `batcher serve --model` "
                    "takes (default: %(default)s)")
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                    help="dummy: random weights in the model's shapes (default: %(default)s)")
    ap.add_argument("--dtype", default="bfloat16", help="(default: %(default)s)")
    ap.add_argument("--batches", default="1,8,32,128", help="decode batch sizes "
                    "(default: %(default)s)")
    ap.add_argument("--ctx", type=int, default=512, help="decode context, tokens "
                    "(default: %(default)s)")
    ap.add_argument("--workload", default=None, help="workload file (default: chat64)")
    ap.add_argument("--requests", type=int, default=None, help="the first N requests only")
    ap.add_argument("--max-tokens", type=int, default=None, help="cap every request's output "
                    "at this many tokens (a smoke run)")
    ap.add_argument("--quick", action="store_true", help="the first 16 requests, batches 1,32")
    ap.add_argument("--hf-batches", default="8,32,64", help="transformers static batch sizes, "
                    "'' to skip the baseline (default: %(default)s)")
    ap.add_argument("--json", default=None, help="write the results here as JSON")
    ap.add_argument("--no-append", action="store_true", help="do not append to BENCHMARKS.md")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests = args.requests or 16
        args.batches = "1,32"
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    bw, bw_source = bandwidth(device)
    result: dict = {"device": bw_source, "bandwidth": bw}
    if args.only in ("all", "decode"):
        result["decode"] = run_decode(args, bw)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.only in ("all", "chat"):
        result["chat"] = run_chat(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    rows = [[f"decode step, {d['model']}, batch {d['batch']}, ctx {d['ctx']}",
             f"{d['step_ms']:.3f} ms", f"{d['floor_ms']:.3f} ms", f"{d['ratio']:.2f}x",
             f"{d['tok_s']:.0f} tok/s"] for d in result.get("decode", [])]
    rows += [[f"mixed step, {d['model']}, batch {d['batch']} + {d['mixed_chunk']}-token chunk, "
              f"graphed", f"{d['mixed_ms']:.3f} ms", f"eager {d['mixed_eager_ms']:.3f} ms",
              f"{d['mixed_eager_ms'] / d['mixed_ms']:.2f}x", "-"]
             for d in result.get("decode", []) if "mixed_ms" in d]
    chat = result.get("chat")
    if chat:
        ours, n = chat["engine"], chat["requests"]
        best = chat["best_hf_batch"]
        rows.append([f"chat{n} engine (serve defaults, {ours['max_num_seqs']} seqs)",
                     f"{ours['tok_s']:.0f} tok/s", f"{ours['wall']:.2f} s wall",
                     f"{chat['speedup']:.2f}x vs best HF" if best else "-",
                     f"p50 TTFT {ours['ttft50']:.3f} s"])
        for b, r in chat["hf"].items():
            rows.append([f"chat{n} transformers static, batch {b}", f"{r['tok_s']:.0f} tok/s",
                         f"{r['wall']:.2f} s wall", "-", "-"])
    title = f"GPU path: {bw_source}, {args.model} ({args.load_format}), {args.dtype}"
    header = ["what", "measured", "floor / detail", "ratio", "rate"]
    if args.no_append:
        print(title)
        for r in rows:
            print(" | ".join(r))
    else:
        print(append_rows(title, header, rows))
    return 0

