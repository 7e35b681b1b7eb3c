"""What the scenarios share: the checkout's root, a scenario's parser and command line, a
scenario run again in a child process, another checkout's server, the runner `batcher serve`
builds stepped by hand on a model thread, and the transformers baseline's padded batches. The measuring helpers every bench uses (workloads, percentiles,
BENCHMARKS.md rows) are the installed `batcher.bench.common`."""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNNER = __package__ or "scripts.bench"


def serving_runner(blocks: int):
    """The model runner `build_engine` makes from the default `EngineConfig` (the bundled model
    as `batcher serve` loads it, never started: its steps are run by hand), with its first
    `blocks` KV blocks made resident, as a serving pool's reused blocks are. Run its steps
    through `on_model_thread`."""
    from batcher.bundled import DEFAULT_MODEL
    from batcher.engine.config import EngineConfig
    from batcher.engine.factory import build_engine
    from batcher.system.threads import release_openmp_pool

    runner = build_engine(DEFAULT_MODEL, EngineConfig()).runner
    if blocks > runner.num_blocks:
        raise SystemExit(f"the default KV pool ({runner.num_blocks} blocks) is too small")
    for k_cache, v_cache in runner.kv_caches:
        k_cache[:blocks].zero_()
        v_cache[:blocks].zero_()
    release_openmp_pool()  # the steps run on another thread
    return runner


def on_model_thread(run) -> None:
    """`run()` on a fresh thread named as the engine's model thread, waited for."""
    import threading

    worker = threading.Thread(target=run, name="batcher-model")
    worker.start()
    worker.join()


def scenario(module: str) -> str:
    """A scenario's name from its module's `__name__` (`scripts.bench.router` -> `router`)."""
    return module.rpartition(".")[2]


def parser(module: str, doc: str | None, *, first_paragraph: bool = False,
           raw: bool = False) -> argparse.ArgumentParser:
    """The scenario's argument parser, its usage line named as it is run."""
    text = (doc or "").split("\n\n")[0] if first_paragraph else doc
    return argparse.ArgumentParser(
        prog=f"python -m {RUNNER} {scenario(module)}", description=text,
        formatter_class=argparse.RawDescriptionHelpFormatter if raw else argparse.HelpFormatter)


def command(module: str, *args: str) -> str:
    """The command line that runs the scenario with `args`, as a BENCHMARKS.md row shows it."""
    return shlex.join(["python", "-m", RUNNER, scenario(module), *args])


def rerun(module: str, *args: str) -> list[str]:
    """The command that runs the scenario again in a child process (a case in a process of its
    own). `python -m` finds `scripts` in the working directory: the child inherits this one's,
    or is given the root on its PYTHONPATH (`python_path`)."""
    return [sys.executable, "-m", RUNNER, scenario(module), *args]


def python_path(*first: str | Path) -> str:
    """A PYTHONPATH with `first` ahead of this checkout's root and what the environment has."""
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join([*map(str, first), str(ROOT), *rest])


def cli_module(checkout: Path) -> str:
    """The module of a checkout's `batcher` command (`batcher/cli.py` before the packages moved
    to `batcher/app/`), for `python -m` from that checkout."""
    return "batcher.app.cli" if (checkout / "batcher" / "app" / "cli.py").is_file() \
        else "batcher.cli"


def start_checkout(checkout: Path, *args: str, **popen: object) -> subprocess.Popen:
    """`batcher ARGS` from the checkout at `checkout` (this one or another) with this
    interpreter, in a process of its own: run from that folder with it alone on PYTHONPATH, so
    its `batcher` is the one imported (`python -m` puts the working directory first)."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    return subprocess.Popen([sys.executable, "-m", cli_module(checkout), *args], cwd=checkout,
                            env=env, **popen)  # type: ignore[call-overload]


def left_padded(group: list[dict]):
    """A static batch of workload requests for transformers' `generate`: token ids and attention
    mask left-padded to the longest prompt, and the new tokens the batch runs for (its longest
    member's). Torch is imported here, so scenarios without it can use the rest."""
    import torch

    width = max(len(r["prompt_ids"]) for r in group)
    ids = torch.zeros(len(group), width, dtype=torch.long)
    mask = torch.zeros(len(group), width, dtype=torch.long)
    for j, r in enumerate(group):
        n = len(r["prompt_ids"])
        ids[j, width - n:] = torch.tensor(r["prompt_ids"])
        mask[j, width - n:] = 1
    return ids, mask, max(r["max_new_tokens"] for r in group)
