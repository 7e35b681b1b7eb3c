"""The public in-process API: `EngineConfig` carries `batcher serve`'s defaults, and the runnable
example drives `LLM` and `AsyncLLM` on the bundled model with no start call to forget."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

import batcher
from batcher.engine.config import EngineConfig
from batcher.app.serve_flags import add_serve_args

ROOT = Path(__file__).resolve().parent.parent


def test_engine_config_defaults_are_the_flags_defaults() -> None:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    flags = vars(parser.parse_args([]))
    config = EngineConfig()
    negated = {"enable_prefix_caching": "no_prefix_caching", "cuda_graphs": "no_cuda_graphs",
               "step_overlap": "no_step_overlap"}  # on by default, a --no- flag turns off
    for f in dataclasses.fields(config):
        if f.name in negated:
            assert getattr(config, f.name) is not flags[negated[f.name]], f.name
        else:
            assert getattr(config, f.name) == flags[f.name], f.name
    assert flags["max_model_len"] == 8192


@pytest.mark.parametrize(("change", "message"), [
    ({"dtype": "fp64"}, "dtype"), ({"block_size": 12}, "block_size"),
    ({"max_num_seqs": 0}, "max_num_seqs"), ({"max_model_len": 1}, "max_model_len"),
])
def test_engine_config_refuses_bad_settings(change: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**change).validate()


def test_public_names() -> None:
    for name in batcher.__all__:
        assert getattr(batcher, name) is not None
    assert (ROOT / "batcher" / "py.typed").exists()


@pytest.mark.slow
def test_example_runs_on_the_bundled_model() -> None:
    run = subprocess.run([sys.executable, "examples/embed_engine.py", "The capital of France is"],
                         check=False, cwd=ROOT, capture_output=True, text=True,
                         timeout=180)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    first = lines[0]
    assert first.startswith("'The capital of France is' -> ") and "Paris" in first
    assert "(12 tokens, length)" in first
    assert "'1, 2, 3,' -> ' 4, 5" in run.stdout
    # Greedy decoding: the streamed text of the async engine is the blocking engine's text.
    text = first.split(" -> ", 1)[1].rsplit(" (", 1)[0]
    streamed = run.stdout.split("streamed: ", 1)[1].rstrip("\n")
    assert streamed == ast.literal_eval(text)  # the repr the example printed


def test_scheduler_config_defaults_are_the_engine_configs() -> None:
    """Embedding the core scheduler directly gets the same limits as the CLI and `EngineConfig`."""
    from batcher.core.config import SchedulerConfig
    from batcher.engine.config import EngineConfig

    core, engine = SchedulerConfig(), EngineConfig()
    assert core.max_model_len == engine.max_model_len
