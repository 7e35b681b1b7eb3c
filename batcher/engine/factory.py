"""The one way to build an engine: `build_engine(model, EngineConfig)`. The command line converts
its flags to an `EngineConfig` once (`batcher.app.serve_flags.engine_config_from_args`); the library
API (`batcher.llm`), the offline batch job, the benchmarks and the tests call this."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from batcher.core.config import (
    CUDA_MAX_NUM_BATCHED_TOKENS,
    CUDA_MAX_NUM_SEQS,
    SchedulerConfig,
)
from batcher.engine.config import EngineConfig

if TYPE_CHECKING:
    from batcher.engine.engine import AsyncEngine
    from batcher.engine.fake_runner import FakeDevice
    from batcher.engine.metrics import Metrics

log = logging.getLogger("batcher.serve")


def build_engine(model: str, config: EngineConfig, *, metrics: Metrics | None = None,
                 version: str = "v1", fake: FakeDevice | None = None) -> AsyncEngine:
    """The engine for `model` (a bundled name, a .gguf file, a Hugging Face folder, or "fake",
    the simulated device `fake` describes). Blocking: loads weights. Raises ValueError for a bad
    setting, `batcher.models.errors.ModelLoadError` for a model that cannot load."""
    from batcher.engine.engine import AsyncEngine
    from batcher.engine.metrics import Metrics
    from batcher.system.threads import cpu_quota_threads
    from batcher.tokenizer.tokenizer import load_tokenizer

    config.validate()
    metrics = metrics if metrics is not None else Metrics()
    threads = config.torch_threads or cpu_quota_threads()
    if threads:
        import torch

        torch.set_num_threads(threads)
    sched, cache = config.scheduler_config(), config.cache_config()
    if model == "fake":
        from batcher.engine.fake_runner import FakeDevice, FakeSpeed, build_fake_engine

        # NOTE: the fake model stands for a device: the CPU defaults (fitted to the bundled
        # model's cost per row on two cores) would cap it at a quarter of the sequences a GPU
        # runs.
        _device_defaults(sched, config)
        return build_fake_engine(fake or FakeDevice(FakeSpeed()), sched, cache, metrics, version,
                                 overlap=config.step_overlap)
    from batcher.models.loader import load_model

    lm = load_model(model, dtype=config.dtype, device=config.device,
                    quantization=config.quantization,
                    dense_above=config.quantized_dense_above or None,
                    load_format=config.load_format)
    sched.max_model_len = min(config.max_model_len, lm.config.max_position_embeddings)
    if lm.device.type == "cuda":  # a GPU step takes far more work than a CPU one
        _device_defaults(sched, config)
    tok = load_tokenizer(lm.tokenizer_source)
    log.info("model %s loaded in %.1fs (%s on %s)", lm.name, lm.load_seconds, lm.dtype,
             lm.device)
    return AsyncEngine.from_loaded(lm, tok, sched.validate(), cache, metrics=metrics,
                                   version=version, attention_backend=config.attention_backend,
                                   cuda_graphs=config.cuda_graphs,
                                   compile_decode=config.compile_decode,
                                   overlap=config.step_overlap)


def _device_defaults(sched: SchedulerConfig, config: EngineConfig) -> None:
    """The limits `config` leaves unset take a device's defaults, not the CPU's."""
    sched.max_num_seqs = config.max_num_seqs or CUDA_MAX_NUM_SEQS
    sched.max_num_batched_tokens = config.max_num_batched_tokens or CUDA_MAX_NUM_BATCHED_TOKENS


__all__ = ["build_engine"]
