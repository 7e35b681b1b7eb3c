"""Turn a SchedulerOutput into tensors, run the model, sample. Runs in the engine's worker thread;
it owns the KV cache tensors and never touches scheduler state."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from batcher.core.outputs import (
    RunnerOutput,
    ScheduledSeq,
    SchedulerOutput,
    TokenLogprobs,
    fill_pending_inputs,
)
from batcher.core.spec_verify import collapse
from batcher.runtime.fused_decode import FusedDecode
from batcher.runtime.grammar import GrammarMasks
from batcher.runtime.kv_cache import KVShape, allocate_kv_cache
from batcher.runtime.launched_step import LaunchedStep, fed_tokens
from batcher.runtime.prefill_staging import PrefillStaging
from batcher.runtime.sampler import Sampler
from batcher.runtime.step_inputs import StepTensors, sampled_rows, step_inputs
from batcher.runtime.thread_tuner import ThreadTuner
from batcher.system.threads import release_openmp_pool

log = logging.getLogger(__name__)


class Loaded(Protocol):
    """What the runner needs of a loaded model (`batcher.models.loader.LoadedModel` fits): the
    module to call, its config, and where its weights live. The model package calls into the
    runtime's attention, so the runtime names the model only through this."""

    @property
    def model(self) -> torch.nn.Module: ...

    @property
    def config(self) -> KVShape: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def fused(self) -> FusedDecode | None: ...


class ModelRunner:
    """Flatten a step's sequences into one varlen batch: single-token rows (decodes) first, then
    multi-token prefill chunks; positions, slot mapping, block tables and masks are built once per
    step for all layers."""

    scores_prompts = True  # computes prompt logprobs for seqs with `score_targets`

    def __init__(self, loaded: Loaded, num_blocks: int, block_size: int,
                 attention_backend: str = "auto", cuda_graphs: bool = True,
                 max_graph_batch: int = 256, max_model_len: int = 8192,
                 compile_decode: bool = False, max_graph_tokens: int = 8192):
        self.loaded = loaded
        self.model = loaded.model
        # No position past the model's rotary table (a graph's tables are sized by this; an
        # index past the table is a device-side assert on CUDA, not an exception).
        max_model_len = min(max_model_len, getattr(loaded.config, "max_position_embeddings",
                                                   max_model_len))
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.backend = resolve_backend(attention_backend, loaded.device)
        # Windows, soft-capped scores, Q/K norms: the fused kernels implement Llama's attention
        # only, so such a model runs the torch path (`runtime/variant_attention.py`).
        self.plain_attention = getattr(loaded.config, "plain_attention", True)
        # Every layer windowed: the scheduler frees blocks behind the window (`kv_cache_manager`).
        self.kv_window: int | None = getattr(loaded.config, "kv_window", None)
        if not self.plain_attention and self.backend != "torch":
            log.info("this model's attention runs on the torch path (the %s kernel implements "
                     "plain attention only)", self.backend)
            self.backend = "torch"
        self.triton_prefill = self._check_triton_kernels(loaded, block_size)
        # CPU, bf16: decode rows attend through a C kernel (`fused_decode`): a decode-only step
        # runs one call per layer from the QKV projection on.
        self.fused = loaded.fused if self.backend == "torch" else None
        # NOTE: a sparse MoE layer reads its per-expert token counts on the host, which a CUDA
        # graph cannot capture.
        use_graphs = (cuda_graphs and self.backend == "triton"
                      and not getattr(loaded.config, "num_experts", 0))
        # One scratch block past the pool takes the writes of padded graph rows.
        self.kv_caches = allocate_kv_cache(loaded.config, num_blocks + int(use_graphs),
                                           block_size, loaded.dtype, loaded.device)
        self.sampler = Sampler()
        self.grammar: GrammarMasks | None = None  # see attach_tokenizer
        self.vocab_limit: int | None = None  # ids the tokenizer can decode; see attach_tokenizer
        # Called on the model thread once a step is queued on the device and the host only
        # waits for it (on a CPU, as the step starts; a step whose launch must first wait for
        # the step before, as it starts that wait): the engine holds back its own Python work
        # until then.
        self.on_launch: Callable[[], None] | None = None
        # CPU: a prompt read in chunks keeps a contiguous copy of its K/V (up to an eighth of
        # the pool's bytes), so a chunk deep in a prompt does not gather its context per layer.
        kv = self.kv_caches[0][0]
        token_bytes = 2 * len(self.kv_caches) * kv[0, 0].numel() * kv.element_size()
        self.staging = (PrefillStaging(num_blocks * block_size * token_bytes // 8, token_bytes)
                        if loaded.device.type == "cpu" and self.plain_attention else None)
        # NOTE: one-token SDPA with enable_gqa is several times slower on CPU in reduced
        # precision; in fp32 it is the faster choice.
        self.fold_gqa = loaded.dtype != torch.float32 or loaded.device.type != "cpu"
        self.graphs = None
        self.mixed_graphs = None
        if use_graphs:
            from batcher.runtime.cuda_graphs import DecodeGraphs, graph_sizes

            max_blocks = -(-max_model_len // block_size)
            self.graphs = DecodeGraphs(self.model, self.kv_caches, block_size, num_blocks,
                                       max_blocks, graph_sizes(max_graph_batch), self.device)
            if self.triton_prefill:
                # Steps with prompt chunks: every row through the varlen kernel, in token
                # buckets (`mixed_graphs`).
                from batcher.runtime.mixed_graphs import MixedGraphs

                self.mixed_graphs = MixedGraphs(self.model, self.kv_caches, block_size,
                                                num_blocks, max_blocks, max_graph_batch,
                                                max_graph_tokens, self.device)
        # CPU: intra-op threads per step size, measured, under the count the process was given
        # (read here, at load: torch's count is also the default of threads started later, so a
        # step that lowers it puts it back when it ends).
        self.tune_threads = loaded.device.type == "cpu"
        self.max_threads = torch.get_num_threads()
        self.tuner = ThreadTuner(self.max_threads) if self.tune_threads else None
        # CPU, `--compile-decode`: one-row decode steps through torch.compile, compiled now.
        self.compiled = None
        if compile_decode and not self.plain_attention:
            log.warning("--compile-decode takes plain attention only; ignored for this model")
        elif compile_decode and (loaded.device.type != "cpu" or self.backend != "torch"):
            log.warning("--compile-decode is for the CPU's torch attention; ignored on %s (%s)",
                        loaded.device.type, self.backend)
        elif compile_decode:
            from batcher.runtime.compiled_decode import compile_decode as build_compiled

            self.compiled = build_compiled(self.model, self.kv_caches, block_size, self.fold_gqa)
        # The KV pool's fill (and compiling) ran parallel work on this thread; the steps run on
        # another.
        release_openmp_pool()

    def _check_triton_kernels(self, loaded: Any, block_size: int) -> bool:
        """On CUDA with the triton backend, each kernel first matches torch attention on this
        device in the model's shapes (their `self_check`): a decode kernel that does not keeps
        the whole model on the torch path, a prefill kernel that does not keeps prompt chunks
        there. Returns whether prompt chunks take the varlen prefill kernel."""
        if self.backend != "triton" or loaded.device.type != "cuda":
            return False
        from batcher.runtime import triton_attention, triton_prefill

        cfg = loaded.config
        shape = (loaded.device, loaded.dtype, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                 block_size)
        why = triton_attention.self_check(*shape)
        if why is not None:
            log.warning("the paged decode kernel failed its start-up check (%s): attention "
                        "runs on the torch path", why)
            self.backend = "torch"
            return False
        why = triton_prefill.self_check(*shape)
        if why is not None:
            log.warning("the varlen prefill kernel failed its start-up check (%s): prompt "
                        "chunks take the torch path", why)
        return why is None

    @property
    def warm_up_kind(self) -> str:
        """What a warm start must run (`batcher.engine.warmup`): every shape where kernels compile or
        graphs capture per shape ("full": CUDA, torch.compile), else a few eager steps."""
        full = self.device.type != "cpu" or self.compiled is not None or self.graphs is not None
        return "full" if full else "light"

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """Run one step. Returns sampled tokens for seqs with sample=True, in scheduled order."""
        return self.finish(self.launch(sched))

    def launch(self, sched: SchedulerOutput, before: LaunchedStep | None = None
               ) -> LaunchedStep:
        """Queue one step's work on the device; `finish` reads its tokens back. A step whose
        tokens the host needs before the next step can be built (grammar rows, drafts, logprobs,
        prompt scores) is read back here. `before`: for a step scheduled ahead
        (`inputs_pending`), the step launched just before it, whose tokens are its inputs."""
        if sched.is_empty:
            return LaunchedStep(sched, out=RunnerOutput())
        if self.on_launch is not None and self.device.type != "cuda":
            self.on_launch()
        if not self.tune_threads or self.tuner is None or (
                self.compiled is not None and self.compiled.takes(sched)):
            # A compiled step keeps the thread count it was compiled with (its graph guards on
            # it: another count would compile again, mid-serving).
            return self._launch(sched, before)
        rows = sched.num_batched_tokens
        reads_prompt = sched.reads_prompt
        threads = self.tuner.threads(rows, reads_prompt)
        if threads != self.max_threads:
            torch.set_num_threads(threads)
        started = time.perf_counter()
        try:
            # NOTE: on a CPU the step's work is done when this returns.
            out = self._launch(sched, before)
        finally:
            if threads != self.max_threads:
                torch.set_num_threads(self.max_threads)
        self.tuner.record(rows, threads, time.perf_counter() - started, reads_prompt)
        return out

    def _under_way(self) -> None:
        """On CUDA, `on_launch`: the step's work is queued, or its launch must now wait for the
        device (for the step before it, or its own forward), so nothing should hold back for
        it. On a CPU that was said as the step started."""
        if self.on_launch is not None and self.device.type == "cuda":
            self.on_launch()

    @staticmethod
    def finish(step: LaunchedStep) -> RunnerOutput:
        """A launched step's output, once its tokens are on the host (may run on another thread
        than `launch`, in launch order)."""
        return step.read()

    def _launch(self, sched: SchedulerOutput, before: LaunchedStep | None) -> LaunchedStep:
        if self.grammar is not None:
            self.grammar.drop(sched.freed_ids)
        pending = None
        scored = [s for s in sched.seqs if s.score_targets]
        if self.graphs is not None and not scored and self.graphs.can_run(sched):
            sample_seqs = sched.seqs  # decode-only: every row samples, in order
            if self.grammar is not None:
                pending = self.grammar.start(sample_seqs)  # masks fill while the model runs
            logits = self.graphs.run(sched, _inputs_from(sched, before, on_device=True))
        elif self.mixed_graphs is not None and not scored and self.mixed_graphs.can_run(sched):
            if _reads_back(sched, before):
                self._under_way()  # its buckets take host ids only: the step before's
            _inputs_from(sched, before, on_device=False)
            sample_seqs = sampled_rows(sched)
            if self.grammar is not None:
                pending = self.grammar.start(sample_seqs)
            logits = self.mixed_graphs.run(sched)
        else:
            if _reads_back(sched, before):
                # On CUDA its inputs are copied from ordinary host memory, after the step before.
                self._under_way()
            ids, positions, meta, logits_idx, sample_seqs = self.prepare(
                sched, _inputs_from(sched, before, on_device=True))
            if self.grammar is not None:
                pending = self.grammar.start(sample_seqs)
            logits = None
            if self.compiled is not None and self.compiled.takes(sched):
                try:
                    logits = self.compiled.run(ids, positions, meta)
                except Exception:  # noqa: BLE001 (the eager step is always there)
                    # The step is run again eagerly: it writes its K/V before reading them.
                    log.exception("--compile-decode: a compiled step failed; decode steps run "
                                  "eagerly from now on")
                    self.compiled = None
            if logits is None:
                logits = self.model(ids, positions, meta, self.kv_caches, logits_idx)  # [N, vocab]
        if self.vocab_limit is not None and self.vocab_limit < logits.shape[1]:
            # A model table wider than its tokenizer (random weights in a real config's shapes
            # with the bundled tokenizer, or a table padded past the vocabulary): ids past the
            # tokenizer's are never sampled. In place (the logits are this step's own), in
            # inference mode as the model made them.
            with torch.inference_mode():
                logits[:, self.vocab_limit:] = float("-inf")
        ns = len(sample_seqs)
        # Nothing the host needs before the next step: the tokens stay on the device, for a
        # step scheduled ahead to take there, and come back while the device runs on.
        on_device = bool(sample_seqs) and pending is None and not scored and not any(
            s.draft_token_ids or s.sampling.logprobs is not None for s in sched.seqs)
        # A top-p row's widening reads the device, as scoring and reading the tokens back do.
        widens = any(s.sampling.top_p < 1 and not s.sampling.top_k for s in sample_seqs)
        if widens or not on_device:
            self._under_way()  # the forward is queued; what follows reads the device
        out = RunnerOutput(prompt_logprobs=score_prompts(logits[ns:], scored) if scored else {})
        if not sample_seqs:
            return LaunchedStep(sched, out=out)
        if on_device:
            step = LaunchedStep.on_device(sched, self.sampler.sample_on_device(
                logits[:ns], sample_seqs))
            if not widens:
                self._under_way()  # the step and its sampling are queued
            return step
        masks = None if pending is None else self.grammar.wait(pending, sample_seqs)
        tokens, logprobs = self.sampler.sample(logits[:ns], sample_seqs, masks)
        if masks is not None:
            self.grammar.advance(sample_seqs, tokens)
            out.failed = self.grammar.take_cut()
        # NOTE: with drafts, `sample_seqs` has a row per drafted position (see `prepare`).
        out.request_ids, out.token_ids, out.logprobs = collapse(sched.seqs, tokens, logprobs)
        return LaunchedStep(sched, out=out)

    def attach_tokenizer(self, tokenizer: Any) -> None:
        """Enable grammar-constrained rows (structured outputs): their masks need the vocabulary.
        Logits past the tokenizer's vocabulary are masked from then on."""
        self.grammar = GrammarMasks(tokenizer)
        self.vocab_limit = tokenizer.vocab_size

    def prepare(self, sched: SchedulerOutput, fed: torch.Tensor | None = None) -> StepTensors:
        """The step's tensors (`runtime/step_inputs.py`); a step a compiled graph runs keeps its
        decode rows off the fused kernel (the graph reads `decode_groups`). `fed`: a step
        scheduled ahead's input tokens on the device (`launched_step.fed_tokens`)."""
        return step_inputs(self, sched,
                           fuse_decodes=not (self.compiled is not None
                                             and self.compiled.takes(sched)), fed=fed)


def _reads_back(sched: SchedulerOutput, before: LaunchedStep | None) -> bool:
    """`sched` is scheduled ahead of `before`, whose tokens are still on the device."""
    return sched.inputs_pending and before is not None and before.out is None


def _inputs_from(sched: SchedulerOutput, before: LaunchedStep | None, on_device: bool
                 ) -> torch.Tensor | None:
    """A step scheduled ahead's inputs from `before`, the step launched just before it: its
    tokens on the device (`fed_tokens`, not waited for) where `on_device` and they are still
    there, else written into the rows on the host (after waiting for them). None for any other
    step, or once written."""
    if not sched.inputs_pending:
        return None
    if on_device and before is not None and before.out is None:
        return fed_tokens(sched, before)
    fill_pending_inputs(sched, None if before is None else before.read())  # raises without one
    return None


def score_prompts(logits: torch.Tensor, seqs: list[ScheduledSeq]
                  ) -> dict[str, list[TokenLogprobs]]:
    """Prompt logprobs: `logits` [sum of targets, vocab] holds each seq's scored rows in
    order; entry j is its target's logprob under row j, with the row's top-k alternatives
    (k = `prompt_logprobs`). From the raw distribution, as sampled logprobs are."""
    targets = torch.tensor([t for s in seqs for t in s.score_targets], device=logits.device)
    out: dict[str, list[TokenLogprobs]] = {}
    row = 0
    # Slices bound the fp32 temporaries of a long chunk: [rows, vocab] each.
    for s in seqs:
        n = len(s.score_targets)
        kk = s.sampling.prompt_logprobs or 0
        entries: list[TokenLogprobs] = []
        for lo in range(row, row + n, 256):
            hi = min(row + n, lo + 256)
            lp = torch.log_softmax(logits[lo:hi].float(), dim=-1)  # [rows, vocab]
            chosen = lp.gather(1, targets[lo:hi].unsqueeze(1)).squeeze(1).tolist()
            if kk:
                vals, ids = lp.topk(kk, dim=-1)
                tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
            else:
                tops = [[] for _ in chosen]
            entries += [TokenLogprobs(c, t) for c, t in zip(chosen, tops)]
        out[s.request_id] = entries
        row += n
    return out


def resolve_backend(name: str, device: torch.device) -> str:
    """`auto`: the fused Triton decode kernel on CUDA when Triton imports, else the torch path."""
    if name not in ("auto", "torch", "triton"):
        raise ValueError(f"unknown attention backend {name!r}; use auto, torch or triton")
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return "torch"
    try:
        import triton  # noqa: F401
    except ImportError:
        if name == "triton":
            raise ValueError("attention backend 'triton' needs the triton package") from None
        return "torch"
    return "triton"
