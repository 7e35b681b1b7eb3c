"""Every tensor operation of a served engine — load, thread-pool set-up, steps — runs on one model
thread, so one OpenMP team owns the cores (see scripts/bench_model_thread.py for the step time)."""

from __future__ import annotations

import argparse
import threading

from batcher import serve
from batcher.metrics import Metrics
from batcher.models import loader
from batcher.request import Request
from batcher.sampling import SamplingParams
from batcher.serve_args import add_serve_args


async def test_start_engine_loads_and_steps_on_the_same_thread(monkeypatch) -> None:
    threads: dict[str, threading.Thread] = {}
    real_load = loader.load_model

    def load(*args, **kwargs):
        threads["load"] = threading.current_thread()
        return real_load(*args, **kwargs)

    monkeypatch.setattr(loader, "load_model", load)
    p = argparse.ArgumentParser()
    add_serve_args(p)
    args = p.parse_args(["--model", "tiny", "--dtype", "float32", "--num-blocks", "64"])
    engine = await serve.start_engine(args, Metrics())
    real_execute = engine.runner.execute

    def execute(sched):
        threads.setdefault("step", threading.current_thread())
        return real_execute(sched)

    engine.runner.execute = execute
    await engine.start()
    try:
        events = [ev async for ev in engine.generate(
            Request("r", [1, 2, 3, 4], SamplingParams(temperature=0.0, max_tokens=3)))]
    finally:
        await engine.stop()
    assert events[-1].finish_reason == "length"
    assert threads["load"] is threads["step"]
    assert threads["step"] is not threading.main_thread()
