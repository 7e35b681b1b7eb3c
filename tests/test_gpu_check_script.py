"""scripts/gpu_check.sh without a GPU: the dry run lists every check and its target; the carried
bundled file keeps its metadata without tensors; carried wheels are picked by this Python's tags;
and one real check runs end to end on the CPU, its line and results written to $OUT."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str):
    """scripts/NAME.py as a module (a script, not part of the package), under its own name as
    running it as a file imports it."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod  # dataclasses look their module up there
        spec.loader.exec_module(mod)
    return sys.modules[name]


def _pack():
    """scripts/gpu_pack.py, which gpu_check imports."""
    return _load("gpu_pack")


def _script():
    """scripts/gpu_check.py (gpu_pack first: run as a file, it finds it beside itself)."""
    _pack()
    return _load("gpu_check")


def test_dry_run_lists_every_check_and_its_target() -> None:
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run"], cwd=ROOT, check=False,
                          capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHON=sys.executable))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for key in ("a", "b", "c", "d1", "d2", "e"):
        assert f"  ({key}) " in out
    assert out.count("target: ") == 6
    # The measured targets first; the tests last, with what is left of the budget.
    order = [out.index(f"  ({key}) ") for key in ("d1", "d2", "e", "b", "c", "a")]
    assert order == sorted(order)
    for fact in ("tests/gpu", "tests/test_triton_attention.py", "tests/test_mixed_graphs.py",
                 "64/64 answered", "1024/1024 answered", "Retry-After", "batch 32, context 512",
                 "llama-3.1-8b", "context 2048", "--load-format dummy", "bandwidth floor",
                 "transformers static batching"):
        assert fact in out, fact


def test_the_carried_bundled_file_keeps_its_metadata_without_tensors(tmp_path: Path) -> None:
    from batcher.bundled import smollm2_gguf_path
    from batcher.models.gguf_file import GGUFFile

    src = smollm2_gguf_path()
    dst = tmp_path / src.name
    _pack().gguf_header_only(src, dst)
    assert dst.stat().st_size < 4 * 2**20
    full, head = GGUFFile(src), GGUFFile(dst)
    assert full.tensors and not head.tensors
    assert list(head.fields) == list(full.fields)
    for key, value in full.fields.items():
        other = head.fields[key]
        if isinstance(value, np.ndarray):
            assert np.array_equal(value, other), key
        elif not isinstance(value, (int, float, str, bool)):
            assert len(value) == len(other), key  # a string array, stepped over
        else:
            assert value == other, key
    assert _script().gguf_tensor_count(dst) == 0 < _script().gguf_tensor_count(src)


def _wheel(folder: Path, name: str, tag: str, marker: str) -> None:
    with zipfile.ZipFile(folder / f"{name}-1.0-{tag}.whl", "w") as z:
        z.writestr(f"{name}/__init__.py", f"WHICH = {marker!r}\n")
        z.writestr(f"{name}-1.0.dist-info/METADATA", f"Name: {name}\nVersion: 1.0\n")


def test_carried_wheels_are_picked_by_this_pythons_tags(tmp_path: Path, monkeypatch) -> None:
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        pytest.skip("the fixtures' binary tags are for Linux on x86-64")
    mod = _script()
    here = f"cp{sys.version_info.major}{sys.version_info.minor}"
    other = "cp310" if here != "cp310" else "cp39"
    wheels = tmp_path / "carry" / "wheels"
    wheels.mkdir(parents=True)
    _wheel(wheels, "fastpkg", f"{other}-{other}-manylinux2014_x86_64", "other")
    _wheel(wheels, "fastpkg", f"{here}-{here}-manylinux2014_x86_64", "here")
    _wheel(wheels, "purepkg", "py3-none-any", "pure")
    _wheel(wheels, "onlyother", f"{other}-{other}-manylinux2014_x86_64", "other")
    monkeypatch.setattr(mod, "CARRY", tmp_path / "carry")
    site = tmp_path / "site"
    site.mkdir()
    installed = mod.install_wheels(site)
    assert installed == ["fastpkg", "purepkg"]
    assert "'here'" in (site / "fastpkg" / "__init__.py").read_text()
    assert (site / "purepkg" / "__init__.py").is_file() and not (site / "onlyother").exists()


@pytest.mark.slow
def test_a_check_runs_on_the_cpu_and_writes_its_results(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "scripts/gpu_check.py", "--device", "cpu", "--small",
                           "--only", "d1"], cwd=ROOT, check=False, capture_output=True,
                          text=True, timeout=600, env=dict(os.environ, OUT=str(out)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith(("PASS", "FAIL", "SKIP"))]
    assert line.startswith("PASS (d1) ") and "a step" in line and "the floor" in line
    assert "no ratio target yet" in line
    assert (out / "results.txt").read_text().splitlines()[0] == line
    (res,) = json.loads((out / "results.json").read_text())
    assert res["key"] == "d1" and res["status"] == "PASS"
    assert res["details"]["decode"][0]["batch"] == 4


def test_a_test_run_cut_short_says_how_far_it_got() -> None:
    figure = _script().tests_figure
    cut = ("tests/gpu/test_cuda_engine.py::test_graphs_equal_eager[tiny] PASSED  [ 10%]\n"
           "tests/gpu/test_cuda_engine.py::test_graphs_equal_eager[smollm2-135m] SKIPPED (no "
           "weights) [ 20%]\n"
           "tests/test_triton_prefill.py::test_chunks[64] FAILED  [ 30%]\n"
           "tests/test_triton_prefill.py::test_ids[a b] PASSED  [ 40%]\n"
           "tests/test_triton_prefill.py::test_chunks[128] ")
    assert figure(cut, None) == ("timed out after 2 passed, 1 failed, 1 skipped (failed: "
                                 "tests/test_triton_prefill.py::test_chunks[64]), in "
                                 "tests/test_triton_prefill.py::test_chunks[128]")
    done = ("tests/a.py::test_x PASSED\n"
            "SKIPPED [1] tests/gpu/conftest.py:20: the bundled weights were not carried\n"
            "================ 40 passed, 1 skipped in 61.20s (0:01:01) ================\n")
    assert figure(done, 0) == ("40 passed, 1 skipped in 61.20s (0:01:01); skipped: the "
                               "bundled weights were not carried")
    # No test ran at all (an import error at collection): the log's last lines say why.
    assert figure("ImportError: no module named x\n", 4) == (
        "exited 4 after no test done: ImportError: no module named x")


def _rehearsal_env(gc, tmp_path: Path):
    """A CPU rehearsal's `Env` with a minute to go, its logs in `tmp_path`."""
    import time

    return gc.Env(sys.executable, dict(os.environ), tmp_path, "cpu", True, False,
                  time.monotonic() + 60, tmp_path)


def test_a_check_that_raises_fails_alone_and_the_rest_still_run(tmp_path: Path,
                                                                 monkeypatch) -> None:
    gc = _script()
    ran = []

    def broken(c, e, big):
        ran.append(c.key)
        raise KeyError("decode")

    def chat(c, e):
        ran.append(c.key)
        c.status, c.figure = "PASS", "x2.0"

    monkeypatch.setattr(gc, "check_decode", broken)
    monkeypatch.setattr(gc, "check_chat", chat)
    env = _rehearsal_env(gc, tmp_path)
    todo = [c for c in gc.checks(True) if c.key in ("d1", "e")]
    assert gc.run_checks(todo, env, True, tmp_path) == 1
    assert ran == ["d1", "e"]
    lines = (tmp_path / "results.txt").read_text().splitlines()
    assert lines[0].startswith("FAIL (d1) ") and "the check itself failed: KeyError" in lines[0]
    assert lines[1].startswith("PASS (e) ") and lines[2].startswith("gpu_check: 1 of 2 passed")
    assert "KeyError" in (tmp_path / "check-d1.txt").read_text()
    assert [r["status"] for r in json.loads((tmp_path / "results.json").read_text())] == \
        ["FAIL", "PASS"]


def test_the_device_tests_need_only_what_the_check_carries() -> None:
    """The GPU machine has torch, transformers and triton; the check carries the packages in
    `gpu_pack.WHEELS` and nothing else (no pytest-asyncio: a test there is a plain function)."""
    import ast

    # Each carried distribution's import names (most are the same).
    modules = {"attrs": ["attr", "attrs"], "pytest": ["pytest", "_pytest"]}
    carried = {m for w in _pack().WHEELS for m in modules.get(w, [w.replace("-", "_")])}
    present = {"torch", "transformers", "triton", "numpy", "packaging", "batcher", "tests",
               "scripts"}
    files = [f for t in _script().TESTS for f in ((ROOT / t).rglob("*.py") if (ROOT / t).is_dir()
                                                   else [ROOT / t])] + [ROOT / "tests/conftest.py"]
    collected = set(files)  # the files pytest runs there; the rest are only imported
    seen: set[Path] = set()
    while files:
        path = files.pop()
        if path in seen:
            continue
        seen.add(path)
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.AsyncFunctionDef) and path in collected:
                # An async test or fixture needs pytest-asyncio.
                fixture = any("fixture" in ast.unparse(d) for d in node.decorator_list)
                assert not (node.name.startswith("test") or fixture), \
                    f"{path.name}: {node.name} is async"
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0
                     else [])
            for name in names:
                top = name.split(".")[0]
                assert top in sys.stdlib_module_names or top in carried | present, \
                    f"{path.relative_to(ROOT)} imports {name}"
                if top == "tests":  # a helper module: its imports run too
                    helper = ROOT / (name.replace(".", "/") + ".py")
                    files += [helper] if helper.is_file() else []
    assert len(seen) >= 10


def test_a_fault_in_one_half_of_the_serving_check_is_charged_to_that_half(
        tmp_path: Path, monkeypatch) -> None:
    """(b) and (c) share a server: chat64's own code raising fails (b) alone, the burst still
    runs, and the server is stopped."""
    gc = _script()
    started = []
    real_popen = subprocess.Popen

    def server(cmd, **kw):  # a stand-in for `batcher serve`, ready at once
        started.append(real_popen(["sleep", "30"], **kw))
        return started[-1]

    def chat64(b, e, start, extra, what):
        raise KeyError("summary")

    def burst(c, e, what):
        c.status, c.figure = "PASS", "48/48 answered"

    monkeypatch.setattr(gc.subprocess, "Popen", server)
    monkeypatch.setattr(gc, "get", lambda url: 200)
    monkeypatch.setattr(gc, "serve_chat64", chat64)
    monkeypatch.setattr(gc, "serve_burst", burst)
    env = _rehearsal_env(gc, tmp_path)
    todo = [c for c in gc.checks(True) if c.key in ("b", "c")]
    assert gc.run_checks(todo, env, True, tmp_path) == 1
    b, c = todo
    assert b.status == "FAIL" and "the check itself failed: KeyError" in b.figure
    assert c.status == "PASS" and c.figure == "48/48 answered"
    assert "KeyError" in (tmp_path / "check-b.txt").read_text()
    assert started and started[0].poll() is not None  # the server was stopped
