"""`EngineConfig`: every engine setting of `batcher serve` in one object, with the defaults the
flags show (`batcher.flags.serve` reads its defaults from here, so the two cannot drift)."""

from __future__ import annotations

from dataclasses import dataclass

from batcher.core.config import (
    DEFAULT_MAX_MODEL_LEN,
    PREFILL_BUDGETS,
    SPECULATIVE_METHODS,
    CacheConfig,
    SchedulerConfig,
    parse_bytes,
)

DEFAULT_MODEL = "smollm2-135m"  # bundled
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
# Weight-only, CPU (batcher.runtime.quant); auto: int4 for a Q4_1 GGUF in native bf16, else
# none (batcher.models.load_settings.resolve_quantization).
QUANTIZATIONS = ("auto", "none", "int8", "int4")
# dummy: random weights in the shapes of a config, no weights read (batcher.models.dummy).
LOAD_FORMATS = ("auto", "dummy")


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
    # copy (packed kernels, and int4 weights unpacked per step for big steps: less memory).
    quantized_dense_above: int = 0
    attention_backend: str = "auto"
    cuda_graphs: bool = True
    compile_decode: bool = False  # CPU: one-stream decode steps through torch.compile
    torch_threads: int | None = None  # None: the cgroup CPU quota, else all cores
    speculative: str = "none"  # or "ngram": draft tokens by prompt lookup, verified in one step
    num_speculative_tokens: int = 4

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
        if self.slo_tpot_ms is not None and not 0 <= self.slo_tpot_ms < float("inf"):
            raise ValueError(f"slo_tpot_ms must be >= 0, got {self.slo_tpot_ms}")
        SchedulerConfig(max_num_seqs=self.max_num_seqs or 1,
                        max_num_batched_tokens=self.max_num_batched_tokens or 1,
                        max_model_len=self.max_model_len, prefill_budget=self.prefill_budget,
                        slo_tpot_s=self.slo_tpot_ms / 1000 if self.slo_tpot_ms else None,
                        max_step_slowdown=self.max_step_slowdown,
                        burst_window_s=self.burst_window_ms / 1000,
                        min_prefill_chunk=self.min_prefill_chunk,
                        speculative=self.speculative,
                        num_speculative_tokens=self.num_speculative_tokens).validate()
        CacheConfig(block_size=self.block_size, num_blocks=self.num_blocks,
                    kv_cache_memory=parse_bytes(self.kv_cache_memory)
                    if self.kv_cache_memory else None,
                    prefix_cache_scope=self.prefix_cache_scope).validate()
        return self
