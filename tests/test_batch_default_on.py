"""The batch API is on at the defaults: `batcher serve` with no `--data-dir` keeps its files and
database in a directory named by its port under XDG_DATA_HOME (said in the start-up log), and
`--no-batch-api` turns the tier off. A real server process on 127.0.0.1, stopped by the test."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from openai import NotFoundError, OpenAI

from batcher.batch import service
from tests.server_process import serve

pytestmark = pytest.mark.slow


def _args(**kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    service.add_batch_serve_args(p)
    argv = []
    for k, v in kw.items():
        flag = "--" + k.replace("_", "-")
        argv += [flag] if v is True else [flag, str(v)]
    return p.parse_args(argv)


def test_default_data_dir_is_per_port_under_xdg(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    cfg = service.config_from_args(_args(), 8123)
    assert cfg is not None and cfg.data_dir == tmp_path / "batcher" / "port-8123"
    assert cfg.data_dir.is_dir()
    assert service.config_from_args(_args(no_batch_api=True), 8123) is None
    given = tmp_path / "mine"
    assert service.config_from_args(_args(data_dir=given), 8123).data_dir == given


def test_servers_on_one_port_number_take_sibling_directories(tmp_path, monkeypatch):
    """Servers sharing a filesystem and a port number (network namespaces, pods on one volume)
    each get a directory of their own; the port's own is taken again once free."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    first = service.config_from_args(_args(), 8000)
    second = service.config_from_args(_args(), 8000)
    assert first.data_dir.name == "port-8000" and second.data_dir.name == "port-8000.1"
    first.lock.close()  # the first server stopped
    third = service.config_from_args(_args(), 8000)
    assert third.data_dir.name == "port-8000"
    second.lock.close()
    third.lock.close()


def test_unwritable_default_turns_the_tier_off_but_a_given_dir_fails(tmp_path, monkeypatch,
                                                                     caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_DATA_HOME", str(blocker))  # a file: nothing can be made under it
    assert service.config_from_args(_args(), 8124) is None
    assert "no batch API" in caplog.text and "--data-dir" in caplog.text
    with pytest.raises(ValueError, match="--data-dir"):
        service.config_from_args(_args(data_dir=blocker / "x"), 8124)


def test_openai_files_create_works_against_a_default_server(tmp_path: Path):
    with serve("--model", "fake", env={"XDG_DATA_HOME": str(tmp_path)}) as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        line = (b'{"custom_id":"a","method":"POST","url":"/v1/completions",'
                b'"body":{"model":"fake","prompt":"hi","max_tokens":2}}\n')
        f = client.files.create(file=("in.jsonl", line), purpose="batch")
        assert f.bytes == len(line)
        data = tmp_path / "batcher" / f"port-{srv.port}"
        assert (data / "batches.sqlite3").exists()
        assert f"keeps its files and database in {data}" in srv.log()
    off = tmp_path / "off"
    with serve("--model", "fake", "--no-batch-api", env={"XDG_DATA_HOME": str(off)}) as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(NotFoundError):
            client.files.create(file=("in.jsonl", b"{}\n"), purpose="batch")
    assert not off.exists()
