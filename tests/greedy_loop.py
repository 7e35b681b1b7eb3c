"""A minimal greedy generation loop straight on the ModelRunner (no scheduler): every sequence in
one batch, contiguous blocks. Used by reference tests of the model itself."""

from __future__ import annotations

import torch

from batcher.core.outputs import ScheduledSeq, SchedulerOutput
from batcher.runtime.model_runner import ModelRunner
from batcher.core.sampling import SamplingParams


def block_tables(runner: ModelRunner, prompts: list[list[int]], new_tokens: int
                 ) -> list[list[int]]:
    """Contiguous blocks per prompt, enough for it and `new_tokens` more, from block 0 on."""
    bs = runner.block_size
    tables, next_block = [], 0
    for p in prompts:
        n = -(-(len(p) + new_tokens) // bs)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    assert next_block <= runner.num_blocks
    return tables


def greedy_generate(runner: ModelRunner, prompts: list[list[int]], new_tokens: int,
                    suppress: tuple[int, ...] = ()) -> list[list[int]]:
    """`suppress`: token ids never chosen (EOS, to generate exactly `new_tokens`)."""
    tables = block_tables(runner, prompts, new_tokens)
    seqs = [list(p) for p in prompts]
    greedy = SamplingParams(temperature=0.0)
    sched = SchedulerOutput([ScheduledSeq(str(i), list(p), 0, tables[i], True, greedy)
                             for i, p in enumerate(prompts)])
    for step in range(new_tokens):
        ids, positions, meta, idx, _sample = runner.prepare(sched)
        logits = runner.model(ids, positions, meta, runner.kv_caches, idx)
        if suppress:
            logits = logits.clone()
            logits[:, list(suppress)] = float("-inf")
        nxt = torch.argmax(logits, dim=-1).tolist()
        for s, t in zip(seqs, nxt):
            s.append(t)
        sched = SchedulerOutput([ScheduledSeq(str(i), [s[-1]], len(s) - 1, tables[i], True,
                                              greedy) for i, s in enumerate(seqs)])
    return [s[len(p):] for s, p in zip(seqs, prompts)]


def staggered_generate(runner: ModelRunner, prompts: list[list[int]], new_tokens: int
                       ) -> list[list[int]]:
    """Greedy through `runner.execute`, prompt i read whole at step i beside the decode rows of
    the prompts before it: steps with a prompt chunk and decode rows together, as under traffic,
    then decode-only steps."""
    tables = block_tables(runner, prompts, new_tokens)
    greedy = SamplingParams(temperature=0.0)
    out: list[list[int]] = [[] for _ in prompts]
    for step in range(len(prompts) + new_tokens):
        seqs = []
        for i, p in enumerate(prompts):
            if i > step or len(out[i]) >= new_tokens:
                continue
            seqs.append(ScheduledSeq(str(i), list(p), 0, tables[i], True, greedy) if i == step
                        else ScheduledSeq(str(i), [out[i][-1]], len(p) + len(out[i]) - 1,
                                          tables[i], True, greedy))
        if not seqs:
            break
        res = runner.execute(SchedulerOutput(seqs))
        for rid, tok in zip(res.request_ids, res.token_ids):
            out[int(rid)].append(tok)
    return out
