"""batcher: an OpenAI-compatible LLM server, its fleet router, and the tools to size a fleet.

commands:
  serve   serve a model over HTTP          batcher serve --model smollm2-135m --port 8000
  bench   load-test a server               batcher bench --base-url http://127.0.0.1:8000
  fleet   N local replicas behind a router batcher fleet --replicas 2
  router  route over replicas anywhere     batcher router --replica http://10.0.0.5:8000
  balancer  balance over cells (routers)   batcher balancer --cell http://10.0.1.5:8000
  plan    replicas for a given load        batcher plan --help
  sim     simulate a fleet                 batcher sim run --help
  batch   run a batch input file offline   batcher batch --help
  diagnose  where a server's latency goes  batcher diagnose http://127.0.0.1:8000

Every flag may also come from the environment as BATCHER_<FLAG> (BATCHER_MAX_NUM_SEQS=32 for
--max-num-seqs 32), and `batcher serve --config FILE` reads a TOML file of flags; the command
line wins over both. `batcher COMMAND --help` lists a command's flags with their units.
"""

from __future__ import annotations

import argparse
import logging
import sys
import traceback
from typing import NoReturn

from batcher.telemetry.access_log import LOG_FORMATS
from batcher.telemetry.access_log import configure as configure_logging
from batcher.app.env import add_config_arg, apply_defaults
from batcher.app.serve_flags import add_serve_args
from batcher.http.listener import run_event_loop
from batcher.telemetry.tracing import configure as configure_tracing


class Parser(argparse.ArgumentParser):
    """Errors as one line, `batcher serve: error: ...`, exit status 2: the usage block would
    bury the one line that says what is wrong (`--help` still shows it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("batcher")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> tuple[Parser, dict[str, argparse.ArgumentParser]]:
    parser = Parser(prog="batcher", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    version = f"batcher {package_version()}"
    parser.add_argument("--version", action="version", version=version)
    # NOTE: the commands are listed once, in the description above (with an example each);
    # a `help=` per command would have argparse list them a second time.
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                help="one of the commands above")
    serve = sub.add_parser("serve")
    add_serve_args(serve)
    add_config_arg(serve)
    from batcher.bench.cli import add_bench_args
    from batcher.app.fleet_cli import add_fleet_args, add_router_args
    from batcher.sim.cli import add_plan_args, add_sim_args

    add_bench_args(sub.add_parser("bench"))
    add_fleet_args(sub.add_parser("fleet"))
    add_router_args(sub.add_parser("router"))
    from batcher.app.balancer_cli import add_balancer_args

    add_balancer_args(sub.add_parser("balancer"))
    add_plan_args(sub.add_parser("plan"))
    add_sim_args(sub.add_parser("sim"))
    from batcher.app.batch_run import add_batch_args

    add_batch_args(sub.add_parser("batch"))
    from batcher.app.diagnose import add_diagnose_args

    add_diagnose_args(sub.add_parser("diagnose"))
    for command in sub.choices.values():  # one meaning everywhere: print the version
        command.add_argument("--version", action="version", version=version)
    for name in ("serve", "router", "fleet"):
        sub.choices[name].add_argument(
            "--log-format", default="text", type=str.lower, choices=LOG_FORMATS,
            help="text for people, json for machines: one object per line, the access line's "
            "fields as keys (default: %(default)s)")
        sub.choices[name].add_argument(
            "--otlp-endpoint", default=None, help="send a trace span per request, with its "
            "phases, to this OTLP/HTTP endpoint (e.g. http://collector:4318/v1/traces; needs "
            "the otel extra; default: no traces)")
    return parser, dict(sub.choices)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser, commands = build_parser()
    _env_defaults(commands, argv)
    args = parser.parse_args(argv)
    configure_logging(getattr(args, "log_level", "info"), getattr(args, "log_format", "text"))
    try:
        configure_tracing(getattr(args, "otlp_endpoint", None), f"batcher-{args.command}")
    except ValueError as exc:
        print(f"batcher {args.command}: {exc}", file=sys.stderr)
        return 2
    if args.command == "serve":
        return _serve(args)
    if args.command == "bench":
        from batcher.bench.cli import run_bench

        return run_bench(args)
    if args.command in ("fleet", "router"):
        from batcher.app.fleet_cli import run_fleet, run_router

        return run_event_loop(run_fleet(args) if args.command == "fleet" else run_router(args))
    if args.command == "balancer":
        from batcher.app.balancer_cli import run_balancer

        return run_event_loop(run_balancer(args))
    if args.command == "plan":
        from batcher.sim.cli import run_plan

        return run_plan(args)
    if args.command == "sim":
        from batcher.sim.cli import run_sim

        return run_sim(args)
    if args.command == "diagnose":
        from batcher.app.diagnose import run_diagnose

        return run_diagnose(args)
    if args.command == "batch":
        from batcher.app.batch_run import run_offline

        return run_event_loop(run_offline(args))
    parser.error(f"unknown command {args.command}")
    return 2


def _env_defaults(commands: dict[str, argparse.ArgumentParser], argv: list[str]) -> None:
    """Environment and config-file defaults for the command named in `argv` and for each
    subcommand below it (`batcher sim run`)."""
    rest = argv
    while True:
        name = next((a for a in rest if a in commands), None)
        if name is None:
            return
        parser = commands[name]
        rest = rest[rest.index(name) + 1:]
        apply_defaults(parser, rest)
        nested = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not nested:
            return
        commands = dict(nested[0].choices)


def _serve(args: argparse.Namespace) -> int:
    """Run the server; a failure to start is one line and exit status 2 (the traceback too
    with --log-level debug)."""
    from batcher.app.serve import run_server
    from batcher.app.serve_startup import StartupError

    try:
        return run_event_loop(run_server(args))
    except KeyboardInterrupt:  # Ctrl-C before the server took over the signal (still starting)
        logging.getLogger("batcher.serve").info("received SIGINT while starting: exiting")
        return 130
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            raise
        failure: BaseException = exc
        message = str(exc.code)
    except StartupError as exc:
        failure, message = exc, str(exc)
    except Exception as exc:  # noqa: BLE001 - the model loader's errors, among others
        from batcher.models.errors import ModelLoadError

        failure = exc
        message = str(exc) if isinstance(exc, ModelLoadError) else f"{type(exc).__name__}: {exc}"
    if args.log_level == "debug":
        traceback.print_exception(failure)
    print(f"batcher serve: error: {message}", file=sys.stderr, flush=True)
    return 2


if __name__ == "__main__":
    sys.exit(main())
