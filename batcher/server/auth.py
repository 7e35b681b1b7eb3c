"""API-key authentication: map a presented key to its tenant (see `batcher.admission.tenants`).

Contracts:
- `Authenticator.authenticate` hashes the presented key once and compares it with every stored hash
  through `hmac.compare_digest`, without stopping at a match, so the time taken does not reveal
  which tenant (or how many) a key belongs to.
- Keys are never logged and never appear in an error message.
- No tenants configured: auth is off; every caller is `DEFAULT_TENANT`, with an unlimited budget.
"""

from __future__ import annotations

import hmac
import sys
from dataclasses import dataclass, field

from batcher.http.keys import AuthError, Headers, bearer_token, single_header
from batcher.admission.tenants import DEFAULT_TENANT, TenantConfig, hash_key

__all__ = ["AuthError", "Authenticator", "hash_key", "main"]


@dataclass(slots=True)
class Authenticator:
    """Maps a presented API key to its tenant. `tenants=None` (or empty) turns auth off."""

    tenants: dict[str, TenantConfig] | None
    _table: list[tuple[bytes, TenantConfig]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._table = [
            (h.encode("ascii"), cfg)
            for cfg in (self.tenants or {}).values()
            for h in cfg.key_sha256
        ]

    @property
    def enabled(self) -> bool:
        return bool(self.tenants)

    def authenticate(
        self, authorization: str | None, api_key: str | None = None
    ) -> TenantConfig:
        """The tenant of the caller. `authorization` is the `Authorization` header (`Bearer <key>`,
        scheme case-insensitive); `api_key` the `x-api-key` header, used when `authorization` is
        absent. Raises `AuthError` saying whether the key was missing, malformed or invalid."""
        if not self.enabled:
            return DEFAULT_TENANT
        if authorization is not None and authorization.strip():
            key = bearer_token(authorization)
            if key is None:
                raise AuthError("malformed Authorization header; expected 'Bearer <api key>'")
        elif api_key is not None and api_key.strip():
            key = api_key.strip()
        else:
            raise AuthError("missing API key; send 'Authorization: Bearer <api key>'")
        presented = hash_key(key).encode("ascii")
        found: TenantConfig | None = None
        for stored, cfg in self._table:
            # NOTE: no break; every stored hash is compared so timing is independent of the match.
            if hmac.compare_digest(presented, stored):
                found = cfg
        if found is None:
            raise AuthError("invalid API key")
        return found

    def authenticate_headers(self, headers: Headers) -> TenantConfig:
        """`authenticate` on a request's headers; either header sent twice is an `AuthError`."""
        if not self.enabled:
            return DEFAULT_TENANT
        return self.authenticate(single_header(headers, "Authorization"),
                                 single_header(headers, "x-api-key"))


def main(argv: list[str] | None = None) -> int:
    """`python -m batcher.server.auth KEY` prints the SHA-256 to put in a tenants file.
    `-` reads the key from stdin, which keeps it out of shell history."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] in ("-h", "--help"):
        print("usage: python -m batcher.server.auth KEY   (or '-' to read KEY from stdin)",
              file=sys.stderr)
        return 2
    key = sys.stdin.readline().rstrip("\r\n") if args[0] == "-" else args[0]
    if not key:
        print("error: empty key", file=sys.stderr)
        return 2
    print(hash_key(key))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
