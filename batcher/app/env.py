"""Flags from the environment and from a config file, for deployments that set neither a
command line nor its quoting: `--max-num-seqs 32` may also be `BATCHER_MAX_NUM_SEQS=32` or
`max-num-seqs = 32` in the TOML file given to `--config`.

Precedence, highest first: the command line, `BATCHER_<FLAG>`, `--config FILE`, the built-in
default. A value from the environment or the file goes through the flag's own type and choices,
so a bad one is refused at startup like a bad flag.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from collections.abc import Mapping
from typing import Any

ENV_PREFIX = "BATCHER_"
TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off", "")


def env_name(option: str) -> str:
    """`--max-num-seqs` -> `BATCHER_MAX_NUM_SEQS`."""
    return ENV_PREFIX + option.lstrip("-").replace("-", "_").upper()


def _long_option(action: argparse.Action) -> str | None:
    longs = [o for o in action.option_strings if o.startswith("--")]
    return longs[0] if longs else None


def _settable(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.Action]]:
    skip = (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)
    out = []
    for action in parser._actions:
        option = _long_option(action)
        if option and not isinstance(action, skip) and action.dest != "config":
            out.append((option, action))
    return out


def _convert(parser: argparse.ArgumentParser, option: str, action: argparse.Action, raw: Any,
             where: str) -> Any:
    """`raw` (text from the environment, any TOML value from the file) as the flag's value."""
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        if isinstance(raw, bool):
            flag = raw
        elif str(raw).strip().lower() in TRUE:
            flag = True
        elif str(raw).strip().lower() in FALSE:
            flag = False
        else:
            parser.error(f"{where}: {option} takes true or false, got {raw!r}")
        return flag if isinstance(action, argparse._StoreTrueAction) else not flag
    if isinstance(action, argparse._AppendAction):
        items = raw if isinstance(raw, list) else [s for s in str(raw).split(",") if s.strip()]
        return [_one(parser, option, action, item, where) for item in items]
    if isinstance(raw, list):
        parser.error(f"{where}: {option} takes one value, got a list")
    return _one(parser, option, action, raw, where)


def _one(parser: argparse.ArgumentParser, option: str, action: argparse.Action, raw: Any,
         where: str) -> Any:
    text = str(raw).strip()
    try:
        value = action.type(text) if callable(action.type) else text
    except (argparse.ArgumentTypeError, TypeError, ValueError) as exc:
        parser.error(f"{where}: {option}: {exc}")
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(repr, action.choices))
        parser.error(f"{where}: {option}: invalid choice {value!r} (choose from {choices})")
    return value


def read_config(parser: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        parser.error(f"--config {path}: {exc.strerror or exc}")
    except tomllib.TOMLDecodeError as exc:
        parser.error(f"--config {path}: invalid TOML: {exc}")
    return {}


def apply_defaults(parser: argparse.ArgumentParser, argv: list[str],
                   environ: Mapping[str, str] | None = None) -> None:
    """Set `parser`'s defaults from `--config FILE` (found in `argv`) and then `BATCHER_<FLAG>`,
    so that the command line, parsed afterwards, still wins."""
    environ = os.environ if environ is None else environ
    settable = _settable(parser)
    by_key = {option.lstrip("-"): (option, action) for option, action in settable}
    defaults: dict[str, Any] = {}
    config_path = _config_path(argv) or environ.get(env_name("--config"))
    if config_path:
        for key, raw in read_config(parser, config_path).items():
            hit = by_key.get(key.replace("_", "-"))
            if hit is None:
                parser.error(f"--config {config_path}: unknown setting {key!r}")
            option, action = hit
            defaults[action.dest] = _convert(parser, option, action, raw,
                                             f"--config {config_path}")
    for option, action in settable:
        name = env_name(option)
        if name in environ:
            defaults[action.dest] = _convert(parser, option, action, environ[name], name)
    parser.set_defaults(**defaults)


def _config_path(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def add_config_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", default=None,
                        help="TOML file of settings, one per flag without its dashes "
                        "(max-num-seqs = 32); the command line and BATCHER_<FLAG> "
                        "environment variables override it (default: none)")
