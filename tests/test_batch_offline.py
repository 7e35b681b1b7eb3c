"""`batcher batch run FILE.jsonl`: the engine in-process, no server; OpenAI's batch output format
in input order, a progress line, and an exit status that says whether every line succeeded."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

ROOT = Path(__file__).resolve().parent.parent


def run(tmp: Path, items: list[Any] | bytes, *flags: str, timeout: float = 120
        ) -> tuple[int, str, list[dict[str, Any]]]:
    src = tmp / "in.jsonl"
    src.write_bytes(items if isinstance(items, bytes)
                    else b"".join(orjson.dumps(x) + b"\n" for x in items))
    proc = subprocess.run([sys.executable, "-m", "batcher.app.cli", "batch", "run", str(src),
                           "--embedding-model", "none", *flags], check=False, cwd=ROOT,
                          capture_output=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)
    out = tmp / "in.output.jsonl"
    lines = [orjson.loads(x) for x in out.read_bytes().splitlines()] if out.exists() else []
    return proc.returncode, proc.stderr.decode(), lines


def completion(cid: str, model: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions",
            "body": {"model": model, "prompt": f"Item {cid}:", **body}}


@pytest.mark.slow
def test_real_model_offline_run(tmp_path: Path) -> None:
    """The bundled model at its defaults: chat and completion lines in one file."""
    items: list[Any] = [completion(f"c{i}", "smollm2-135m", max_tokens=8) for i in range(3)]
    items.append({"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": "smollm2-135m", "max_tokens": 8, "temperature": 0,
                           "messages": [{"role": "user", "content": "What is 2+2?"}]}})
    rc, err, out = run(tmp_path, items, timeout=180)
    assert rc == 0, err
    assert [x["custom_id"] for x in out] == ["c0", "c1", "c2", "chat"]
    for x in out:
        assert x["error"] is None and x["response"]["status_code"] == 200
        assert x["id"].startswith("batch_req_")
        body = x["response"]["body"]
        assert 0 < body["usage"]["completion_tokens"] <= 8
    assert out[3]["response"]["body"]["choices"][0]["message"]["content"].strip()
    assert "4/4 (0 failed)" in err and "wrote" in err


def test_failed_lines_are_answered_and_set_the_exit_status(tmp_path: Path) -> None:
    items = [completion("ok", "tiny", max_tokens=3, ignore_eos=True),
             completion("too-long", "tiny", max_tokens=1 << 19)]
    rc, err, out = run(tmp_path, items, "--model", "tiny")
    assert rc == 1, err
    ok, bad = out
    assert ok["response"]["status_code"] == 200
    assert ok["response"]["body"]["usage"]["completion_tokens"] == 3
    assert bad["custom_id"] == "too-long" and bad["response"]["status_code"] == 400
    assert bad["response"]["body"]["error"]["code"] == "context_length_exceeded"
    assert "1 succeeded, 1 failed" in err


def test_an_invalid_file_runs_nothing(tmp_path: Path) -> None:
    rc, err, out = run(tmp_path, b'{"custom_id": "a"}\nnot json\n', "--model", "tiny")
    assert rc == 2 and out == []
    assert "line 1: 'url' must be one of" in err and "line 2: the line is not valid JSON" in err
