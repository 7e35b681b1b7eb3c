"""Oracle: our paged, flattened, mixed-batch forward equals the dense Hugging Face forward."""

from __future__ import annotations

import random

import pytest
import torch

from batcher.core.outputs import ScheduledSeq, SchedulerOutput
from batcher.models.tiny import tiny_config, tiny_state
from batcher.runtime.model_runner import ModelRunner
from batcher.core.sampling import SamplingParams
from tests.hf_reference import hf_model_from_state

BLOCK = 16


def _all_logits(runner: ModelRunner, sched: SchedulerOutput) -> torch.Tensor:
    ids, positions, meta, _, _ = runner.prepare(sched)
    # Rows in runner order: single-token rows first (longest context first), then chunks in
    # scheduled order.
    return runner.model(ids, positions, meta, runner.kv_caches, torch.arange(len(ids)))


def _seq(rid, tokens, start, blocks, n):
    return ScheduledSeq(rid, tokens[start:start + n], start, blocks, True, SamplingParams())


@pytest.mark.parametrize("fold_gqa", [True, False])
def test_tiny_mixed_batch_matches_hf(tiny_fp32, fold_gqa):
    cfg = tiny_config()
    hf = hf_model_from_state(cfg, tiny_state(cfg, seed=0))
    runner = ModelRunner(tiny_fp32, num_blocks=64, block_size=BLOCK)
    runner.fold_gqa = fold_gqa
    rng = random.Random(1)
    free = list(range(64))
    rng.shuffle(free)  # random, non-contiguous block assignment
    lens = {"a": 37, "b": 41, "c": 50}
    toks = {k: [rng.randrange(cfg.vocab_size) for _ in range(n + 2)] for k, n in lens.items()}
    blocks = {k: [free.pop() for _ in range(-(-(n + 2) // BLOCK))] for k, n in lens.items()}

    # Step 1: a and c whole prompts, b a first chunk of 12 tokens.
    s1 = SchedulerOutput([_seq("a", toks["a"], 0, blocks["a"], 37),
                          _seq("b", toks["b"], 0, blocks["b"], 12),
                          _seq("c", toks["c"], 0, blocks["c"], 50)])
    out1 = _all_logits(runner, s1)
    # Step 2: a and c decode one token each; b resumes its prompt (bottom-right causal chunk).
    s2 = SchedulerOutput([_seq("a", toks["a"], 37, blocks["a"], 1),
                          _seq("c", toks["c"], 50, blocks["c"], 1),
                          _seq("b", toks["b"], 12, blocks["b"], 29)])
    out2 = _all_logits(runner, s2)
    # Step 3: all three decode; a one-token chunk of b's is treated as a decode row too.
    s3 = SchedulerOutput([_seq("a", toks["a"], 38, blocks["a"], 1),
                          _seq("b", toks["b"], 41, blocks["b"], 1),
                          _seq("c", toks["c"], 51, blocks["c"], 1)])
    out3 = _all_logits(runner, s3)

    with torch.no_grad():
        ref = {k: hf(torch.tensor([toks[k]])).logits[0] for k in toks}
    expect1 = torch.cat([ref["a"][:37], ref["b"][:12], ref["c"][:50]])
    expect2 = torch.cat([ref["c"][50:51], ref["a"][37:38], ref["b"][12:41]])
    expect3 = torch.cat([ref["c"][51:52], ref["b"][41:42], ref["a"][38:39]])
    for got, want in ((out1, expect1), (out2, expect2), (out3, expect3)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_decode_groups_of_different_lengths_match_hf(tiny_fp32, monkeypatch):
    """Short and long contexts in one decode step, split into separately padded groups."""
    import batcher.runtime.step_inputs as step_inputs

    monkeypatch.setattr(step_inputs, "MIN_SAVED_BLOCKS", 1)
    cfg = tiny_config()
    hf = hf_model_from_state(cfg, tiny_state(cfg, seed=0))
    runner = ModelRunner(tiny_fp32, num_blocks=64, block_size=BLOCK)
    rng = random.Random(2)
    lens = [150, 140, 20, 18, 5]
    toks = [[rng.randrange(cfg.vocab_size) for _ in range(n + 1)] for n in lens]
    free = list(range(64))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-(n + 1) // BLOCK))] for n in lens]
    _all_logits(runner, SchedulerOutput([_seq(i, t, 0, b, n) for i, (t, b, n)
                                         in enumerate(zip(toks, tables, lens))]))
    sched = SchedulerOutput([_seq(i, t, n, b, 1) for i, (t, b, n)
                             in enumerate(zip(toks, tables, lens))])
    _, _, meta, _, _ = runner.prepare(sched)
    assert len(meta.decode_groups) >= 2
    got = _all_logits(runner, sched)
    with torch.no_grad():
        want = torch.stack([hf(torch.tensor([t])).logits[0, -1] for t in toks])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_logits_only_for_requested_rows(tiny_fp32):
    runner = ModelRunner(tiny_fp32, num_blocks=8, block_size=BLOCK)
    seq = ScheduledSeq("a", list(range(100, 120)), 0, [3, 5], True, SamplingParams())
    ids, positions, meta, idx, sample = runner.prepare(SchedulerOutput([seq]))
    assert idx.tolist() == [19] and sample == [seq]
    logits = runner.model(ids, positions, meta, runner.kv_caches, idx)
    assert logits.shape == (1, tiny_config().vocab_size)
