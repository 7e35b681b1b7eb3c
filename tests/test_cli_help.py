"""`--help` says what a flag does, its unit and its default, in a line or two: no help text of
any command runs past a short paragraph or carries benchmark results (machine names, measured
ratios), which belong in BENCHMARKS.md and docs/."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator

from batcher.app.cli import build_parser

MAX_HELP_CHARS = 300
# Benchmark reports name the machine they ran on, or quote a ratio as x0.99 or 3-6x.
MACHINE = re.compile(r"\b(EPYC|Xeon|Ryzen|Graviton|H100|H200|A100|A10G|L4|T4|AVX2 machine)\b")
RATIO = re.compile(r"\bx\d+(\.\d+)?\b|\b\d+(\.\d+)?x\b")


def _helps(parser: argparse.ArgumentParser, path: str) -> Iterator[tuple[str, str]]:
    """(where, expanded help text) for every option and positional of `parser` and of every
    command nested under it."""
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                yield f"{path} {choice.dest}", choice.help or ""
            for name, sub in action.choices.items():
                yield from _helps(sub, f"{path} {name}")
            continue
        if action.help in (None, argparse.SUPPRESS):
            continue
        flag = "/".join(action.option_strings) or action.dest
        yield f"{path} {flag}", formatter._expand_help(action)


def all_helps() -> list[tuple[str, str]]:
    parser, _ = build_parser()
    return list(_helps(parser, "batcher"))


def test_every_command_is_walked() -> None:
    wheres = {where for where, _ in all_helps()}
    _, commands = build_parser()
    assert {where.split()[1] for where in wheres if len(where.split()) > 2} == set(commands)
    for expected in ("batcher serve --quantization", "batcher fleet --retry-ratio",
                     "batcher balancer --retry-ratio", "batcher bench --retries",
                     "batcher sim run --retry-ratio", "batcher batch run input"):
        assert expected in wheres, expected


def test_help_is_short_and_free_of_benchmark_results() -> None:
    too_long = [f"{where}: {len(text)} characters" for where, text in all_helps()
                if len(text) > MAX_HELP_CHARS]
    assert not too_long, ("keep help to what the flag does, its unit and default; "
                          f"measurements belong in BENCHMARKS.md: {too_long}")
    machines = [f"{where}: {text}" for where, text in all_helps() if MACHINE.search(text)]
    assert not machines, machines
    ratios = [f"{where}: {text}" for where, text in all_helps() if RATIO.search(text)]
    assert not ratios, ratios
