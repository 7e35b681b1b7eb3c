"""`EngineConfig`: every engine setting of `batcher serve` in one object, with the defaults the
flags show (`batcher.app.serve_flags` reads its defaults from here, so the two cannot drift), and the
one mapping from it to the scheduler's and the KV cache's settings (`batcher.core.config`)."""

from __future__ import annotations

from dataclasses import dataclass

from batcher.bundled import DEFAULT_MODEL
from batcher.core.config import (
    ATTENTION_BACKENDS,
    CPU_MAX_NUM_BATCHED_TOKENS,
    CPU_MAX_NUM_SEQS,
    DEFAULT_MAX_MODEL_LEN,
    DEVICES,
    DTYPES,
    LOAD_FORMATS,
    PREFILL_BUDGETS,
    QUANTIZATIONS,
    SPECULATIVE_METHODS,
    CacheConfig,
    SchedulerConfig,
    parse_bytes,
)

# Time-to-first-token a server started with no flags admits requests for (see --slo-ttft-ms).
DEFAULT_SLO_TTFT_MS = 2000.0


@dataclass(slots=True)
class EngineConfig:
    """The engine's settings; each field is the `batcher serve` flag of the same name."""

    # None: 64 on a CPU, 256 on CUDA (the device is known only once the model loads).
    max_num_seqs: int | None = None
    # None: 320 on a CPU, 8192 on CUDA.
    max_num_batched_tokens: int | None = None
    max_model_len: int = DEFAULT_MAX_MODEL_LEN  # tokens, prompt + output; capped by the model
    block_size: int = 16  # tokens per KV block, a power of two
    num_blocks: int | None = None  # None: sized from kv_cache_memory
    kv_cache_memory: str | None = None  # e.g. "1GiB"; None: 2GiB on a CPU, free memory on CUDA
    enable_prefix_caching: bool = True
    prefix_cache_scope: str = "tenant"  # or "global"
    prefill_budget: str = "time"  # or "fixed"
    max_step_slowdown: float = 1.5
    burst_window_ms: float = 1000.0  # requests arriving within it are one burst; 0 = off
    min_prefill_chunk: int = 2  # tokens
    slo_tpot_ms: float | None = None
    dtype: str = "auto"
    device: str = "auto"
    quantization: str = "auto"
    load_format: str = "auto"  # or "dummy": random weights in the model's shapes
    # Quantized steps with more rows than this use a dense copy of the quantized weights; 0: no
    # copy of the layers (packed kernels, and int4 weights unpacked per step for big steps: less
    # memory). A tied int8 head keeps its copy past HEAD_DENSE_ABOVE_ROWS (or this, if fewer)
    # either way.
    quantized_dense_above: int = 0
    attention_backend: str = "auto"
    cuda_graphs: bool = True
    # Launch each step before emitting the previous one's tokens (the host's detokenizing and
    # streaming overlap the model's next step); off: emit, then schedule.
    step_overlap: bool = True
    compile_decode: bool = False  # CPU: one-stream decode steps through torch.compile
    torch_threads: int | None = None  # None: the cgroup CPU quota, else all cores
    speculative: str = "none"  # or "ngram": draft tokens by prompt lookup, verified in one step
    num_speculative_tokens: int = 4
    # The first-token goal: admission refuses what it predicts would miss it, and prefill pacing
    # reads a prompt in time for it. None or 0: no goal (admission by queue length only).
    slo_ttft_ms: float | None = DEFAULT_SLO_TTFT_MS

    def validate(self) -> EngineConfig:
        """Raise ValueError naming the first bad setting."""
        for name, allowed in (("dtype", DTYPES), ("device", DEVICES),
                              ("quantization", QUANTIZATIONS),
                              ("load_format", LOAD_FORMATS),
                              ("attention_backend", ATTENTION_BACKENDS),
                              ("prefill_budget", PREFILL_BUDGETS),
                              ("speculative", SPECULATIVE_METHODS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.quantized_dense_above < 0:
            raise ValueError(f"quantized_dense_above must be >= 0, got {self.quantized_dense_above}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "torch_threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {value}")
        for name in ("slo_tpot_ms", "slo_ttft_ms"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < float("inf"):
                raise ValueError(f"{name} must be >= 0, got {value}")
        self.scheduler_config().validate()
        self.cache_config().validate()
        return self

    def scheduler_config(self) -> SchedulerConfig:
        """The scheduler's settings, as on a CPU: the engine raises unset limits to the CUDA
        defaults once it knows the device. Not yet validated."""
        return SchedulerConfig(max_num_seqs=self.max_num_seqs or CPU_MAX_NUM_SEQS,
                               max_num_batched_tokens=self.max_num_batched_tokens
                               or CPU_MAX_NUM_BATCHED_TOKENS,
                               max_model_len=self.max_model_len,
                               prefill_budget=self.prefill_budget,
                               slo_tpot_s=self.slo_tpot_ms / 1000 if self.slo_tpot_ms else None,
                               slo_ttft_s=self.slo_ttft_ms / 1000 if self.slo_ttft_ms else None,
                               max_step_slowdown=self.max_step_slowdown,
                               burst_window_s=self.burst_window_ms / 1000,
                               min_prefill_chunk=self.min_prefill_chunk,
                               speculative=self.speculative,
                               num_speculative_tokens=self.num_speculative_tokens)

    def cache_config(self) -> CacheConfig:
        """The KV cache's settings. Not yet validated."""
        return CacheConfig(block_size=self.block_size, num_blocks=self.num_blocks,
                           kv_cache_memory=parse_bytes(self.kv_cache_memory)
                           if self.kv_cache_memory else None,
                           enable_prefix_caching=self.enable_prefix_caching,
                           prefix_cache_scope=self.prefix_cache_scope)
