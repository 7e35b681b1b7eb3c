"""The scheduler's and the KV cache's settings as the core reads them (`SchedulerConfig`,
`CacheConfig`), each validated once at start (ValueError on bad input), and the choice lists of
the engine's settings. Users set `batcher.engine.config.EngineConfig` (or the flags of
`batcher serve`, its mirror); `EngineConfig.scheduler_config()` and `.cache_config()` are the
one mapping onto these."""

from __future__ import annotations

from dataclasses import dataclass

# Defaults fitted to a 2-core AVX-512 CPU with the bundled 135M model: a step of up to 32 decodes plus
# a 256-token prefill chunk keeps running streams near 5 tokens/s each while a new prompt is read.
CPU_MAX_NUM_SEQS = 64
CPU_MAX_NUM_BATCHED_TOKENS = 320
CUDA_MAX_NUM_SEQS = 256
CUDA_MAX_NUM_BATCHED_TOKENS = 8192
MAX_DEFAULT_BLOCKS = 65536
# Tokens a request may span (prompt + output), before the model's own limit caps it.
DEFAULT_MAX_MODEL_LEN = 8192
PREFILL_BUDGETS = ("time", "fixed")
SPECULATIVE_METHODS = ("none", "ngram")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
# Weight-only, CPU (batcher.runtime.quant); auto: int4 for a Q4_1 GGUF in native bf16, else
# none (batcher.models.load_settings.resolve_quantization).
QUANTIZATIONS = ("auto", "none", "int8", "int4")
# dummy: random weights in the shapes of a config, no weights read (batcher.models.dummy).
LOAD_FORMATS = ("auto", "dummy")


@dataclass(slots=True)
class SchedulerConfig:
    """How much work one step may take."""

    max_num_seqs: int = CPU_MAX_NUM_SEQS
    max_num_batched_tokens: int = CPU_MAX_NUM_BATCHED_TOKENS
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    # Prompts longer than this are split into chunks across steps (<= max_num_batched_tokens).
    long_prefill_token_threshold: int = 0  # 0 = up to the remaining budget
    # How a step's prefill share is chosen while streams decode: "time" sizes chunks with the
    # measured step-time model so the step stays within the target below; "fixed" fills
    # max_num_batched_tokens whatever the step then costs. Either way max_num_batched_tokens is
    # the upper bound, and a step with no decodes gives prefill all of it.
    prefill_budget: str = "time"
    slo_tpot_s: float | None = None  # the target of a step carrying decodes, when set
    # When set, an interactive prompt not yet answered gets at least the chunks that finish it
    # by `ttft_pace` of this SLO after its arrival, whatever the time target above allows: the
    # streams' per-token target yields to a first token that would otherwise come too late.
    # Not for a prompt too long to be read within the SLO at all, nor for a late one while
    # another can still be on time; a late one with none to yield to gets the whole budget.
    slo_ttft_s: float | None = None
    ttft_pace: float = 0.5
    max_step_slowdown: float = 1.5  # else: this times the step's decode-only time
    # Requests (four or more) that all arrived within this many seconds of each other are one
    # burst: while any of them waits to start, prefill gets the whole token budget (the
    # streams are the burst's first, and the batch they are about to share fills at once
    # instead of a chunk a step). 0 = off.
    burst_window_s: float = 1.0
    # Tokens the first prefill of a step gets when the time target leaves room for none: 2, the
    # smallest multi-token chunk (deep into a long prompt on a CPU every token of a chunk costs
    # a sizeable share of a decode step, so a larger minimum breaks the target on its own).
    min_prefill_chunk: int = 2
    # Speculative decoding: "ngram" drafts up to `num_speculative_tokens` tokens per decode row
    # from the sequence's own earlier tokens (`core/ngram_proposer.py`); "none" is off.
    speculative: str = "none"
    num_speculative_tokens: int = 4

    def validate(self) -> SchedulerConfig:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        if self.prefill_budget not in PREFILL_BUDGETS:
            raise ValueError(f"prefill_budget must be one of {PREFILL_BUDGETS}")
        if self.slo_tpot_s is not None and not 0 < self.slo_tpot_s < float("inf"):
            raise ValueError("slo_tpot_s must be a positive number of seconds")
        if self.slo_ttft_s is not None and not 0 < self.slo_ttft_s < float("inf"):
            raise ValueError("slo_ttft_s must be a positive number of seconds")
        if not 0 < self.ttft_pace <= 1:
            raise ValueError("ttft_pace must be in (0, 1]")
        if not 1.0 <= self.max_step_slowdown < float("inf"):
            raise ValueError("max_step_slowdown must be >= 1")
        if not 0.0 <= self.burst_window_s < float("inf"):
            raise ValueError("burst_window_s must be >= 0")
        if self.min_prefill_chunk < 1:
            raise ValueError("min_prefill_chunk must be >= 1")
        if self.speculative not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative must be one of {SPECULATIVE_METHODS}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("num_speculative_tokens must be between 1 and 16")
        return self


@dataclass(slots=True)
class CacheConfig:
    """The paged KV cache: block size and either a block count or a memory budget in bytes."""

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | None = None  # bytes; used when num_blocks is None
    enable_prefix_caching: bool = True
    # "tenant": cached blocks are shared within a tenant only; "global": across all tenants.
    prefix_cache_scope: str = "tenant"

    def validate(self) -> CacheConfig:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a power of two")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError("kv_cache_memory must be a positive number of bytes")
        if self.prefix_cache_scope not in ("tenant", "global"):
            raise ValueError("prefix_cache_scope must be 'tenant' or 'global'")
        return self

    def resolve_num_blocks(self, kv_bytes_per_token: int, default_bytes: int) -> int:
        """Blocks that fit the budget (at least 1)."""
        if self.num_blocks is not None:
            return self.num_blocks
        if self.kv_cache_memory is not None:
            return max(1, self.kv_cache_memory // (kv_bytes_per_token * self.block_size))
        # NOTE: a tiny model would turn the default budget into millions of blocks.
        return max(1, min(MAX_DEFAULT_BLOCKS,
                          default_bytes // (kv_bytes_per_token * self.block_size)))


def parse_bytes(text: str) -> int:
    """'512MiB', '2GiB', '1.5G', '1000000' -> bytes."""
    units = {"k": 10**3, "m": 10**6, "g": 10**9, "ki": 2**10, "mi": 2**20, "gi": 2**30}
    s = text.strip().lower().removesuffix("b")
    for suffix in sorted(units, key=len, reverse=True):
        if s.endswith(suffix):
            return int(float(s[: -len(suffix)]) * units[suffix])
    return int(float(s))
