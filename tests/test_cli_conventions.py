"""CLI conventions: `batcher --version`, flags from BATCHER_<FLAG> and `--config FILE` (the
command line wins), `--version` meaning the version everywhere, help text on every flag, test-only
flags hidden, and `--api-key` on a real server with the bundled model."""

from __future__ import annotations

import argparse
from pathlib import Path

import aiohttp
import pytest

from batcher.app.cli import _env_defaults, build_parser, main, package_version
from tests.server_process import serve


def parse(argv: list[str], environ: dict[str, str] | None = None,
          monkeypatch: pytest.MonkeyPatch | None = None) -> argparse.Namespace:
    parser, commands = build_parser()
    if monkeypatch is not None:
        for key in [k for k in __import__("os").environ if k.startswith("BATCHER_")]:
            monkeypatch.delenv(key)
        for key, value in (environ or {}).items():
            monkeypatch.setenv(key, value)
    _env_defaults(commands, argv)
    return parser.parse_args(argv)


@pytest.mark.parametrize("argv", [[], ["serve"], ["fleet"], ["router"], ["bench"],
                                  ["diagnose"], ["plan"]])
def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str],
                                            argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"batcher {package_version()}"
    assert package_version() != "unknown"


def test_help_lists_each_command_once(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    _, commands = build_parser()
    for name in commands:
        listed = [line for line in text.splitlines() if line.split()[:1] == [name]]
        assert len(listed) == 1, (name, listed)


def test_command_line_over_environment_over_config(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "serve.toml"
    config.write_text('max-num-seqs = 8\nblock_size = 32\ndtype = "float32"\n'
                      'no-prefix-caching = true\napi-key = ["a", "b"]\n')
    args = parse(["serve", "--config", str(config)], {}, monkeypatch)
    assert (args.max_num_seqs, args.block_size, args.dtype) == (8, 32, "float32")
    assert args.no_prefix_caching and args.api_key == ["a", "b"]
    env = {"BATCHER_MAX_NUM_SEQS": "16", "BATCHER_NO_PREFIX_CACHING": "false",
           "BATCHER_API_KEY": "k1,k2", "BATCHER_LOG_LEVEL": "DEBUG"}
    args = parse(["serve", "--config", str(config)], env, monkeypatch)
    assert (args.max_num_seqs, args.block_size, args.no_prefix_caching) == (16, 32, False)
    assert args.api_key == ["k1", "k2"] and args.log_level == "debug"
    args = parse(["serve", "--config", str(config), "--max-num-seqs", "32"], env, monkeypatch)
    assert args.max_num_seqs == 32
    # Nested commands read the environment too.
    args = parse(["sim", "run"], {"BATCHER_REPLICAS": "7"}, monkeypatch)
    assert args.replicas == 7


@pytest.mark.parametrize(("environ", "config", "message"), [
    ({"BATCHER_MAX_NUM_SEQS": "0"}, None, "BATCHER_MAX_NUM_SEQS: --max-num-seqs: must be >= 1"),
    ({"BATCHER_DTYPE": "fp64"}, None, "invalid choice 'fp64'"),
    ({"BATCHER_NO_CUDA_GRAPHS": "maybe"}, None, "takes true or false"),
    ({}, "max-num-seq = 3\n", "unknown setting 'max-num-seq'"),
    ({}, "max-num-seqs = [\n", "invalid TOML"),
])
def test_bad_environment_or_config_is_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        environ: dict[str, str], config: str | None, message: str) -> None:
    argv = ["serve"]
    if config is not None:
        (tmp_path / "c.toml").write_text(config)
        argv += ["--config", str(tmp_path / "c.toml")]
    with pytest.raises(SystemExit) as exit_:
        parse(argv, environ, monkeypatch)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("batcher serve: error: "), err
    assert message in err[0]


def test_deployment_version_has_one_spelling(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    assert parse(["serve", "--deployment-version", "v2"], {}, monkeypatch).version == "v2"
    assert parse(["serve"], {"BATCHER_DEPLOYMENT_VERSION": "v4"}, monkeypatch).version == "v4"
    assert capsys.readouterr().err == ""


def test_every_flag_has_help_and_test_flags_are_hidden() -> None:
    _, commands = build_parser()
    serve_parser = commands["serve"]
    text = serve_parser.format_help()
    assert "--fake-fault" not in text
    for action in serve_parser._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, f"{action.option_strings} has no help text"
            assert action.help == argparse.SUPPRESS or len(action.help) > 15, action.dest
    overview = build_parser()[0].format_help()
    assert "BATCHER_<FLAG>" in overview and "batcher serve --model" in overview


@pytest.mark.slow
async def test_api_key_from_the_environment_on_the_bundled_model() -> None:
    """The default model, default settings, one key from BATCHER_API_KEY: no key is a 401 in
    OpenAI's error shape, the key completes; a deadline 504 and a 400 carry
    `x-should-retry: false`."""
    with serve("--model", "smollm2-135m", num_blocks=None, ready_timeout=120,
               env={"BATCHER_API_KEY": "s3cret"}) as server:
        body = {"model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 4}
        async with aiohttp.ClientSession() as http:
            async with http.post(server.url + "/v1/completions", json=body) as resp:
                assert resp.status == 401
                error = (await resp.json())["error"]
                assert set(error) >= {"message", "type", "param", "code"}
            async with http.post(server.url + "/v1/completions", json=body,
                                 headers={"Authorization": "Bearer s3cret"}) as resp:
                assert resp.status == 200, await resp.text()
                assert (await resp.json())["usage"]["completion_tokens"] >= 1
            # What a retry cannot fix says so, for OpenAI's SDKs: the request's own deadline
            # and a bad request.
            auth = {"Authorization": "Bearer s3cret"}
            late = {**body, "max_tokens": 200, "timeout": 0.001}
            async with http.post(server.url + "/v1/completions", json=late,
                                 headers=auth) as resp:
                assert resp.status == 504, await resp.text()
                assert resp.headers["x-should-retry"] == "false"
            async with http.post(server.url + "/v1/completions", json={**body, "max_tokens": -1},
                                 headers=auth) as resp:
                assert resp.status == 400
                assert resp.headers["x-should-retry"] == "false"


def test_retry_and_health_flags_mean_the_same_everywhere() -> None:
    """router, fleet and balancer share one set of retry and health flags with the router's
    configured defaults (docs/capacity.md: 10% of the last 10 s of requests, a floor of 3), and
    `sim run` the same retry budget, where `none` is no budget."""
    from batcher.fleet.router.context import RouterConfig
    from batcher.fleet.router.health import HealthConfig

    r, h = RouterConfig(), HealthConfig()
    expected = {"max_attempts": r.max_attempts, "retry_ratio": r.retry_ratio,
                "retry_floor": r.retry_floor, "retry_window": r.retry_window,
                "health_interval": h.interval, "liveness_timeout": h.liveness_timeout,
                "probe_interval": h.probe_interval, "probe_deadline": h.probe_deadline,
                "evict_after": h.evict_after, "readmit_after": h.readmit_after}
    assert (r.retry_ratio, r.retry_floor, r.retry_window) == (0.1, 3, 10.0)
    _, commands = build_parser()
    for name, argv in (("router", []), ("fleet", []), ("balancer", ["--cell", "http://c:1"])):
        args = commands[name].parse_args(argv)
        assert {k: getattr(args, k) for k in expected} == expected, name
    sim = commands["sim"]
    args = sim.parse_args(["run"])
    assert (args.retry_ratio, args.retry_floor, args.retry_window) == (0.1, 3, 10.0)
    assert sim.parse_args(["run", "--retry-ratio", "none"]).retry_ratio is None
