"""A prompt read in chunks attends over its contiguous staged K/V: the same logits as Hugging
Face's dense forward (and as reading the paged cache), refilled from the cache when the buffer
does not line up, dropped when the prompt is done, freed, idle, or over its byte budget."""

from __future__ import annotations

import random

import pytest
import torch

from batcher.core.outputs import ScheduledSeq, SchedulerOutput
from batcher.models.tiny import tiny_config, tiny_state
from batcher.runtime.model_runner import ModelRunner
from batcher.runtime.prefill_staging import MAX_IDLE_STEPS, PrefillStaging
from batcher.core.sampling import SamplingParams
from tests.hf_reference import hf_model_from_state

BLOCK = 16


def _run(runner: ModelRunner, seqs: list[ScheduledSeq]) -> tuple[torch.Tensor, list]:
    """All rows' logits of one step, and the step's prefill chunks."""
    ids, positions, meta, _, _ = runner.prepare(SchedulerOutput(seqs))
    return runner.model(ids, positions, meta, runner.kv_caches, torch.arange(len(ids))), \
        meta.prefills


def _chunk(rid, toks, start, n, blocks, last=False):
    return ScheduledSeq(rid, toks[start:start + n], start, blocks, last, SamplingParams())


@pytest.fixture(scope="module")
def hf():
    cfg = tiny_config()
    return hf_model_from_state(cfg, tiny_state(cfg, seed=0))


def _prompt(seed: int, n: int) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    blocks = list(range(64))
    rng.shuffle(blocks)  # non-contiguous block table
    return [rng.randrange(tiny_config().vocab_size) for _ in range(n)], blocks[:-(-n // BLOCK)]


@pytest.mark.parametrize("fold_gqa", [True, False])
def test_chunks_over_the_staged_context_match_hf(tiny_fp32, hf, fold_gqa):
    runner = ModelRunner(tiny_fp32, num_blocks=64, block_size=BLOCK)
    runner.fold_gqa = fold_gqa
    toks, blocks = _prompt(1, 90)
    other, oblocks = _prompt(2, 20)
    oblocks = [b for b in range(64) if b not in blocks][:2]
    _run(runner, [_chunk("o", other, 0, 19, oblocks, last=True)])
    cuts = [(0, 20), (20, 13), (33, 2), (35, 40), (75, 15)]
    got = []
    for i, (start, n) in enumerate(cuts):
        last = i == len(cuts) - 1
        # A decode row of another sequence shares every step, as under a running stream.
        logits, chunks = _run(runner, [_chunk("o", other, 19, 1, oblocks, True),
                                       _chunk("p", toks, start, n, blocks, last)])
        # Every chunk but the first reads the buffer the first one started.
        assert (chunks[0].stage is not None) == (i > 0 or not last)
        assert ("p" in runner.staging) == (not last)
        got.append(logits[1:])
    with torch.no_grad():
        want = hf(torch.tensor([toks])).logits[0]
    torch.testing.assert_close(torch.cat(got), want, atol=1e-5, rtol=1e-5)


def test_staged_equals_paged_cache_reads_in_bf16(tiny_fp32):
    """The production dtype: attending over the buffer is the same computation as over the
    gathered cache."""
    from batcher.models.loader import load_model

    tiny = load_model("tiny", dtype="bfloat16", device="cpu")
    outs = []
    for staged in (True, False):
        runner = ModelRunner(tiny, num_blocks=64, block_size=BLOCK)
        if not staged:
            runner.staging = None
        toks, blocks = _prompt(3, 120)
        rows = [_run(runner, [_chunk("p", toks, s, n, blocks, s + n == 120)])[0]
                for s, n in ((0, 64), (64, 2), (66, 3), (69, 51))]
        outs.append(torch.cat(rows))
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)


def test_refilled_from_the_cache_after_a_prefix_hit_and_a_recompute(tiny_fp32, hf):
    runner = ModelRunner(tiny_fp32, num_blocks=64, block_size=BLOCK)
    toks, blocks = _prompt(4, 80)
    # Another request computed the first 32 tokens into these blocks (a prefix-cache hit).
    _run(runner, [_chunk("first", toks, 0, 32, blocks, last=True)])
    assert len(runner.staging) == 0
    a, chunks = _run(runner, [_chunk("p", toks, 32, 16, blocks)])  # starts a buffer at 32
    assert chunks[0].stage is not None
    b, _ = _run(runner, [_chunk("p", toks, 48, 12, blocks)])
    # Preempted and recomputed from 40: the buffer (filled to 60) does not end there.
    c, chunks = _run(runner, [_chunk("p", toks, 40, 30, blocks)])
    assert chunks[0].stage is not None
    d, _ = _run(runner, [_chunk("p", toks, 70, 10, blocks, last=True)])
    with torch.no_grad():
        want = hf(torch.tensor([toks])).logits[0]
    torch.testing.assert_close(torch.cat([a, b]), want[32:60], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([c, d]), want[40:80], atol=1e-5, rtol=1e-5)
    assert len(runner.staging) == 0


def test_buffers_are_dropped_when_done_freed_idle_or_over_budget():
    staging = PrefillStaging(budget_bytes=1000 * 10, bytes_per_token=10)  # room for 1000 tokens
    staging.begin_step([])
    a = staging.for_chunk("a", 0, 100, last=False)
    assert a is not None and a.capacity == 512  # room to grow without a copy per chunk
    assert staging.for_chunk("a", 100, 50, last=False) is a
    # A single-chunk prompt, or a last chunk with no buffer, starts none.
    assert staging.for_chunk("b", 0, 40, last=True) is None
    assert staging.for_chunk("b", 40, 40, last=True) is None and "b" not in staging
    # The budget: 512 held, so b gets the rest (488), and then c gets nothing.
    assert staging.for_chunk("b", 0, 300, last=False).capacity == 488
    assert staging.for_chunk("c", 0, 20, last=False) is None
    # Growing past the budget drops the buffer: that sequence reads the paged cache.
    assert staging.for_chunk("b", 300, 200, last=False) is None and "b" not in staging
    # Outgrowing it within the budget doubles it.
    assert staging.for_chunk("a", 150, 400, last=False).capacity == 1000
    staging.begin_step(["a"])  # freed (finished, aborted or preempted)
    assert len(staging) == 0 and staging.staged_tokens == 0
    staging.for_chunk("d", 0, 10, last=False)
    for _ in range(MAX_IDLE_STEPS):
        staging.begin_step([])
    assert "d" in staging
    staging.begin_step([])
    assert "d" not in staging  # an aborted request the runner never heard of
