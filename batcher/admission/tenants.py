"""Tenants: who may call, with which key hashes, budgets and priority classes.

A tenants file (TOML) lists, per tenant, the SHA-256 of each API key (never the key itself), a token
budget and limits:

    [tenants.acme]
    keys_sha256 = ["<64 hex digits>"]      # python -m batcher.server.auth KEY prints this
    tokens_per_minute = 60000               # refill rate of the token bucket
    burst = 20000                           # bucket capacity in tokens (default: tokens_per_minute)
    max_concurrent = 16                     # requests in flight at once
    priorities = ["interactive", "batch"]   # allowed classes (default: both)

Every problem in the file raises `ValueError` naming the tenant and the field. Tenants are callers
of the public API only: operator routes (drain, per-replica status) take the admin key on the
admin listener, never a tenant key. This module is a low
layer: admission and the HTTP layers read it; it imports nothing from `batcher`.
"""

from __future__ import annotations

import hashlib
import math
import re
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Priority classes, most urgent first (the order error messages list them in).
PRIORITY_NAMES = ("interactive", "batch")
PRIORITIES = frozenset(PRIORITY_NAMES)

_HEX64 = re.compile(r"[0-9a-f]{64}")
# Tenant names become metric labels and log fields: keep them plain.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_FIELDS = frozenset(
    {"keys_sha256", "tokens_per_minute", "burst", "max_concurrent", "priorities"}
)


def hash_key(key: str) -> str:
    """Lowercase hex SHA-256 of the UTF-8 bytes of `key`: the form stored in the tenants file."""
    # surrogatepass: a header can decode to lone surrogates; such a key must hash, not raise.
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(frozen=True, slots=True, kw_only=True)
class TenantConfig:
    """One tenant's identity and limits; validated on construction (`ValueError`).

    `tokens_per_minute = math.inf` means an unlimited budget: no bucket and `burst` defaults to the
    largest int. `burst = 0` (the default) means `tokens_per_minute`, rounded down.
    """

    name: str
    # repr=False: a logged hash of a weak key invites an offline guess.
    key_sha256: tuple[str, ...] = field(default=(), repr=False)
    tokens_per_minute: float
    burst: int = 0
    max_concurrent: int
    priorities: frozenset[str] = PRIORITIES

    def __post_init__(self) -> None:
        def bad(fld: str, why: str) -> ValueError:
            return ValueError(f"tenant {self.name!r}: {fld} {why}")

        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise bad("name", "must be 1-64 letters, digits, '_', '.' or '-'")
        for h in self.key_sha256:
            if not isinstance(h, str) or not _HEX64.fullmatch(h):
                raise bad("keys_sha256", "entries must be 64 lowercase hex digits (SHA-256)")
        tpm = self.tokens_per_minute
        if isinstance(tpm, bool) or not isinstance(tpm, int | float) or not tpm > 0:
            raise bad("tokens_per_minute", f"must be a number > 0, got {tpm!r}")
        if self.burst == 0:
            # Frozen dataclass: the default is resolved once, here.
            default = sys.maxsize if math.isinf(tpm) else int(tpm)
            object.__setattr__(self, "burst", default)
        if isinstance(self.burst, bool) or not isinstance(self.burst, int) or self.burst < 1:
            raise bad("burst", f"must be an integer >= 1, got {self.burst!r}")
        mc = self.max_concurrent
        if isinstance(mc, bool) or not isinstance(mc, int) or mc < 1:
            raise bad("max_concurrent", f"must be an integer >= 1, got {mc!r}")
        if not self.priorities or not self.priorities <= PRIORITIES:
            raise bad("priorities", f"must be a non-empty subset of {sorted(PRIORITIES)}")

    @property
    def unlimited(self) -> bool:
        """No token budget, hence no bucket (the auth-off default tenant, or an `inf` rate)."""
        return math.isinf(self.tokens_per_minute)


# Auth off: the one caller, with an unlimited budget.
DEFAULT_TENANT = TenantConfig(
    name="default", tokens_per_minute=math.inf, max_concurrent=sys.maxsize
)


def _tenant_from_toml(name: str, raw: Any) -> TenantConfig:
    where = f"tenant {name!r}"
    if not isinstance(raw, dict):
        # ValueError, not TypeError: every problem in the file is a ValueError by contract.
        raise ValueError(f"{where}: must be a table ([tenants.{name}])")  # noqa: TRY004
    if "admin" in raw:
        raise ValueError(f"{where}: 'admin' is not a tenant field; operator routes take the admin "
                         f"key (--admin-key) on the admin listener")
    unknown = sorted(set(raw) - _FIELDS)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; allowed: {sorted(_FIELDS)}")
    for required in ("keys_sha256", "tokens_per_minute", "max_concurrent"):
        if required not in raw:
            raise ValueError(f"{where}: {required} is required")
    keys = raw["keys_sha256"]
    if not isinstance(keys, list) or not keys:
        raise ValueError(f"{where}: keys_sha256 must be a non-empty list of SHA-256 hex strings")
    prios = raw.get("priorities", sorted(PRIORITIES))
    if not isinstance(prios, list) or not all(isinstance(p, str) for p in prios):
        raise ValueError(f"{where}: priorities must be a list of strings")
    burst = raw.get("burst", 0)
    if burst == 0 and "burst" in raw:
        raise ValueError(f"{where}: burst must be an integer >= 1, got {burst!r}")
    return TenantConfig(
        name=name,
        # Accept uppercase hex from other tools; compare in one canonical form.
        key_sha256=tuple(k.lower() if isinstance(k, str) else k for k in keys),
        tokens_per_minute=raw["tokens_per_minute"],
        burst=burst,
        max_concurrent=raw["max_concurrent"],
        priorities=frozenset(prios),
    )


def load_tenants(path: str | Path) -> dict[str, TenantConfig]:
    """Read a tenants TOML file. Raises `ValueError` (tenant and field named) on any problem,
    including an empty file (auth off is spelled by passing no file, never by an empty one) and a
    key hash listed twice (a key must identify exactly one tenant)."""
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"tenants file {str(path)!r}: invalid TOML: {e}") from None
    extra = sorted(set(doc) - {"tenants"})
    if extra:
        raise ValueError(f"tenants file: unknown top-level key(s) {extra}; expected [tenants.NAME]")
    table = doc.get("tenants")
    if not isinstance(table, dict) or not table:
        raise ValueError("tenants file: no [tenants.NAME] tables; omit the file to turn auth off")
    tenants: dict[str, TenantConfig] = {}
    owner: dict[str, str] = {}
    for name, raw in table.items():
        cfg = _tenant_from_toml(name, raw)
        for h in cfg.key_sha256:
            if h in owner:
                raise ValueError(
                    f"tenant {name!r}: keys_sha256 repeats a hash already listed for "
                    f"tenant {owner[h]!r}"
                )
            owner[h] = name
        tenants[name] = cfg
    return tenants
