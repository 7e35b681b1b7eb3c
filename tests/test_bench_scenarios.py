"""The benchmark runner (`python -m scripts.bench`): it lists every scenario with its one line,
each scenario answers `--help` under the runner's name, none edits `sys.path`, and a row's
command line is the one that runs it again. (What a scenario measures is its BENCHMARKS.md row,
never a test.)"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.bench.__main__ import scenarios, summary

ROOT = Path(__file__).resolve().parent.parent
NAMES = list(scenarios())


def test_the_runner_lists_every_scenario_with_one_line() -> None:
    proc = subprocess.run([sys.executable, "-m", "scripts.bench"], cwd=ROOT, check=False,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert {"gpu", "router", "peers", "attacks"} <= set(NAMES)
    for name, path in scenarios().items():
        line = summary(path)
        assert line and len(line) <= 100, (name, line)
        assert f"  {name} " in proc.stdout and line in proc.stdout, name
    assert not any(n.startswith(("_", "bench_")) for n in NAMES)


def test_an_unknown_scenario_is_refused_with_the_list() -> None:
    proc = subprocess.run([sys.executable, "-m", "scripts.bench", "nope"], cwd=ROOT,
                          check=False, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown scenario 'nope'" in proc.stderr
    assert "  router " in proc.stderr


@pytest.mark.parametrize("name", [n for n in NAMES if scenarios()[n].suffix == ".py"])
def test_each_scenario_answers_help_under_the_runners_name(name: str, capsys) -> None:
    module = importlib.import_module(f"scripts.bench.{name}")
    with pytest.raises(SystemExit) as exit_:
        module.main(["--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m scripts.bench {name} ")


def test_the_shell_scenario_answers_help() -> None:
    proc = subprocess.run([sys.executable, "-m", "scripts.bench", "peers", "--help"], cwd=ROOT,
                          check=False, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "python -m scripts.bench peers" in proc.stdout


def test_no_scenario_edits_the_import_path() -> None:
    for path in sorted((ROOT / "scripts" / "bench").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "path":
                assert getattr(node.value, "id", None) != "sys", f"{path.name}: sys.path"


def test_a_rows_command_line_runs_the_scenario_again(monkeypatch) -> None:
    from batcher.bench.common import command_line
    from scripts.bench._shared import command

    runner = str(ROOT / "scripts" / "bench" / "__main__.py")  # sys.argv[0] under `python -m`
    monkeypatch.setattr(sys, "argv", [runner, "router", "--requests", "10"])
    assert command_line() == "python -m scripts.bench router --requests 10"
    assert command("scripts.bench.long_prompts", "--base", "DIR") == \
        "python -m scripts.bench long_prompts --base DIR"
