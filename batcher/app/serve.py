"""`batcher serve`: wire model, tokenizer, engine, admission, metrics and the embedding batcher
into the HTTP app, and run it until SIGTERM (drain, then exit 0)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from batcher.admission.admission import Admission
from batcher.admission.feed import decode_step_fn, prefill_step_fn, step_observer
from batcher.engine.engine import AsyncEngine
from batcher.system.gc_freeze import freeze_startup_heap
from batcher.http.listener import LISTEN_BACKLOG, on_stop_signal, server_log
from batcher.engine.metrics import Metrics
from batcher.app.serve_startup import preflight
from batcher.app.serve_flags import engine_config_from_args, fake_device_from_args
from batcher.server.admin import create_admin_app
from batcher.server.app import GATEWAY, create_app
from batcher.server.auth import Authenticator
from batcher.server.embeddings_route import MAX_INPUTS
from batcher.server.gateway import Gateway, GatewayConfig
from batcher.server.responses_store import StoreConfig, retention_from_args
from batcher.admission.tenants import TenantConfig, load_tenants

log = logging.getLogger("batcher.serve")


class _Unset:
    """No tenants passed: `gateway_factory` reads `--tenants` itself."""


_UNSET = _Unset()
EMBEDDING_MODEL_NAME = "all-minilm-l6-v2"


def build_engine(args: argparse.Namespace, metrics: Metrics) -> AsyncEngine:
    """The engine for `--model` (blocking: loads weights): the flags converted once to an
    `EngineConfig`, built by the one factory."""
    from batcher.engine.factory import build_engine as build

    fake = fake_device_from_args(args) if args.model == "fake" else None
    return build(args.model, engine_config_from_args(args), metrics=metrics,
                 version=args.version, fake=fake)


def build_embedder(args: argparse.Namespace):
    if args.embedding_model == "none":
        return None, None
    from batcher.flusher.embeddings import EmbeddingModel, make_embedding_batcher

    from batcher.models.load_settings import cpu_has_fast_bf16

    auto = "bfloat16" if cpu_has_fast_bf16() else "float32"
    model = EmbeddingModel(dtype=args.dtype if args.dtype != "auto" else auto,
                           device="cpu" if args.device in ("auto", None) else args.device)
    # The queue holds at least one request of the most inputs the route takes.
    queue = max(2 * args.embedding_batch_size, MAX_INPUTS)
    return make_embedding_batcher(model, max_batch_size=args.embedding_batch_size,
                                  max_wait_ms=args.embedding_max_wait_ms,
                                  max_queue=queue), model.count_tokens


def gateway_factory(args: argparse.Namespace,
                    tenants: dict[str, TenantConfig] | None | _Unset = _UNSET):
    """The gateway builder of `create_app`. `tenants`, when given, were read already (by the
    preflight); else `--tenants` is read once the model has loaded."""
    for flag in ("slo_ttft_ms", "slo_tpot_ms"):
        value = getattr(args, flag)
        if value is not None and not 0 <= value < float("inf"):
            raise SystemExit(f"--{flag.replace('_', '-')} must be >= 0 ms, got {value}")
    async def build() -> Gateway:
        loop = asyncio.get_running_loop()
        metrics = Metrics(slo_ttft_s=args.slo_ttft_ms / 1000 if args.slo_ttft_ms else None,
                          slo_tpot_s=args.slo_tpot_ms / 1000 if args.slo_tpot_ms else None)
        engine = await loop.run_in_executor(None, build_engine, args, metrics)
        embedder, counter = await loop.run_in_executor(None, build_embedder, args)
        auth = (load_tenants(args.tenants) if args.tenants else None) \
            if isinstance(tenants, _Unset) else tenants
        if auth is None and args.host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("no --tenants file: authentication is off on a non-loopback address")
        sched_cfg = engine.scheduler.config
        decode_step = decode_step_fn(engine.step_time_model, sched_cfg.min_prefill_chunk)
        # NOTE: the queue's default bound follows the device: four batches' worth.
        admission = Admission(auth, max_waiting=args.max_waiting or 4 * sched_cfg.max_num_seqs,
                              slo_ttft_s=args.slo_ttft_ms / 1000 if args.slo_ttft_ms else None,
                              slo_tpot_s=args.slo_tpot_ms / 1000 if args.slo_tpot_ms else None,
                              max_num_seqs=sched_cfg.max_num_seqs,
                              decode_step_s=decode_step,
                              prefill_step=prefill_step_fn(engine.scheduler,
                                                          engine.step_time_model))
        engine.step_listeners.append(step_observer(admission, engine.scheduler,
                                                   engine.step_time_model, decode_step))
        admission.stalls = engine.stall_log
        if not getattr(args, "no_warm_start", False):
            from batcher.engine.warmup import warm_start

            engine.warm_start = (await warm_start(engine)).to_json()
        name = "fake" if args.model == "fake" else engine_model_name(args.model)
        metrics.info.labels(args.version, name).set(1)
        metrics.configure(args.served_model_name or name, engine.scheduler.kv.block_size,
                          engine.scheduler.kv.num_total_blocks,
                          engine.scheduler.config.max_num_seqs,
                          prefill_rate=lambda: admission.prefill_rate)
        cfg = GatewayConfig(model_name=args.served_model_name or name,
                            max_model_len=engine.scheduler.config.max_model_len,
                            default_max_tokens=args.default_max_tokens,
                            max_body_bytes=args.max_body_bytes,
                            tool_call_parser=args.tool_call_parser,
                            reasoning_parser=getattr(args, "reasoning_parser", None),
                            model_info=model_info(engine))
        return Gateway(cfg, engine, Authenticator(auth), admission, metrics, embedder,
                       EMBEDDING_MODEL_NAME, counter)

    return build


def model_info(engine: AsyncEngine) -> dict[str, Any]:
    """What `/v1/models` reports of the loaded model (nothing for the fake engine)."""
    loaded = getattr(engine.runner, "loaded", None)
    if loaded is None:
        return {}
    return {"architecture": loaded.config.architecture,
            "context_length": loaded.config.max_position_embeddings,
            "quantization": loaded.quantization,
            "dtype": str(loaded.dtype).removeprefix("torch.")}


def engine_model_name(source: str) -> str:
    """The served name of `--model`: a file's or folder's name without .gguf or .json; a
    `config.json` (`--load-format dummy`) is named by its folder."""
    path = os.path.normpath(source)
    if os.path.basename(path) == "config.json":
        path = os.path.dirname(os.path.abspath(path))
    return os.path.basename(path).removesuffix(".gguf").removesuffix(".json")


async def run_server(args: argparse.Namespace) -> int:
    from batcher.batch import service as batch

    # Everything checkable without the model is checked, and the ports bound, before it loads.
    pre = preflight(args)
    try:
        fleet_key = os.environ.get("BATCHER_FLEET_KEY")
        app = create_app(gateway_factory(args, pre.tenants), args.max_body_bytes,
                         probe_keys=(pre.admin_key, fleet_key),
                         extend=None if pre.batch_config is None
                         else lambda a: batch.install(a, pre.batch_config),
                         fleet_key=fleet_key,
                         responses=StoreConfig(pre.batch_config and pre.batch_config.data_dir,
                                               retention_from_args(args)))
        quiet_log = server_log()
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                               shutdown_timeout=args.shutdown_timeout,
                               keepalive_timeout=pre.keepalive_s, logger=quiet_log)
        await runner.setup()  # loads the model
    except BaseException:
        pre.close()
        raise
    freeze_startup_heap()
    await web.SockSite(runner, pre.sock, backlog=LISTEN_BACKLOG).start()
    admin_runner = None
    if pre.admin_sock is not None and pre.admin_key:
        admin_runner = web.AppRunner(create_admin_app(app, pre.admin_key), access_log=None,
                                     keepalive_timeout=pre.keepalive_s, logger=quiet_log)
        await admin_runner.setup()
        await web.SockSite(admin_runner, pre.admin_sock).start()
    gw = app[GATEWAY]
    beats = None
    if args.router:
        from batcher.fleet.heartbeat import heartbeat_loop

        url = args.advertise_url or f"http://{args.host}:{pre.port}"
        admin_url = None
        if args.admin_port:
            host = url.split("://", 1)[-1].rsplit(":", 1)[0]
            admin_url = f"http://{host}:{args.admin_port}"
        beats = asyncio.get_running_loop().create_task(heartbeat_loop(
            gw.state, args.router, args.replica_id or f"{args.host}:{pre.port}", url,
            admin_url=admin_url))
    log.info("serving %s on http://%s:%d", gw.cfg.model_name, args.host, pre.port)
    if pre.batch_config is not None:
        log.info("batch API (/v1/files, /v1/batches) keeps its files and database in %s "
                 "(--data-dir; --no-batch-api turns it off)", pre.batch_config.data_dir)
    log.info("stored responses (/v1/responses) are kept %s", "in memory (no data directory)"
             if pre.batch_config is None else f"in {pre.batch_config.data_dir}")
    print(f"batcher: serving {gw.cfg.model_name} on http://{args.host}:{pre.port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    draining = (f"draining (up to {args.shutdown_timeout:g}s for requests in flight), "
                "then stopping")
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_stop_signal, sig, stop, log, draining)
    await stop.wait()
    # Drain: readiness 503, new work 503 + Retry-After, in-flight requests finish in time.
    gw.set_draining(True)
    # Batch lines stop at once (they stay pending and resume after a restart): the drain waits
    # only for live requests.
    await batch.stop_executor(app)
    deadline = time.monotonic() + args.shutdown_timeout
    while gw.jobs and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if gw.jobs:
        log.warning("shutdown timeout: ending %d requests with an error", len(gw.jobs))
        await gw.engine.stop("the server shut down before this request finished")
        await asyncio.sleep(0.1)  # let handlers write their final error events
    if beats is not None:
        beats.cancel()
    if admin_runner is not None:
        await admin_runner.cleanup()
    await runner.cleanup()
    return 0
