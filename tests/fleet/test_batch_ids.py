"""The router's batch-API bookkeeping without processes: ids that name their replica (and only a
registered one), merged list pages against a brute-force order, and where uploads go (headroom,
or the batch pool)."""

from __future__ import annotations

import random

import pytest

from batcher.engine.snapshot import EngineSnapshot
from batcher.fleet.router import batch_ids
from batcher.fleet.router.batch_replicas import BatchProxy
from batcher.fleet.router.context import RouterConfig, RouterContext


@pytest.mark.parametrize("owner", ["r0", "127.0.0.1:8001", "replica.with.dots", "ü-id"])
def test_ids_round_trip(owner: str) -> None:
    for inner in ("file-0a1b", "batch_0a1b", "file-0a1b-output"):
        rid = batch_ids.encode(inner, owner)
        assert batch_ids.decode(rid) == (inner, owner)
        assert rid.startswith(inner.split("-")[0].split("_")[0])


@pytest.mark.parametrize("bad", ["", "file-abc", "file-abc.", ".cjA", "file-abc.!!",
                                 "file-abc.cjA=", "file-abc.cjA.", "x" * 600 + ".cjA",
                                 # encode("..", "r0") and friends: the replica part is never a
                                 # path of its own on the replica
                                 "...cjA", "..cjA", "a/b.cjA", "x?y.cjA", "x\n.cjA"])
def test_malformed_ids_name_no_replica(bad: str) -> None:
    assert batch_ids.decode(bad) is None


def _objects(rng: random.Random, owners: list[str]) -> dict[str, list[dict]]:
    """Per replica, objects newest first as a replica lists them (many in the same second)."""
    out: dict[str, list[dict]] = {o: [] for o in owners}
    t = 1000
    for i in range(40):
        t += rng.choice((0, 0, 1))
        o = rng.choice(owners)
        out[o].append({"id": batch_ids.encode(f"file-{i:03d}", o), "created_at": t})
    return {o: list(reversed(v)) for o, v in out.items()}


def _replica_page(objs: list[dict], query: dict[str, str], limit: int, asc: bool
                  ) -> tuple[list[dict], bool]:
    """What a replica answers: its own order, `after` one of its ids, creation bounds."""
    items = list(reversed(objs)) if asc else list(objs)
    if "after" in query:
        ids = [batch_ids.decode(x["id"])[0] for x in items]
        items = items[ids.index(query["after"]) + 1:]
    if "created_before" in query:
        items = [x for x in items if x["created_at"] < int(query["created_before"])]
    if "created_since" in query:
        items = [x for x in items if x["created_at"] >= int(query["created_since"])]
    return items[:limit], len(items) > limit


@pytest.mark.parametrize("asc", [False, True])
@pytest.mark.parametrize("limit", [1, 3, 7])
def test_merged_pages_walk_every_object_once_in_order(asc: bool, limit: int) -> None:
    rng = random.Random(limit)
    owners = ["r0", "r1", "r2"]
    objs = _objects(rng, owners)
    walked: list[dict] = []
    cursor = None
    for _ in range(100):
        pages = {o: _replica_page(objs[o], batch_ids.page_query(cursor, o, asc), limit, asc)
                 for o in owners}
        page = batch_ids.merge(pages, limit, asc)
        walked += page["data"]
        if not page["has_more"]:
            break
        last = page["data"][-1]
        inner, owner = batch_ids.decode(last["id"])
        cursor = batch_ids.Cursor(inner, owner, last["created_at"])
    everything = [x for v in objs.values() for x in v]
    assert len(walked) == len(everything) == len({x["id"] for x in walked})
    times = [x["created_at"] for x in walked]
    assert times == sorted(times, reverse=not asc)
    if asc:  # one order is exactly the other reversed
        desc = batch_ids.merge({o: (objs[o], False) for o in owners}, 100, False)["data"]
        assert [x["id"] for x in walked] == [x["id"] for x in reversed(desc)]


def _ctx(pool: tuple[str, ...] = ()) -> RouterContext:
    ctx = RouterContext(RouterConfig(batch_pool=pool), rng=random.Random(0))
    for rid, free, waiting in (("a", 900, 0), ("b", 100, 0), ("c", 1000, 3)):
        rep = ctx.registry.add_static(f"http://{rid}:1", rid)
        rep.state = EngineSnapshot(free_blocks=free, total_blocks=1000, block_size=16,
                                   running=1, waiting=waiting, version="v1")
    return ctx


def test_uploads_go_to_the_most_headroom_or_the_pool() -> None:
    assert [r.replica_id for r in BatchProxy(_ctx()).upload_order()] == ["a", "b", "c"]
    assert [r.replica_id for r in BatchProxy(_ctx(("c", "b"))).upload_order()] == ["b", "c"]
    ctx = _ctx(("b",))
    ctx.registry.get("b").evicted = True  # a pool replica that is down takes nothing
    assert BatchProxy(ctx).upload_order() == []


def test_fleet_replicas_get_their_own_batch_directories() -> None:
    from batcher.app.fleet_cli import _own_batch_dirs
    from batcher.fleet.launcher import replica_specs

    specs = replica_specs(2, ["--data-dir", "/srv/batch", "--batch-db", "/db/b.sqlite3"], [])
    _own_batch_dirs(specs)
    for s in specs:
        assert s.argv[s.argv.index("--data-dir") + 1] == f"/srv/batch/{s.replica_id}"
        assert s.argv[s.argv.index("--batch-db") + 1] == f"/db/b-{s.replica_id}.sqlite3"
    plain = replica_specs(1, ["--max-num-seqs", "8"], [])
    _own_batch_dirs(plain)
    assert "--data-dir" not in plain[0].argv
