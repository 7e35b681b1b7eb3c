"""A step whose work is queued on the device and whose sampled tokens are read back later
(`ModelRunner.launch`, then `finish`), and the feed of a step scheduled ahead from them.

Read back at once, every step's tokens come to the host before the next step can be launched:
the device waits for that copy, for the host to put the tokens in the next step's inputs and
for that step's launch. A step launched with its tokens left on the device (`tokens`) hands
them to the step scheduled ahead of it (`Scheduler.schedule_ahead`) on the device
(`fed_tokens`): that step can be queued while the one before it still runs. The host reads the
tokens (`read`) from a copy queued right behind the sampling, on another thread.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from batcher.core.outputs import RunnerOutput, SchedulerOutput
from batcher.core.spec_verify import collapse
from batcher.runtime.host_to_device import to_device


@dataclass(slots=True)
class LaunchedStep:
    """A launched step: its output if it was read back at launch, else its tokens on the device
    (`tokens`, one per sampling row, in scheduled order), their host copy (`host`) and the event
    after which that copy holds them (`ready`, CUDA only)."""

    sched: SchedulerOutput
    out: RunnerOutput | None = None
    tokens: torch.Tensor | None = None
    host: torch.Tensor | None = None
    ready: Any = None  # torch.cuda.Event
    # `read` may be called by the model thread (a step after this one that takes host inputs)
    # and by the reader thread at once.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def on_device(cls, sched: SchedulerOutput, tokens: torch.Tensor) -> LaunchedStep:
        """A step whose `tokens` are still being computed: their copy to the host is queued
        behind them (into pinned memory, from torch's caching host allocator), not waited for."""
        if tokens.device.type != "cuda":
            return cls(sched, tokens=tokens, host=tokens)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(tokens.device))
        return cls(sched, tokens=tokens, host=host, ready=ready)

    def read(self) -> RunnerOutput:
        """The step's output: waits for its tokens' copy to the host (once)."""
        with self._lock:
            if self.out is None:
                if self.ready is not None:
                    self.ready.synchronize()  # without the GIL
                assert self.host is not None
                tokens = self.host.tolist()
                ids, kept, _ = collapse(self.sched.seqs, tokens, [None] * len(tokens))
                self.out = RunnerOutput(request_ids=ids, token_ids=kept,
                                        logprobs=[None] * len(kept))
            return self.out


def fed_tokens(sched: SchedulerOutput, before: LaunchedStep) -> torch.Tensor:
    """The input token of each row of `sched` (a step scheduled ahead, `inputs_pending`), in
    scheduled order, taken on the device from `before`, the step launched just before it with
    its tokens left there. Each row is a request that `before` sampled one token for (its rows
    lose only requests that ended, so the order holds); any other row is a bug upstream, raised
    here, never run with a placeholder id. A step with drafts is always read back at launch."""
    tokens = before.tokens
    assert tokens is not None and sched.inputs_pending
    row_of = {s.request_id: i for i, s in enumerate(s for s in before.sched.seqs if s.sample)}
    if len(row_of) != tokens.shape[0]:
        raise RuntimeError("a step scheduled ahead of a step whose rows sampled several "
                           "tokens each")
    src = []
    for seq in sched.seqs:
        i = row_of.get(seq.request_id)
        if i is None:
            raise RuntimeError(f"a row of {seq.request_id!r} was scheduled ahead of a step "
                               "that sampled no token for it")
        src.append(i)
    if src == list(range(len(src))):
        return tokens[:len(src)]
    return tokens.index_select(0, to_device(src, tokens.device, torch.long))
