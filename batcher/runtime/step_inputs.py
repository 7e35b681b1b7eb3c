"""A step's tensors from its SchedulerOutput: the flattened token rows (decode rows first, then
prompt chunks), positions, slot mapping, the attention metadata each backend reads, and the
rows whose logits are sampled or scored. Built once per step for every layer."""

from __future__ import annotations

from typing import Protocol

import torch

from batcher.core.outputs import ScheduledSeq, SchedulerOutput
from batcher.core.spec_verify import verify_rows
from batcher.runtime.attention import (
    AttentionMetadata,
    DecodeGroup,
    FusedDecodeStep,
    PrefillChunk,
)
from batcher.runtime.fused_decode import FusedDecode
from batcher.runtime.host_to_device import to_device
from batcher.runtime.prefill_staging import PrefillStaging

# (token ids, positions, attention metadata, rows whose logits are kept, sampling rows)
StepTensors = tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor,
                    list[ScheduledSeq]]


class StepLayout(Protocol):
    """What the inputs depend on: the runner's cache layout and the attention it runs."""

    block_size: int
    device: torch.device
    backend: str  # "triton" or "torch"
    fold_gqa: bool
    triton_prefill: bool
    fused: FusedDecode | None
    max_threads: int
    staging: PrefillStaging | None


def step_inputs(layout: StepLayout, sched: SchedulerOutput, fuse_decodes: bool = True,
                fed: torch.Tensor | None = None) -> StepTensors:
    """`fuse_decodes=False`: the decode rows get `decode_groups` even where the fused CPU kernel
    would take them (a compiled graph reads the groups). `fed`: for a step scheduled ahead (one
    token a row), its rows' input tokens on the device, in scheduled order, in place of the
    placeholders its rows hold (`launched_step.fed_tokens`)."""
    bs, dev = layout.block_size, layout.device
    nd = sched.num_decodes  # the scheduler's output puts its decode rows first
    # Longest context first: decode rows are grouped by similar context length.
    decodes = sorted(sched.seqs[:nd], key=lambda s: -s.start_pos)
    prefills = sched.seqs[nd:]
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    row_of: dict[int, int] = {}  # id(seq) -> flattened row of its last token
    for s in decodes + prefills:
        n = len(s.token_ids)
        ids.extend(s.token_ids)
        pos = range(s.start_pos, s.start_pos + n)
        positions.extend(pos)
        table = s.block_ids
        slots.extend(table[p // bs] * bs + p % bs for p in pos)
        row_of[id(s)] = len(ids) - 1
    # Prompt chunks go through the varlen paged-prefill kernel on CUDA with the triton
    # backend: one launch for every chunk of the step (`runtime/triton_prefill.py`).
    meta = AttentionMetadata(block_size=bs, fold_gqa=layout.fold_gqa,
                             slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
                             triton_prefill=layout.triton_prefill)
    if decodes:
        _decode_meta(layout, meta, decodes, fuse_decodes)
    staging = layout.staging
    if staging is not None:
        staging.begin_step(sched.freed_ids)
        if len(staging):
            # A decode row or a sampling chunk means the prompt was read (this step's chunk
            # keeps its buffer through the forward).
            staging.release_all([s.request_id for s in decodes])
    row = len(decodes)
    for s in prefills:
        n = len(s.token_ids)
        ctx = s.start_pos + n
        nblocks = -(-ctx // bs)
        mask = None
        if s.start_pos:
            # Bottom-right aligned causal mask: query i sees keys [0, start_pos + i].
            q_pos = torch.arange(s.start_pos, ctx, device=dev).unsqueeze(1)
            mask = torch.arange(ctx, device=dev).unsqueeze(0) <= q_pos  # [n, ctx]
        stage = None if staging is None else staging.for_chunk(
            s.request_id, s.start_pos, n, s.sample)
        if stage is not None and s.sample:
            staging.release(s.request_id)
        meta.prefills.append(PrefillChunk(
            row=row, length=n, start_pos=s.start_pos, mask=mask, stage=stage,
            block_ids=torch.tensor(s.block_ids[:nblocks], dtype=torch.long, device=dev)))
        row += n
    sample_seqs = sampled_rows(sched)
    sample_rows = [row for s in sched.seqs if s.sample
                   for row in range(row_of[id(s)] - len(s.draft_token_ids), row_of[id(s)] + 1)]
    # NOTE: prompt-logprob rows follow the sampling rows, in scheduled order (as the runner
    # hands them to `score_prompts`).
    score_rows: list[int] = []
    for s in sched.seqs:
        if s.score_targets:
            first = row_of[id(s)] - len(s.token_ids) + 1 + s.score_offset
            score_rows.extend(range(first, first + len(s.score_targets)))
    logits_idx = torch.tensor(sample_rows + score_rows or [0], dtype=torch.long, device=dev)
    ids_t = torch.tensor(ids, dtype=torch.long, device=dev)
    if fed is not None:
        # NOTE: the decode rows were laid out longest context first, not in scheduled order.
        assert len(ids) == len(sched.seqs) == fed.shape[0]
        ids_t[to_device([row_of[id(s)] for s in sched.seqs], dev)] = fed
    return (ids_t, torch.tensor(positions, dtype=torch.long, device=dev), meta, logits_idx,
            sample_seqs)


def _decode_meta(layout: StepLayout, meta: AttentionMetadata, decodes: list[ScheduledSeq],
                 fuse: bool) -> None:
    bs, dev = layout.block_size, layout.device
    ctx_lens = [s.start_pos + 1 for s in decodes]
    max_blocks = -(-max(ctx_lens) // bs)
    meta.num_decodes = len(decodes)
    fused = layout.fused
    fuse = fuse and fused is not None and fused.takes_step(layout.max_threads, sum(ctx_lens))
    if layout.backend == "triton" or fuse:
        # Kernels that read the blocks in place take each row's table and length.
        rows = [s.block_ids[:-(-c // bs)] for s, c in zip(decodes, ctx_lens)]
        tables = torch.tensor([r + [0] * (max_blocks - len(r)) for r in rows],
                              dtype=torch.int32, device=dev)
        lens = torch.tensor(ctx_lens, dtype=torch.int32, device=dev)
        if layout.backend == "triton":
            meta.decode_tables, meta.decode_lens = tables, lens
        else:
            assert fused is not None
            meta.fused = FusedDecodeStep(fused, bs, meta.slot_mapping[:len(decodes)], tables,
                                         lens)
        return
    start = 0
    for end, blocks in split_decode_groups([-(-c // bs) for c in ctx_lens]):
        flat: list[int] = []
        for s in decodes[start:end]:
            used = s.block_ids[:-(-(s.start_pos + 1) // bs)]
            # Pad with the row's own first block; padded keys are masked out.
            flat.extend(used + [used[0]] * (blocks - len(used)))
        lens = torch.tensor(ctx_lens[start:end], device=dev)
        keys = torch.arange(blocks * bs, device=dev)
        mask = (keys.unsqueeze(0) < lens.unsqueeze(1)).view(end - start, 1, 1, -1)
        meta.decode_groups.append(DecodeGroup(
            end - start, blocks, torch.tensor(flat, dtype=torch.long, device=dev), mask))
        start = end


def sampled_rows(sched: SchedulerOutput) -> list[ScheduledSeq]:
    """The step's sampling rows in the order its logits come: scheduled order, a row with
    drafts once per drafted position (`core/spec_verify` keeps what plain decoding would have
    produced)."""
    return [r for s in sched.seqs if s.sample for r in verify_rows(s)]


# A new group pays a gather and an SDPA call per layer; start one only when it saves this many
# padded blocks (each row of the rest drops at least a quarter of the current padding).
MIN_SAVED_BLOCKS = 48


def split_decode_groups(blocks: list[int]) -> list[tuple[int, int]]:
    """`blocks`: context length in blocks per decode row, longest first. Returns (end row,
    padded blocks) per group, so rows [previous end, end) are padded to that many blocks."""
    groups: list[tuple[int, int]] = []
    head = blocks[0]
    for i, b in enumerate(blocks):
        if b * 4 <= head * 3 and (head - b) * (len(blocks) - i) >= MIN_SAVED_BLOCKS:
            groups.append((i, head))
            head = b
    groups.append((len(blocks), head))
    return groups
