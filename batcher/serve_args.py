"""The flags of `batcher serve`, in a module of their own: the top-level CLI, the fleet launcher
and the offline batch runner all build a replica's parser from them, and none of them needs the
others to do it."""

from __future__ import annotations

import argparse

from batcher.config import (
    CPU_MAX_NUM_BATCHED_TOKENS,
    CPU_MAX_NUM_SEQS,
    CUDA_MAX_NUM_BATCHED_TOKENS,
    CUDA_MAX_NUM_SEQS,
    PREFILL_BUDGETS,
)

# Time-to-first-token a server started with no flags admits requests for (see --slo-ttft-ms).
DEFAULT_SLO_TTFT_MS = 2000.0


def add_serve_args(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--model", default="smollm2-135m", help="smollm2-135m (bundled), tiny (random weights, "
      "for tests), fake (simulated engine for fleet tests), a .gguf file or a Hugging Face "
      "folder (default: %(default)s)")
    a("--served-model-name", default=None, help="name clients use in 'model' (default: derived "
      "from --model)")
    a("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    a("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    a("--dtype", default="auto", help="auto (bfloat16), float32 or bfloat16 "
      "(default: %(default)s)")
    a("--device", default="auto", help="auto, cpu or cuda (default: %(default)s)")
    a("--kv-cache-memory", default=None, help="KV cache budget, e.g. 1GiB (default: 2GiB on "
      "CPU, at most a quarter of RAM; free GPU memory x 0.9 on CUDA)")
    a("--num-blocks", type=int, default=None, help="KV blocks (overrides --kv-cache-memory; "
      "default: sized from --kv-cache-memory)")
    a("--block-size", type=int, default=16, help="tokens per KV block (default: %(default)s)")
    a("--no-prefix-caching", action="store_true", help="disable prefix caching (default: "
      "prefix caching on)")
    a("--prefix-cache-scope", choices=("tenant", "global"), default="tenant", help="share "
      "cached prompt blocks within a tenant only, or across all tenants (only when every "
      "tenant may learn what the others send) (default: %(default)s)")
    a("--max-num-seqs", type=int, default=None,
      help=f"most sequences in one step (default: {CPU_MAX_NUM_SEQS} on CPU, "
      f"{CUDA_MAX_NUM_SEQS} on CUDA)")
    a("--max-num-batched-tokens", type=int, default=None,
      help=f"most tokens in one step, an upper bound on every step's budget; a step with no "
      f"decodes gives prefill all of it (default: {CPU_MAX_NUM_BATCHED_TOKENS} on CPU, "
      f"{CUDA_MAX_NUM_BATCHED_TOKENS} on CUDA)")
    a("--prefill-budget", default="time", choices=list(PREFILL_BUDGETS),
      help="how much prefill a step carrying decodes takes: 'time' sizes each chunk with a "
      "model of step time fitted online from the engine's measured steps, so the step stays "
      "within --slo-tpot-ms when set, else within --max-step-slowdown times the decode-only "
      "step; 'fixed' fills --max-num-batched-tokens whatever the step then costs "
      "(default: %(default)s)")
    a("--max-step-slowdown", type=float, default=1.5,
      help="without --slo-tpot-ms, a step carrying decodes may take at most this times the "
      "steady step, the decode-only step of the running streams plus the requests waiting "
      "to join them: streams then keep within this factor of their steady time per token "
      "while a new prompt is read. 1.5 keeps streams visibly smooth and still reads a prompt "
      "at a useful pace; lower protects streams more and slows time to first token "
      "(default: %(default)s)")
    a("--min-prefill-chunk", type=int, default=16,
      help="prompt tokens the longest-waiting prefill gets every step even when the target "
      "leaves no room, so a long prompt always progresses (default: %(default)s)")
    a("--attention-backend", default="auto", choices=["auto", "torch", "triton"],
      help="decode attention: the fused Triton kernel on CUDA when available (default: "
      "%(default)s)")
    a("--no-cuda-graphs", action="store_true", help="run decode steps eagerly on CUDA")
    a("--torch-threads", type=int, default=None, help="intra-op threads for the model "
      "(default: all cores)")
    a("--max-model-len", type=int, default=8192, help="context limit, prompt + output "
      "(default: %(default)s, capped by the model)")
    a("--default-max-tokens", type=int, default=1024, help="chat max_tokens when the client "
      "sends none (default: %(default)s)")
    a("--tenants", default=None, help="tenants TOML file (keys, token budgets) (default: none, "
      "auth off)")
    a("--max-waiting", type=int, default=256, help="queue bound before 503 "
      "(default: %(default)s)")
    a("--max-body-bytes", type=int, default=4 * 2**20, help="request body limit "
      "(default: %(default)s)")
    a("--admin-port", type=int, default=None, help="admin listener port (drain/undrain); off "
      "unless given")
    a("--admin-host", default="127.0.0.1", help="admin listener address (default: %(default)s)")
    a("--admin-key", default=None, help="admin key (default: env BATCHER_ADMIN_KEY)")
    a("--slo-ttft-ms", type=float, default=DEFAULT_SLO_TTFT_MS, help="time-to-first-token SLO "
      "in ms: a request is admitted only when its predicted TTFT is within 85%% of it (batch "
      "within half of it), otherwise refused at once with 503 + Retry-After; also the goodput "
      "threshold. The default keeps an interactive client's wait for its first token bounded "
      "on a server started with no flags, instead of letting the queue (--max-waiting) grow "
      "to minutes; 0 turns the check off (the queue is then bounded only by count) "
      "(default: %(default)g)")
    a("--slo-tpot-ms", type=float, default=None, help="time-per-output-token SLO in ms: new "
      "work is refused (503) when one more stream would make the running streams' step "
      "slower than this, as predicted from the measured step times; also the goodput "
      "threshold (default: none, no TPOT check)")
    a("--shutdown-timeout", type=float, default=30.0, help="seconds in-flight requests get to "
      "finish on SIGTERM (default: %(default)s)")
    a("--embedding-model", default="minilm", choices=["minilm", "none"],
      help="serve /v1/embeddings with the bundled all-MiniLM-L6-v2 (default: %(default)s)")
    a("--embedding-batch-size", type=int, default=32, help="most embedding inputs in one "
      "model call (default: %(default)s)")
    a("--embedding-max-wait-ms", type=float, default=5.0, help="longest an embedding input "
      "waits for its batch to fill (default: %(default)s)")
    a("--version", default="v1", help="version label reported in /v1/state "
      "(default: %(default)s)")
    a("--log-level", default="info", help="debug, info, warning or error "
      "(default: %(default)s)")
    a("--router", action="append", default=[], help="router URL to heartbeat /v1/state to "
      "about once a second (repeatable; joins that router's fleet)")
    a("--advertise-url", default=None, help="URL routers should use for this replica "
      "(default: http://HOST:PORT)")
    a("--replica-id", default=None, help="stable replica name (default: HOST:PORT)")
    from batcher.batch.service import add_batch_serve_args

    add_batch_serve_args(p)
    fake = p.add_argument_group("fake model (--model fake)")
    fake.add_argument("--fake-prefill-rate", type=float, default=20_000.0,
                      help="simulated prefill tokens/s (default: %(default)s)")
    fake.add_argument("--fake-decode-step-ms", type=float, default=20.0,
                      help="simulated decode step time (default: %(default)s)")
    fake.add_argument("--fake-step-factor", type=float, default=1.0,
                      help="every simulated step this many times as long: a slower replica "
                      "(default: %(default)s)")
    fake.add_argument("--fake-fault", default="none",
                      choices=["none", "hang", "crash", "slow", "error"],
                      help="inject a fault after --fake-fault-after-steps (default: %(default)s)")
    fake.add_argument("--fake-fault-after-steps", type=int, default=0,
                      help="(default: %(default)s)")
