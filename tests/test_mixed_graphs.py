"""Steps with prompt chunks in fixed-shape token buckets (`batcher.runtime.mixed_graphs`): the
padded step, every row through the varlen prefill kernel, against the runner's eager step, on
the tiny model. The buffers and the forward run eagerly here (compiled for a GPU where one is
present, else through Triton's interpreter on the CPU, as tests/test_triton_prefill.py does);
capturing them as CUDA graphs is tests/gpu/test_cuda_engine.py's."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from batcher.core.outputs import ScheduledSeq, SchedulerOutput
from batcher.core.sampling import SamplingParams
from tests.test_triton_attention import (
    DEVICE,
    compiled_already,
    kernel_modules,
    run_interpreted,
)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed")
# (module, a kernel of it): the decode and prefill kernels, and the GPU layer loop's.
KERNELS = [("batcher.runtime.triton_attention", "_paged_decode_kernel"),
           ("batcher.runtime.triton_prefill", "_paged_prefill_kernel"),
           ("batcher.runtime.triton_norms", "_rms_norm_kernel")]
GREEDY = SamplingParams(temperature=0.0)
BLOCKS = 16  # the pool; the last block is the buckets' scratch block, used by no sequence


def seq(rid: str, tokens: list[int], start: int, blocks: list[int], sample: bool = True,
        drafts: tuple[int, ...] = ()) -> ScheduledSeq:
    return ScheduledSeq(rid, tokens, start, blocks, sample, GREEDY, draft_token_ids=drafts)


# A prompt read whole, one read in two chunks, a short one; then decode rows beside chunks;
# then a row with drafts beside a decode row.
STEPS = [
    [seq("a", list(range(5, 25)), 0, [0, 1]), seq("b", [6, 7, 8], 0, [2]),
     seq("d", list(range(30, 46)), 0, [4, 5], sample=False)],
    [seq("a", [5], 20, [0, 1]), seq("b", [6], 3, [2]),
     seq("c", list(range(40, 47)), 0, [3], sample=False),
     seq("d", [50, 51, 52, 53, 54], 16, [4, 5])],
    [seq("b", [9], 4, [2]), seq("a", [11, 12, 13], 21, [0, 1], drafts=(12, 13)),
     seq("d", [55], 21, [4, 5])],
]


def test_interpreted_in_a_fresh_process() -> None:
    if not any(compiled_already(m, k) for m, k in KERNELS):
        pytest.skip("the interpreted tests run in this process")
    run_interpreted(__file__)


@pytest.fixture(scope="module")
def kernel():
    """The kernels' modules in the mode DEVICE needs; yields the layer loop's."""
    with kernel_modules(*KERNELS) as mods:
        yield mods[-1]


def test_buckets_cover_every_step_up_to_the_bound(kernel) -> None:
    from batcher.runtime.mixed_graphs import bucket_block_m, token_buckets

    assert token_buckets(8192) == [16, 32, 64, 128, 256, 512]
    assert token_buckets(320) == [16, 32, 64, 128, 256, 320]
    assert token_buckets(16) == [16] and token_buckets(10) == [10]
    # Powers of two whatever the step budget (the kernel's `tl.arange` takes no other).
    assert [bucket_block_m(t) for t in (10, 16, 128, 255, 256, 320, 511, 512, 8192)] == \
        [16, 16, 16, 16, 32, 32, 32, 64, 64]


def test_tiles_name_each_chunk_and_never_straddle_two(kernel) -> None:
    from batcher.runtime.triton_prefill import tiles_of

    assert tiles_of([1, 40, 16, 1], 16) == ([0, 1, 1, 1, 2, 3], [0, 0, 16, 32, 0, 0])


def buckets(tokens: list[int], max_seqs: int = 8, max_blocks: int = 4):
    from batcher.runtime.mixed_graphs import MixedStepInputs

    return [MixedStepInputs(t, max_seqs, max_blocks, 16, (BLOCKS - 1) * 16, torch.device(DEVICE))
            for t in tokens]


def test_a_step_takes_the_smallest_bucket_that_holds_it(kernel) -> None:
    from batcher.runtime.mixed_graphs import pick_bucket

    bs = buckets([16, 32, 64], max_seqs=4)
    step = SchedulerOutput([seq("a", list(range(17)), 0, [0, 1])])
    assert pick_bucket(bs, step) == 1
    assert pick_bucket(bs, SchedulerOutput([seq("a", list(range(65)), 0, [0, 1, 2, 3, 4])])) \
        is None  # more tokens than the largest bucket
    five = SchedulerOutput([seq(str(i), [1], 3, [i]) for i in range(5)])
    assert pick_bucket(bs, five) is None  # more sequences than a bucket holds
    deep = SchedulerOutput([seq("a", [1], 64, [0, 1, 2, 3, 4])])
    assert pick_bucket(bs, deep) is None  # a context past the buckets' tables
    drafts = SchedulerOutput([seq(str(i), [1, 2, 3], 3, [i], drafts=(2, 3)) for i in range(2)])
    assert pick_bucket(bs, drafts) is None  # six sampled rows, four computed


def test_padding_names_the_empty_chunk_and_the_scratch_slot(kernel) -> None:
    (b,) = buckets([32], max_seqs=4)
    step = SchedulerOutput(STEPS[1])
    assert b.fill(step) == 3  # a, b, d sample; c's chunk is partial
    n = step.num_batched_tokens
    assert b.ids[:n].tolist() == [5, 6] + list(range(40, 47)) + [50, 51, 52, 53, 54]
    assert b.slots[n:].tolist() == [(BLOCKS - 1) * 16] * (32 - n)
    # The decode kernel's rows: a and b, then padding rows of one token.
    assert b.decode_lens.tolist() == [21, 4, 1, 1]
    assert b.decode_tables[:2, :2].tolist() == [[0, 1], [2, 0]]
    # The chunks c and d (first row, length, cached prefix), then empty ones.
    assert b.varlen.seqs.tolist() == [[2, 9, 0, 0, 0], [7, 5, 0, 0, 0], [0, 16, 0, 0, 0]]
    tiles = b.varlen.tiles.tolist()
    assert tiles[0] == [0, 1] + [4] * (b.max_tiles - 2) and tiles[1] == [0] * b.max_tiles
    assert b.logits_rows[:3].tolist() == [0, 1, 13]


def run_steps(loaded, runner, eager: bool, max_seqs: int = 8
              ) -> list[tuple[torch.Tensor, list]]:
    """Each step's logits and caches, from a fresh cache: the runner's own step or the padded
    bucket's."""
    from batcher.runtime.mixed_graphs import pick_bucket

    bs = buckets([16, 32, 64], max_seqs=max_seqs)
    for k, v in runner.kv_caches:
        k.zero_()
        v.zero_()
    out = []
    with torch.inference_mode():
        for step in map(SchedulerOutput, STEPS):
            if eager:
                ids, pos, meta, idx, _ = runner.prepare(step)
                logits = loaded.model(ids, pos, meta, runner.kv_caches, idx)
            else:
                b = bs[pick_bucket(bs, step)]
                n = b.fill(step)
                logits = b.forward(loaded.model, runner.kv_caches)[:n]
            out.append((logits.float().cpu(),
                        [c[:BLOCKS - 1].float().cpu().clone() for kv in runner.kv_caches
                         for c in kv]))
    return out


@pytest.mark.parametrize("max_seqs", [8, 64])
def test_padded_steps_compute_the_eager_steps(kernel, max_seqs: int) -> None:
    """fp32: each step's logits and every real block of the cache, step after step (later steps
    read what the padded ones wrote). With 64 sequences, the decode kernel's padded rows cover
    every row of the 16- and 32-token buckets, the chunks' rows included."""
    from batcher.models.loader import load_model
    from batcher.runtime.model_runner import ModelRunner

    loaded = load_model("tiny", dtype="float32", device=DEVICE)
    runner = ModelRunner(loaded, num_blocks=BLOCKS, block_size=16, cuda_graphs=False)
    eager = run_steps(loaded, runner, eager=True)
    padded = run_steps(loaded, runner, eager=False, max_seqs=max_seqs)
    for (want, want_kv), (got, got_kv) in zip(eager, padded):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for w, g in zip(want_kv, got_kv):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def eager_buckets():
    """`MixedGraphs` with its forwards run eagerly where a replay would run them (no capture),
    recording the bucket each step took."""
    from batcher.runtime.mixed_graphs import MixedGraphs, pick_bucket

    class Eager(MixedGraphs):
        taken: list[int] = []

        def _capture(self, device: torch.device) -> None:
            pass

        def run(self, sched: SchedulerOutput) -> torch.Tensor:
            b = self.buckets[pick_bucket(self.buckets, sched)]
            self.taken.append(b.tokens)
            n = b.fill(sched)
            return b.forward(self.model, self.kv_caches)[:n]

    return Eager


def test_the_runner_replays_buckets_for_steps_with_prompt_chunks(kernel) -> None:
    """The runner hands steps with prompt chunks to its buckets (here run eagerly, as a replay
    would run them) and samples the same tokens; steps that score prompt tokens stay eager."""
    from batcher.models.loader import load_model
    from batcher.runtime.model_runner import ModelRunner

    Eager = eager_buckets()
    loaded = load_model("tiny", dtype="float32", device=DEVICE)
    tokens = {}
    for mode in ("eager", "buckets"):
        runner = ModelRunner(loaded, num_blocks=BLOCKS, block_size=16, cuda_graphs=False)
        if mode == "buckets":
            runner.mixed_graphs = Eager(loaded.model, runner.kv_caches, 16, BLOCKS - 1, 4, 8,
                                        64, torch.device(DEVICE))
        tokens[mode] = [runner.execute(SchedulerOutput(s)).token_ids for s in STEPS]
        scored = SchedulerOutput([ScheduledSeq("s", [3, 4, 5], 0, [6], True, GREEDY,
                                               score_targets=(4, 5), score_offset=0)])
        assert runner.execute(scored).prompt_logprobs
    assert Eager.taken == [64, 16, 16]  # 39, 14 and 5 tokens; the scored step was not taken
    assert tokens["buckets"] == tokens["eager"]
    assert [len(t) for t in tokens["eager"]] == [2, 3, 3]  # an entry per sampling sequence


def test_prompts_arriving_while_others_decode(kernel) -> None:
    """Greedy generation with a prompt read beside the decode rows of earlier ones, through
    `execute`: the same tokens with the buckets as without (the GPU test replays graphs)."""
    from batcher.models.loader import load_model
    from batcher.runtime.model_runner import ModelRunner
    from tests.greedy_loop import staggered_generate

    loaded = load_model("tiny", dtype="float32", device=DEVICE)
    prompts = [[100 + 3 * i + j for j in range(9 + 7 * i)] for i in range(4)]
    eager = ModelRunner(loaded, 32, 16, cuda_graphs=False)
    buckets = ModelRunner(loaded, 32, 16, cuda_graphs=False)
    Eager = eager_buckets()
    buckets.mixed_graphs = Eager(loaded.model, buckets.kv_caches, 16, 31, 4, 8, 64,
                                 torch.device(DEVICE))
    assert staggered_generate(buckets, prompts, 8) == staggered_generate(eager, prompts, 8)
    # 9, 17, 25 and 33 tokens; then decode-only steps (no decode graphs here to take them).
    assert Eager.taken[:4] == [16, 32, 32, 64] and set(Eager.taken[4:]) == {16}


def test_padded_steps_through_the_gpu_layer_loop(kernel) -> None:
    """bf16 through the layer loop with the Triton kernels a GPU runs, RoPE and the cache write
    as one kernel: a bucket whose padded decode rows cover every row still attends its chunks
    (as a decode-only step would not) and matches the eager step."""
    from batcher.models.llama_layer_loop import LayerLoop
    from batcher.models.loader import load_model
    from batcher.runtime.model_runner import ModelRunner

    loaded = load_model("tiny", dtype="bfloat16", device=DEVICE)
    loaded.model.layer_loop = LayerLoop.for_model(loaded.model, kernel.TritonLayerOps(DEVICE))
    assert loaded.model.layer_loop is not None and loaded.model.layer_loop.rope_cache
    runner = ModelRunner(loaded, num_blocks=BLOCKS, block_size=16, cuda_graphs=False)
    eager = run_steps(loaded, runner, eager=True)
    padded = run_steps(loaded, runner, eager=False, max_seqs=64)
    for (want, _), (got, _) in zip(eager, padded):
        # bf16 attention through other kernels: a step of bf16 apart here and there.
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        torch.testing.assert_close(got, want, rtol=0.02, atol=0.1)


def test_a_mixed_step_reads_its_own_keys_from_the_cache_as_from_its_rows(kernel) -> None:
    """A GPU step with decode rows and prompt chunks through the layer loop: RoPE and the cache
    write first, in one kernel, then the attention kernels reading every key from the cache,
    against the loop with `Attention.attend` (the chunks' own keys from the step's rows): equal
    logits and caches, bit for bit."""
    from batcher.models.llama_layer_loop import LayerLoop
    from batcher.models.loader import load_model
    from batcher.runtime.model_runner import ModelRunner
    from tests.test_triton_norms import CountedRopeCache

    loaded = load_model("tiny", dtype="bfloat16", device=DEVICE)
    model = loaded.model
    ops = kernel.TritonLayerOps(DEVICE)
    loop = LayerLoop.for_model(model, ops)
    assert loop is not None and loop.rope_cache is ops
    runner = ModelRunner(loaded, num_blocks=BLOCKS, block_size=16, cuda_graphs=False)
    calls: list[int] = []
    model.layer_loop = None
    results = {}
    with torch.inference_mode():
        runner.execute(SchedulerOutput(STEPS[0]))  # the prompts' K/V in the cache
        base = [tuple(c.clone() for c in kv) for kv in runner.kv_caches]
        for case in ("attend", "fused"):
            for kv, saved in zip(runner.kv_caches, base):
                kv[0].copy_(saved[0])
                kv[1].copy_(saved[1])
            ids, pos, meta, idx, _ = runner.prepare(SchedulerOutput(STEPS[1]))
            # The triton backend's metadata: decode rows by their tables (the longest first,
            # as `prepare` orders them), chunks through the varlen kernel.
            meta.fused, meta.decode_groups = None, []
            meta.decode_tables = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32, device=DEVICE)
            meta.decode_lens = torch.tensor([21, 4], dtype=torch.int32, device=DEVICE)
            meta.triton_prefill = True
            for chunk in meta.prefills:
                chunk.stage = None  # a CPU runner's staged prompt K/V: none on a GPU
            model.layer_loop = loop
            loop.rope_cache = CountedRopeCache(ops, calls) if case == "fused" else None
            logits = model(ids, pos, meta, runner.kv_caches, idx).float().cpu()
            results[case] = (logits, [c.clone() for kv in runner.kv_caches for c in kv])
    model.layer_loop, loop.rope_cache = None, ops
    assert len(calls) == len(model.layers)
    (fused, fused_kv), (attend, attend_kv) = results["fused"], results["attend"]
    assert torch.equal(fused, attend)
    assert all(torch.equal(a, b) for a, b in zip(fused_kv, attend_kv))


def test_the_gpu_bench_times_a_mixed_step_both_ways(kernel) -> None:
    """`scripts.bench.gpu.mixed_step` (what the GPU check's decode line reports) runs the step
    through the buckets and eagerly, on a runner sized as the bench sizes it (one sequence
    more than the batch: the prompt beside it)."""
    from batcher.models.loader import load_model
    from batcher.runtime.model_runner import ModelRunner
    from scripts.bench.gpu import MIXED_CHUNK, mixed_step

    loaded = load_model("tiny", dtype="float32", device=DEVICE)
    batch, ctx = 2, 32
    runner = ModelRunner(loaded, num_blocks=BLOCKS, block_size=16, cuda_graphs=False)
    Eager = eager_buckets()
    runner.mixed_graphs = Eager(loaded.model, runner.kv_caches, 16, BLOCKS - 1, 4, batch + 1,
                                128, torch.device(DEVICE))
    got = mixed_step(runner, batch, ctx, reps=1)
    assert got["mixed_chunk"] == MIXED_CHUNK and got["mixed_ms"] > 0 and got["mixed_eager_ms"] > 0
    assert set(Eager.taken) == {128} and runner.mixed_graphs is not None
    runner.mixed_graphs = Eager(loaded.model, runner.kv_caches, 16, BLOCKS - 1, 4, batch, 128,
                                torch.device(DEVICE))
    assert mixed_step(runner, batch, ctx, reps=1) == {}  # no bucket holds batch + 1 sequences
