"""The flags of `batcher serve`, in a module of their own: the top-level CLI, the fleet launcher
and the offline batch runner all build a replica's parser from them, and none of them needs the
others to do it."""

from __future__ import annotations

import argparse
from dataclasses import fields

from batcher.flags.types import (
    DEVICES,
    DTYPES,
    LOG_LEVELS,
    byte_size,
    int_at_least,
    lower,
    non_negative_float,
    non_negative_int,
    port,
    positive_float,
    positive_int,
    positive_rate,
    power_of_two,
)
from batcher.bundled import DEFAULT_MODEL
from batcher.core.config import (
    ATTENTION_BACKENDS,
    CPU_MAX_NUM_BATCHED_TOKENS,
    CPU_MAX_NUM_SEQS,
    CUDA_MAX_NUM_BATCHED_TOKENS,
    CUDA_MAX_NUM_SEQS,
    LOAD_FORMATS,
    PREFILL_BUDGETS,
    QUANTIZATIONS,
    SPECULATIVE_METHODS,
)
from batcher.engine.config import EngineConfig
from batcher.server.reasoning import reasoning_parser_names
from batcher.server.tool_parsers import DEFAULT as TOOL_PARSER_DEFAULT
from batcher.server.tool_parsers import parser_names as tool_parser_names

# The engine settings' defaults, one copy for these flags and the in-process API.
_E = EngineConfig()


def add_serve_args(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--model", default=DEFAULT_MODEL, help="smollm2-135m (bundled), tiny (random weights, "
      "for tests), fake (simulated engine for fleet tests), a .gguf file or a Hugging Face "
      "folder (default: %(default)s)")
    a("--load-format", default=_E.load_format, type=lower, choices=LOAD_FORMATS,
      help="dummy: random weights in --model's shapes, to measure a model's size and speed "
      "without its weights (the output is meaningless); --model is then llama-3.1-8b, "
      "qwen2.5-7b, llama-3.2-1b, smollm2-135m, a config.json or a Hugging Face folder "
      "(default: %(default)s)")
    a("--served-model-name", default=None, help="name clients use in 'model' (default: derived "
      "from --model)")
    a("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    a("--port", type=port, default=8000, help="TCP port to listen on, 0 for any free one "
      "(default: %(default)s)")
    a("--dtype", default=_E.dtype, type=lower, choices=DTYPES, help="weight and activation type; "
      "auto is bfloat16 on a GPU, on a CPU that computes it natively (AVX-512 BF16 or AMX) and "
      "with --quantization int8/int4, else float32, which batches faster where bf16 is emulated "
      "(default: %(default)s)")
    a("--quantization", default=_E.quantization, type=lower, choices=QUANTIZATIONS,
      help="weight-only quantization of the decoder layers on a CPU: int8 per row or int4 in "
      "groups of 32, run by packed bf16 kernels. auto is int4 for a Q4_1 GGUF (the bundled "
      "model) on a CPU with native bf16, else none (dense weights); speed and memory in "
      "BENCHMARKS.md (default: %(default)s)")
    a("--quantized-dense-above", type=non_negative_int, default=_E.quantized_dense_above,
      metavar="ROWS", help="with int8/int4 quantization, steps of more than ROWS rows use a "
      "dense bf16 copy of the layers' weights, for more resident memory; 0 keeps none (int4 "
      "unpacks per step instead). A tied int8 LM head keeps a copy either way, used past 4 "
      "rows (past ROWS if fewer) (default: %(default)s)")
    a("--device", default=_E.device, type=lower, choices=DEVICES, help="auto picks cuda when a GPU "
      "is visible (default: %(default)s)")
    a("--kv-cache-memory", type=byte_size, default=_E.kv_cache_memory,
      help="KV cache budget, e.g. 1GiB; on a CPU the pool becomes resident memory only as "
      "its blocks are first written (default: 2GiB on CPU, at most a quarter of RAM; free GPU "
      "memory x 0.9 on CUDA)")
    a("--num-blocks", type=positive_int, default=_E.num_blocks,
      help="KV blocks (overrides --kv-cache-memory; "
      "default: sized from --kv-cache-memory)")
    a("--block-size", type=power_of_two, default=_E.block_size,
      help="tokens per KV block, a power of two "
      "(default: %(default)s)")
    a("--no-prefix-caching", action="store_true", help="disable prefix caching (default: "
      "prefix caching on)")
    a("--prefix-cache-scope", choices=("tenant", "global"), default=_E.prefix_cache_scope,
      help="share "
      "cached prompt blocks within a tenant only, or across all tenants (only when every "
      "tenant may learn what the others send) (default: %(default)s)")
    a("--max-num-seqs", type=positive_int, default=_E.max_num_seqs,
      help=f"most sequences in one step (default: {CPU_MAX_NUM_SEQS} on CPU, "
      f"{CUDA_MAX_NUM_SEQS} on CUDA and for --model fake, which stands for a device)")
    a("--max-num-batched-tokens", type=positive_int, default=_E.max_num_batched_tokens,
      help=f"most tokens in one step, an upper bound on every step's budget; a step with no "
      f"decodes gives prefill all of it (default: {CPU_MAX_NUM_BATCHED_TOKENS} on CPU, "
      f"{CUDA_MAX_NUM_BATCHED_TOKENS} on CUDA and for --model fake)")
    a("--prefill-budget", default=_E.prefill_budget, choices=list(PREFILL_BUDGETS),
      help="prefill in a step carrying decodes: 'time' sizes each chunk by a step-time model "
      "fitted online, to keep the step within --slo-tpot-ms, else --max-step-slowdown; 'fixed' "
      "fills --max-num-batched-tokens (default: %(default)s)")
    a("--max-step-slowdown", type=float, default=_E.max_step_slowdown,
      help="without --slo-tpot-ms, a step carrying prefill takes at most this times the "
      "decode-only step of the running streams (a prompt due by its TTFT SLO, or too long for "
      "it, may get more); lower protects streams, raises time to first token "
      "(default: %(default)s)")
    a("--burst-window-ms", type=float, default=_E.burst_window_ms,
      help="four or more requests arriving within this many ms of each other are a burst: "
      "while any of them waits, prefill takes the whole step budget instead of the "
      "--max-step-slowdown share; 0 = off (default: %(default)s)")
    a("--min-prefill-chunk", type=positive_int, default=_E.min_prefill_chunk,
      help="prompt tokens the longest-waiting prefill gets in a step whose time target leaves "
      "room for none, so a long prompt always progresses (default: %(default)s)")
    a("--speculative", default=_E.speculative, type=lower, choices=SPECULATIVE_METHODS,
      help="speculative decoding: 'ngram' drafts a stream's next tokens from an earlier "
      "occurrence of its latest tokens and checks them in the same step; less CPU per token "
      "when the output repeats the prompt; in bf16 it may flip a near-tie (BENCHMARKS.md) "
      "(default: %(default)s)")
    a("--num-speculative-tokens", type=positive_int, default=_E.num_speculative_tokens,
      help="most tokens drafted per stream and step with --speculative ngram, 1-16 "
      "(default: %(default)s)")
    a("--attention-backend", default=_E.attention_backend, choices=ATTENTION_BACKENDS,
      help="decode attention: the fused Triton kernel on CUDA when available (default: "
      "%(default)s)")
    a("--no-cuda-graphs", action="store_true", help="run every step eagerly on CUDA (by default "
      "decode steps, and steps of up to 512 tokens with prompt chunks, replay CUDA graphs)")
    a("--no-step-overlap", action="store_true", help="emit each step's tokens before scheduling "
      "the next step, and never queue a step before the running one's tokens are known (by "
      "default both overlap the host's work with the model's; a request that then ends may "
      "compute one row more, which is dropped)")
    a("--no-warm-start", action="store_true", help="report ready once the model is loaded, "
      "without first running each step shape (compiling kernels, capturing graphs) and "
      "calibrating admission to this device; the first requests then pay for both")
    a("--compile-decode", action="store_true", default=_E.compile_decode,
      help="CPU: run one-stream decode steps as one torch.compile graph, compiled at start-up "
      "(seconds to minutes; eager without a C++ compiler): less CPU per token, bf16 logits may "
      "differ in the last bits (BENCHMARKS.md) (default: off)")
    a("--torch-threads", type=positive_int, default=_E.torch_threads,
      help="most intra-op threads for the model; on a CPU each step size tries this many, one "
      "fewer and half, and keeps the fastest (default: the CPU quota of the container or "
      "cgroup, else all cores)")
    a("--max-model-len", type=int_at_least(2), default=_E.max_model_len,
      help="context limit in tokens, "
      "prompt + output (default: %(default)s, capped by the model)")
    a("--default-max-tokens", type=positive_int, default=1024,
      help="chat max_tokens when the client "
      "sends none (default: %(default)s)")
    a("--tool-call-parser", default=TOOL_PARSER_DEFAULT, choices=tool_parser_names(),
      help="tool call format: 'generic' lists the tools in a system message and constrains the "
      "answer to a JSON call or a reply; 'hermes' (Qwen2.5/Qwen3) and 'llama3_json' (Llama "
      "3.1-3.3) use the chat template's own format (default: %(default)s)")
    a("--reasoning-parser", default=None, choices=reasoning_parser_names(),
      help="thinking models: chat answers carry the <think> block as 'reasoning_content' "
      "(qwen3: when the answer opens one; deepseek_r1: the prompt opened it) (default: none)")
    a("--tenants", default=None, help="tenants TOML file (keys, token budgets) (default: none, "
      "auth off)")
    a("--max-waiting", type=positive_int, default=None, help="requests queued before new ones "
      "get 503; --slo-ttft-ms bounds the wait, this the count (default: 4 x --max-num-seqs: "
      "256 on a CPU, 1024 on a GPU)")
    a("--max-body-bytes", type=positive_int, default=4 * 2**20, help="request body limit in bytes "
      "(default: %(default)s)")
    a("--api-key", action="append", default=[], metavar="KEY", help="an API key clients "
      "must send (Bearer or x-api-key); repeatable, or a comma-separated BATCHER_API_KEY; one "
      "tenant with no budget: use --tenants for budgets and several tenants (default: none, "
      "auth off)")
    a("--keepalive-timeout", type=positive_float, default=None, help="seconds an idle "
      "client connection stays open, also the limit for sending a request's headers; set it "
      "above the idle timeout of a load balancer in front (default: 20)")
    a("--admin-port", type=port, default=None, help="admin listener port (drain/undrain); off "
      "unless given")
    a("--admin-host", default="127.0.0.1", help="admin listener address (default: %(default)s)")
    a("--admin-key", default=None, help="admin key (default: env BATCHER_ADMIN_KEY)")
    a("--slo-ttft-ms", type=non_negative_float, default=_E.slo_ttft_ms,
      help="time-to-first-token SLO in ms: a request is admitted only when its predicted TTFT "
      "is within 85%% of it (a prompt too long for it: its wait behind others within half), "
      "else 503 + Retry-After at once; prompts are paced to be read within half of it; also the "
      "goodput threshold; 0 = off (default: %(default)g)")
    a("--slo-tpot-ms", type=non_negative_float, default=_E.slo_tpot_ms,
      help="time-per-output-token SLO in ms: new "
      "work is refused (503) when one more stream would make the running streams' step "
      "slower than this, as predicted from the measured step times; also the goodput "
      "threshold (default: none, no TPOT check)")
    a("--shutdown-timeout", type=non_negative_float, default=30.0, help="seconds in-flight "
      "requests get to finish on SIGTERM (default: %(default)s)")
    a("--embedding-model", default="minilm", choices=["minilm", "none"],
      help="serve /v1/embeddings with the bundled all-MiniLM-L6-v2 (default: %(default)s)")
    a("--embedding-batch-size", type=positive_int, default=32, help="most embedding inputs in "
      "one model call (default: %(default)s)")
    a("--embedding-max-wait-ms", type=non_negative_float, default=5.0, help="longest an "
      "embedding input waits for its batch to fill, in ms (default: %(default)s)")
    a("--deployment-version", dest="version", default="v1", help="deployment label reported "
      "in /v1/state and the metrics, for canaries and rollouts (`--version` prints the "
      "package's version) (default: %(default)s)")
    a("--log-level", default="info", type=lower, choices=LOG_LEVELS, help="debug also prints "
      "the traceback of a startup error (default: %(default)s)")
    a("--router", action="append", default=[], help="router URL to heartbeat /v1/state to "
      "about once a second (repeatable; joins that router's fleet)")
    a("--advertise-url", default=None, help="URL routers should use for this replica "
      "(default: http://HOST:PORT)")
    a("--replica-id", default=None, help="stable replica name (default: HOST:PORT)")
    from batcher.batch.service import add_batch_serve_args

    add_batch_serve_args(p)
    from batcher.server.responses_store import add_responses_serve_args

    add_responses_serve_args(p)
    fake = p.add_argument_group("fake model (--model fake)")
    fake.add_argument("--fake-prefill-rate", type=positive_rate, default=20_000.0,
                      help="simulated prefill tokens/s; inf: prompts cost nothing "
                      "(default: %(default)s)")
    fake.add_argument("--fake-decode-step-ms", type=non_negative_float, default=20.0,
                      help="simulated decode step time in ms, whatever the number of "
                      "sequences (default: %(default)s)")
    fake.add_argument("--fake-per-seq-ms", type=non_negative_float, default=0.2,
                      help="simulated extra time per decoding sequence and step in ms; "
                      "with --fake-decode-step-ms 0 and --fake-prefill-rate inf, a model that "
                      "costs nothing: what remains is the host's own work (default: "
                      "%(default)s)")
    fake.add_argument("--fake-step-factor", type=positive_float, default=1.0,
                      help="every simulated step this many times as long: a slower replica "
                      "(default: %(default)s)")
    # Fault injection is for the fleet's own tests: accepted, never shown in --help.
    fake.add_argument("--fake-fault", default="none",
                      choices=["none", "hang", "crash", "slow", "error"],
                      help=argparse.SUPPRESS)
    fake.add_argument("--fake-fault-after-steps", type=non_negative_int, default=0,
                      help=argparse.SUPPRESS)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The engine settings of parsed `batcher serve` flags: the one conversion from flags to an
    `EngineConfig`. Not yet validated."""
    values = {f.name: getattr(args, f.name) for f in fields(EngineConfig)
              if f.name not in ("enable_prefix_caching", "cuda_graphs", "step_overlap")}
    return EngineConfig(**values, enable_prefix_caching=not args.no_prefix_caching,
                        cuda_graphs=not args.no_cuda_graphs,
                        step_overlap=not args.no_step_overlap)


def fake_device_from_args(args: argparse.Namespace):
    """The simulated device of `--model fake`'s flags (`batcher.engine.fake_runner.FakeDevice`)."""
    from batcher.engine.fake_runner import FakeDevice, FakeSpeed

    speed = FakeSpeed(prefill_tokens_per_s=args.fake_prefill_rate,
                      decode_step_s=args.fake_decode_step_ms / 1000,
                      per_seq_s=args.fake_per_seq_ms / 1000,
                      step_factor=args.fake_step_factor)
    return FakeDevice(speed, args.fake_fault, args.fake_fault_after_steps)
