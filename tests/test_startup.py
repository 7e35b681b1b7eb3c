"""`batcher serve` refuses a bad setting before it loads the model: one line on stderr,
`batcher serve: error: ...`, exit status 2, no traceback unless --log-level debug. Each case
runs the real command with the bundled model's defaults, so a check that happened only after
loading would show up as a model-loaded line in the output."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 60.0


def _start(*flags: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("BATCHER_")}
    return subprocess.Popen([sys.executable, "-m", "batcher.app.cli", "serve", *flags], cwd=ROOT,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**clean, **(env or {})})


def _finish(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"batcher serve did not exit: {err}")
    return proc.returncode, out, err


@pytest.mark.slow
def test_every_bad_setting_is_one_line_before_the_model_loads(tmp_path: Path) -> None:
    bad_tenants = tmp_path / "tenants.toml"
    bad_tenants.write_text("[tenants.a]\nkeys_sha256 = 'not a list'\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        cases = {
            "--block-size": (["--block-size", "12"], "power of two"),
            "--max-model-len": (["--max-model-len", "1"], "--max-model-len"),
            "port in use": (["--port", port], f"127.0.0.1:{port}"),
            "--tenants": (["--tenants", str(bad_tenants)], "tenant 'a'"),
            "missing tenants": (["--tenants", str(tmp_path / "none.toml")], "--tenants"),
            "admin key": (["--admin-port", "0"], "--admin-key"),
            "--max-num-seqs": (["--max-num-seqs", "0"], ">= 1"),
            "--port": (["--port", "99999"], "99999"),
            "--log-level": (["--log-level", "verbose"], "verbose"),
            "--dtype": (["--dtype", "fp64"], "fp64"),
            "--kv-cache-memory": (["--kv-cache-memory", "lots"], "lots"),
            "--max-step-slowdown": (["--max-step-slowdown", "0.5"], "max_step_slowdown"),
            "env": ([], "BATCHER_MAX_NUM_SEQS"),
            # Found only by trying to load it, and still one line.
            "--model": (["--model", str(tmp_path / "none.gguf")], "model path not found"),
        }
        # The admin port is checked before its key: --admin-port 0 is "off", so ask for a port.
        cases["admin key"] = (["--admin-port", str(int(port) + 1 if int(port) < 65535 else 1)],
                              "--admin-key")
        started = time.monotonic()
        procs = {name: _start("--port", "0", *flags,
                              env={"BATCHER_MAX_NUM_SEQS": "-3"} if name == "env" else None)
                 for name, (flags, _) in cases.items()}
        results = {name: _finish(p) for name, p in procs.items()}
    for name, (rc, out, err) in results.items():
        lines = err.strip().splitlines()
        assert rc == 2, (name, rc, err)
        assert len(lines) == 1 and lines[0].startswith("batcher serve: error: "), (name, err)
        assert cases[name][1] in lines[0], (name, lines[0])
        assert "loaded" not in out + err, (name, out, err)
    # No model was loaded: all of them together took far less than one load of the model
    # would, on a shared machine.
    assert time.monotonic() - started < TIMEOUT_S


@pytest.mark.slow
def test_debug_log_level_shows_the_traceback() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        rc, _, err = _finish(_start("--port", str(taken.getsockname()[1]),
                                    "--log-level", "debug"))
    assert rc == 2
    assert "Traceback" in err
    assert err.strip().splitlines()[-1].startswith("batcher serve: error: cannot listen on")


def test_preflight_binds_and_reads_keys() -> None:
    """The preflight binds the port (not yet listening, so clients are refused, not left
    waiting, while the model loads), turns --api-key into one tenant, and refuses a port a
    server already listens on."""
    import argparse

    from batcher.app.serve_flags import add_serve_args
    from batcher.app.serve_startup import StartupError, preflight

    p = argparse.ArgumentParser()
    add_serve_args(p)
    pre = preflight(p.parse_args(["--port", "0", "--api-key", "k1", "--api-key", "k2"]))
    try:
        assert pre.port > 0
        assert set(pre.tenants or {}) == {"default"}
        assert len(pre.tenants["default"].key_sha256) == 2
        with socket.socket() as client, pytest.raises(ConnectionRefusedError):
            client.connect(("127.0.0.1", pre.port))
        pre.sock.listen()
        with pytest.raises(StartupError, match="in use"):
            preflight(p.parse_args(["--port", str(pre.port)]))
    finally:
        pre.close()
    with pytest.raises(StartupError, match="exclusive"):
        preflight(p.parse_args(["--port", "0", "--api-key", "k", "--tenants", "t.toml"]))
