"""Batch API objects (and stored responses) behind a router: which replica holds a file, batch or
response, and merged lists.

The router hands out ids that name their replica: `<replica's id>.<owner>`, where `<owner>` is
the replica id in unpadded URL-safe base64 (`file-3f...e1.cjA` for a file on replica `r0`).
Later calls on that id go to that replica, found in the router's registry by id: an id never
carries an address, so a forged owner can name only a replica the router already routes to, and
that replica still answers only for the caller's own tenant (another tenant's id is a 404 there).
Nothing is kept at the router, so it stays soft state: a restarted router, or several side by
side, route the same ids the same way. Stored responses take the same ids (`resp_<hex>.<owner>`,
`responses_proxy.py`), with their own fields (`RESPONSE_ID_FIELDS`).

Lists are a k-way merge of every replica's page for the tenant, newest first (files may ask
oldest first), ties in the same second ordered by replica id (so one order is exactly the other
reversed). A page continues after the object
its `after` names: on that object's replica with the replica's own `after`, on every other
replica with a creation-time bound (`created_before` / `created_since`) that puts it on the right
side of the cursor.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Fields of file and batch objects that hold ids, rewritten on the way out (and in).
ID_FIELDS = ("id", "input_file_id", "output_file_id", "error_file_id")
RESPONSE_ID_FIELDS = ("id", "previous_response_id")
MAX_ID_CHARS = 512
# A replica's own ids (`file-<hex>`, `batch_<hex>`, `file-<hex>-output`): only these characters,
# so an id the router forwards is one path segment on the replica, never `..` or a query.
_INNER = re.compile(r"[A-Za-z0-9_-]+")


def encode(inner: str, owner: str) -> str:
    """The router's id for object `inner` held by replica `owner`."""
    tag = base64.urlsafe_b64encode(owner.encode()).decode().rstrip("=")
    return f"{inner}.{tag}"


def decode(router_id: str) -> tuple[str, str] | None:
    """(replica's id, owner replica id), or None when `router_id` is not one the router made."""
    if not router_id or len(router_id) > MAX_ID_CHARS:
        return None
    inner, dot, tag = router_id.rpartition(".")
    if not dot or not tag or not _INNER.fullmatch(inner):
        return None
    try:
        owner = base64.urlsafe_b64decode(tag + "=" * (-len(tag) % 4)).decode()
    except (binascii.Error, ValueError):
        return None
    if not owner or encode(inner, owner) != router_id:  # one spelling per id
        return None
    return inner, owner


def outward(obj: Any, owner: str, fields: tuple[str, ...] = ID_FIELDS) -> Any:
    """A replica's file or batch object (or response, with RESPONSE_ID_FIELDS) with its ids
    rewritten to the router's."""
    if isinstance(obj, dict):
        for key in fields:
            if isinstance(obj.get(key), str):
                obj[key] = encode(obj[key], owner)
    return obj


@dataclass(frozen=True, slots=True)
class Cursor:
    """Where a page continues: after object `inner` on replica `owner`, created at `created`
    (Unix seconds, as the object reports it)."""

    inner: str
    owner: str
    created: int


def page_query(cursor: Cursor | None, replica: str, ascending: bool) -> dict[str, str]:
    """The query that asks `replica` for its objects that come after `cursor` in the merged
    order: (creation second, replica id, the replica's own order)."""
    if cursor is None:
        return {}
    if replica == cursor.owner:
        return {"after": cursor.inner}
    # Same second: newest first puts lower replica ids first, oldest first the reverse (each
    # order is exactly the other reversed).
    later = replica < cursor.owner if ascending else replica > cursor.owner
    if ascending:
        return {"created_since": str(cursor.created if later else cursor.created + 1)}
    return {"created_before": str(cursor.created + 1 if later else cursor.created)}


def merge(pages: Mapping[str, tuple[list[dict[str, Any]], bool]], limit: int,
          ascending: bool) -> dict[str, Any]:
    """One OpenAI list page from each replica's page (`data` with router ids already, and
    `has_more`), keyed by replica id."""
    keyed = []
    for owner, (items, _) in pages.items():
        for pos, item in enumerate(items):
            created = item.get("created_at")
            created = int(created) if isinstance(created, int | float) else 0
            keyed.append((created, owner, pos, item))
    # Stable sorts, least significant key first: each replica's own order, then replica id,
    # then the creation second.
    keyed.sort(key=lambda k: k[2])
    keyed.sort(key=lambda k: k[1], reverse=ascending)
    keyed.sort(key=lambda k: k[0], reverse=not ascending)
    data = [k[3] for k in keyed[:limit]]
    more = len(keyed) > limit or any(more for _, more in pages.values())
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}
