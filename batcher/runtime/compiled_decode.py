"""One-stream decode steps on the CPU through `torch.compile` (`--compile-decode`).

A batch-1 decode step of a small model is a few thousand small ops; eagerly, each pays the
dispatcher, so the step costs far more than its matmuls. Compiled as one graph per step (not one
per layer: a call's guards cost about what a layer's fused ops save), inductor fuses the norms,
RoPE, SiLU and residual adds into a few C++ kernels, calls the matmuls and SDPA as they are, and
writes the new K/V into the paged cache in place.

Only steps of one decode row run compiled: one row is a shape of its own to the compiler, and
each further shape costs start-up time. Everything else (prefills, batches, drafts, prompt
scoring) runs eagerly. The graph is compiled when the runner is built, before any request; a
machine with no C++ compiler, or a model the compiler cannot take, logs why and runs eagerly.

In bf16 the graph keeps fp32 between the ops it fuses where eager rounds to bf16 after each, so
its logits differ from the eager step's in the last bits, and a near-tie may go the other way
(one row alone runs compiled, the same row in a batch eagerly). In fp32 the tokens are the
eager ones (tests/test_compiled_decode.py).
"""

from __future__ import annotations

import inspect
import logging
import time

import torch

from batcher.core.outputs import SchedulerOutput
from batcher.runtime.attention import AttentionMetadata, OneGroupDecode

log = logging.getLogger("batcher.runtime.compile")

# Steps whose context fits fewer blocks are padded to this many (masked), so that the block count
# is always a symbol to the compiler: a size of 1 would be a shape of its own, compiled again.
MIN_BLOCKS = 2


class CompiledDecode:
    """`run(ids, positions, meta)` for the steps `takes(...)` accepts; build with
    `compile_decode(...)`, which returns None where compiling failed."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, fold_gqa: bool) -> None:
        self.model, self.kv_caches = model, kv_caches
        self.block_size, self.fold_gqa = block_size, fold_gqa
        # The graph guards on the intra-op thread count: its steps run with the one it was
        # compiled with (another would compile again, mid-serving).
        self.threads = torch.get_num_threads()
        model.rotary()  # built before tracing, so the graph never holds its first-call branch
        # The forward without its own inference-mode wrapper: the mode is entered around the
        # graph's calls instead (inside a traced graph it makes the cache's views fail).
        self._model_forward = inspect.unwrap(type(model).forward)
        # Static shapes but for the context's blocks (`warm_up` marks those): the layers' sizes
        # stay constants to the compiler, so its kernels and guards are the simplest.
        self._fn = torch.compile(self._forward)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 table: torch.Tensor, mask: torch.Tensor,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        # The caches come in as arguments: the graph writes them in place.
        meta = OneGroupDecode(self.block_size, self.fold_gqa, slot_mapping, table, mask)
        return self._model_forward(self.model, ids, positions, meta, kv_caches,
                                   torch.zeros_like(ids))

    @staticmethod
    def takes(sched: SchedulerOutput) -> bool:
        """Whether a step is one this graph runs: one decode row (no drafts), not scored."""
        return (len(sched.seqs) == 1 and sched.num_decodes == 1
                and len(sched.seqs[0].token_ids) == 1 and not sched.seqs[0].score_targets)

    def run(self, ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """Logits [1, vocab] of a step `takes` accepted (`ModelRunner.prepare`'s tensors), on
        the intra-op thread count the graph was compiled with."""
        group = meta.decode_groups[0]
        table, mask = group.table, group.mask
        if table.shape[0] < MIN_BLOCKS:  # padded with the row's own block, masked out
            pad = MIN_BLOCKS - table.shape[0]
            table = torch.cat([table, table[:1].expand(pad)])
            mask = torch.cat([mask, mask.new_zeros(*mask.shape[:-1], pad * self.block_size)],
                             dim=-1)
        # An input that is a view carries guards on its base's shape: the mask is a view of the
        # step's comparison, so it goes in as a tensor of its own (a context's worth of bools),
        # made outside inference mode like every other input (the graph guards on that too).
        mask = mask.clone()
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        with torch.inference_mode():  # entered around the graph, as when it was compiled
            return self._fn(ids, positions, meta.slot_mapping, table, mask, self.kv_caches)

    def warm_up(self) -> None:
        """Compile, with the context's block count marked as varying. The step writes K/V into
        block 0, which any sequence that holds it later writes before it reads."""
        blocks = MIN_BLOCKS + 1
        ctx = blocks * self.block_size - 1
        table = torch.zeros(blocks, dtype=torch.long)
        mask = torch.zeros(1, 1, 1, blocks * self.block_size, dtype=torch.bool)
        mask[..., :ctx] = True
        torch._dynamo.mark_dynamic(table, 0)
        torch._dynamo.mark_dynamic(mask, 3)
        # Made outside inference mode, as a step's inputs are (the graph guards on it).
        ids, positions, slots = torch.tensor([0]), torch.tensor([ctx - 1]), torch.tensor([0])
        with torch.inference_mode():
            self._fn(ids, positions, slots, table, mask, self.kv_caches)


def compile_decode(model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                   block_size: int, fold_gqa: bool) -> CompiledDecode | None:
    """A compiled one-row decode step, warmed up; None (logged) where compiling fails."""
    started = time.perf_counter()
    try:
        compiled = CompiledDecode(model, kv_caches, block_size, fold_gqa)
        compiled.warm_up()
    except Exception as exc:  # noqa: BLE001 (no compiler, an op it cannot take: run eagerly)
        first = str(exc).splitlines()[0] if str(exc) else ""
        log.warning("--compile-decode: compiling failed, decode steps run eagerly (%s: %s)",
                    type(exc).__name__, first)
        return None
    log.info("--compile-decode: one-row decode steps compiled in %.1fs",
             time.perf_counter() - started)
    return compiled
