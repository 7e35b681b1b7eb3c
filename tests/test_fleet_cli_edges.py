"""`batcher fleet`'s start-up edges: replica ports from `--replica-base-port` (else free ports),
and "fleet of N replicas ready" said once every replica takes work, not when the processes
start."""

from __future__ import annotations

import asyncio

from batcher.engine.snapshot import EngineSnapshot
from batcher.app.fleet_cli import announce_ready
from batcher.fleet.launcher import replica_specs
from batcher.fleet.router.registry import Registry


def test_replica_ports_follow_the_base_port() -> None:
    specs = replica_specs(3, [], ["http://127.0.0.1:9"], base_port=21000)
    assert [s.url for s in specs] == [f"http://127.0.0.1:{p}" for p in (21000, 21002, 21004)]
    assert [s.admin_url for s in specs] == [f"http://127.0.0.1:{p}"
                                            for p in (21001, 21003, 21005)]
    assert specs[1].argv[specs[1].argv.index("--port") + 1] == "21002"
    free = replica_specs(2, [], [])
    assert len({s.url for s in free} | {s.admin_url for s in free}) == 4


async def test_the_fleet_is_announced_once_every_replica_takes_work(capsys) -> None:
    registry = Registry()
    reps = [registry.add_static(f"http://127.0.0.1:{p}") for p in (21000, 21002)]
    announce = asyncio.create_task(announce_ready(registry, 2, "http://x:8000", interval=0.01))
    up = EngineSnapshot(free_blocks=8, total_blocks=8, block_size=16, running=0, waiting=0,
                        version="v1")
    reps[0].state = up
    await asyncio.sleep(0.05)
    assert not announce.done() and "ready" not in capsys.readouterr().out
    reps[1].state = up  # the second replica has loaded and beaten
    await asyncio.wait_for(announce, 2)
    assert capsys.readouterr().out == "batcher: fleet of 2 replicas ready behind http://x:8000\n"
