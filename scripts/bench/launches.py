"""Kernel launches per step of the GPU path, counted on the CPU: eager, and inside and around a
token bucket's captured graph.

The GPU path's launches are a function of the step's shape, not of its numbers, so they can be
counted without a GPU. The bundled model's shapes and weights in bf16 on the CPU, built as the
GPU runner builds its steps (the triton attention backend: decode rows by their block tables,
prompt chunks through the varlen kernel; the layer loop with the Triton kernels between the
matmuls). Every Triton kernel is replaced by a stub that counts its launch and runs nothing, and
every torch op that computes is counted through a dispatch mode (views and empty allocations
are not launches; on a GPU some ops launch more than one kernel, so the counts are a floor).
Sampling is left out: it is the same in every case.

Cases, for a step of `--decode-rows` decode rows (`--ctx` tokens cached each) and one prompt's
first `--chunk` tokens:
- eager, RoPE and the cache write through torch's ops (`Attention.attend`), as every step with
  a prompt chunk ran before;
- eager, RoPE and the cache write as one kernel, attention reading every key from the cache;
- the token bucket's forward: the nodes of its captured graph, and what a replay launches
  (the buffers' copies and the graph).

    python -m scripts.bench launches [--decode-rows 32] [--ctx 512] [--chunk 64] [--no-append]
"""

from __future__ import annotations

import collections
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from batcher.bench.common import append_rows
from scripts.bench._shared import command, parser

TRITON_MODULES = ("batcher.runtime.triton_attention", "batcher.runtime.triton_prefill",
                  "batcher.runtime.triton_norms")
NOT_LAUNCHES = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided",
                "lift_fresh", "detach", "detach_", "alias", "_local_scalar_dense"}


class OpCounter(TorchDispatchMode):
    """Counts the torch ops that compute (a GPU launches at least one kernel for each); with
    `into`, only those that write one of those tensors' storage (a step's copies to the device,
    where its host-side work runs on CPU tensors here too)."""

    def __init__(self, into: tuple[torch.Tensor, ...] = ()) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.into = {t.untyped_storage().data_ptr() for t in into}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        counted = not func.is_view and name not in NOT_LAUNCHES
        if counted and self.into:
            dest = args[0] if args and isinstance(args[0], torch.Tensor) else None
            counted = dest is not None and dest.untyped_storage().data_ptr() in self.into
        if counted:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


class KernelStub:
    """Stands in for a Triton kernel: `stub[grid](...)` counts a launch and computes nothing."""

    def __init__(self, name: str, launches: collections.Counter[str]) -> None:
        self.name, self.launches = name, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs) -> None:
            self.launches[self.name] += 1
        return launch


def stub_kernels(launches: collections.Counter[str]) -> None:
    import importlib

    for name in TRITON_MODULES:
        mod = importlib.import_module(name)
        for attr in dir(mod):
            if attr.startswith("_") and attr.endswith("_kernel"):
                setattr(mod, attr, KernelStub(attr, launches))


def count(run, into: tuple[torch.Tensor, ...] = ()) -> tuple[int, int, collections.Counter[str]]:
    """(torch ops, Triton launches, each by name) of `run()`; `into`: see `OpCounter`."""
    launches: collections.Counter[str] = collections.Counter()
    stub_kernels(launches)
    with torch.inference_mode(), OpCounter(into) as ops:
        run()
    return sum(ops.ops.values()), sum(launches.values()), ops.ops + launches


def main(argv: list[str]) -> int:
    ap = parser(__name__, __doc__, raw=True)
    ap.add_argument("--decode-rows", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=512, help="tokens cached per decode row")
    ap.add_argument("--chunk", type=int, default=64, help="prompt tokens in the step")
    ap.add_argument("--no-append", action="store_true", help="do not append to BENCHMARKS.md")
    args = ap.parse_args(argv)

    from batcher.bundled import DEFAULT_MODEL
    from batcher.core.outputs import ScheduledSeq, SchedulerOutput
    from batcher.core.sampling import SamplingParams
    from batcher.models.llama_layer_loop import LayerLoop
    from batcher.models.loader import load_model
    from batcher.runtime import triton_norms
    from batcher.runtime.mixed_graphs import MixedStepInputs, pick_bucket, token_buckets
    from batcher.runtime.model_runner import ModelRunner

    loaded = load_model(DEFAULT_MODEL, dtype="bfloat16", device="cpu")
    model = loaded.model
    loop = LayerLoop.for_model(model, triton_norms.TritonLayerOps("cpu"))
    if loop is None or loop.rope_cache is None:
        raise SystemExit("the bundled model runs no Triton layer loop")
    model.layer_loop = loop
    bs = 16
    per_row = -(-(args.ctx + 1) // bs)
    blocks = args.decode_rows * per_row + -(-args.chunk // bs) + 1
    # The GPU runner's metadata: decode rows by their tables, chunks through the varlen kernel.
    runner = ModelRunner(loaded, blocks, bs, attention_backend="triton", cuda_graphs=False)
    runner.triton_prefill, runner.staging = True, None
    sp = SamplingParams(temperature=0.0)
    first = args.decode_rows * per_row
    sched = SchedulerOutput(
        [ScheduledSeq(str(i), [7], args.ctx, list(range(i * per_row, (i + 1) * per_row)),
                      True, sp) for i in range(args.decode_rows)]
        + [ScheduledSeq("prompt", [7] * args.chunk, 0,
                        list(range(first, first + -(-args.chunk // bs))), True, sp)])

    def eager() -> None:
        ids, pos, meta, idx, _ = runner.prepare(sched)
        model(ids, pos, meta, runner.kv_caches, idx)

    rows = []
    loop.rope_cache = None
    attend = count(eager)
    loop.rope_cache = loop.ops
    fused = count(eager)
    buckets = [MixedStepInputs(t, 256, per_row + 1, bs, (blocks - 1) * bs, torch.device("cpu"))
               for t in token_buckets(8192)]
    i = pick_bucket(buckets, sched)
    if i is None:
        raise SystemExit(f"no token bucket holds {sched.num_batched_tokens} tokens")
    bucket = buckets[i]
    graph = count(lambda: bucket.forward(model, runner.kv_caches))
    fill = count(lambda: bucket.fill(sched), into=(bucket.rows, bucket.index, bucket.tables))
    layers = len(model.layers)
    shape = (f"{args.decode_rows} decode rows (ctx {args.ctx}) + {args.chunk}-token chunk, "
             f"{layers} layers")
    for what, (ops, kernels, _) in (("eager, RoPE and cache write through torch's ops", attend),
                                     ("eager, RoPE and cache write in one kernel", fused),
                                     (f"captured: graph nodes ({bucket.tokens}-token bucket)",
                                      graph)):
        rows.append([what, shape, str(ops), str(kernels), str(ops + kernels),
                     f"{(ops + kernels) / layers:.1f}"])
    rows.append([f"captured: launches per replay ({bucket.tokens}-token bucket)", shape,
                 f"{fill[0]} copies to the device", "1 graph", str(fill[0] + 1), "-"])
    for r in rows:
        print(" | ".join(r))
    for what, counted in (("eager, one kernel", fused), ("graph", graph), ("replay", fill)):
        print(f"{what}, by op:", dict(counted[2].most_common()), file=sys.stderr)
    if not args.no_append:
        print(append_rows(
            "GPU path launches per step, counted on the CPU (bundled model, bf16)",
            ["step", "shape", "torch ops", "Triton launches", "launches", "per layer"], rows,
            notes="A count, not a timing: each torch op that computes is one launch at least "
            "(views and empty allocations excluded), Triton kernels stubbed and counted. "
            "Sampling not included.", command=command(__name__, *argv)))
    return 0
