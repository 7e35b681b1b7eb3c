"""Credentials in request headers, checked in constant time and never raising on odd input.

A header value arrives as `str`; bytes that are not UTF-8 arrive as lone surrogates. Every
comparison here encodes with `surrogatepass`, which accepts any `str`, so such a value compares
unequal instead of raising (a 500). The scheme `Bearer` is case-insensitive (RFC 9110). A header
sent twice is refused: two proxies could each read a different copy.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from typing import Protocol


class AuthError(Exception):
    """The caller is not authenticated (HTTP 401). The message never contains the key."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class Headers(Protocol):
    """What a key check reads from a request's headers (aiohttp's `CIMultiDictProxy` fits)."""

    def getall(self, key: str, default: list[str] = ...) -> list[str]: ...


def to_bytes(value: str) -> bytes:
    """UTF-8 bytes of any `str`, lone surrogates included."""
    return value.encode("utf-8", "surrogatepass")


def single_header(headers: Headers | Mapping[str, str], name: str) -> str | None:
    """The one value of header `name`, None when absent; `AuthError` when it is sent twice."""
    values = headers.getall(name, []) if hasattr(headers, "getall") else (
        [headers[name]] if name in headers else [])
    if len(values) > 1:
        raise AuthError(f"send the {name} header once")
    return values[0] if values else None


def bearer_token(authorization: str) -> str | None:
    """The credential of `Bearer <token>` (scheme in any case, spaces around ignored); None when
    the value is not of that form."""
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


def same_secret(presented: str, expected: str) -> bool:
    """Constant-time equality of two secrets given as `str`; never raises."""
    return hmac.compare_digest(to_bytes(presented), to_bytes(expected))


def bearer_matches(headers: Headers | Mapping[str, str], expected_key: str) -> bool:
    """True when the request carries exactly one `Authorization: Bearer <expected_key>`.

    An empty `expected_key` matches nothing: a listener without a key must be left unchecked
    by its caller, never opened by an empty header."""
    try:
        value = single_header(headers, "Authorization")
    except AuthError:
        return False
    token = bearer_token(value) if value is not None else None
    # Compare even when the header is missing or malformed, so the time taken says nothing.
    ok = same_secret(token if token is not None else "", expected_key)
    return ok and token is not None and bool(expected_key)


# The header a router sends its fleet key in to the replicas it forwards to (their
# `Authorization` carries the tenant's key): a replica tells its router from a tenant by it.
FLEET_KEY_HEADER = "X-Fleet-Key"
# The tenant a replica resolved a request's key to, on its answers to the fleet: the router logs
# the request under the same name (it holds no tenants file, only the key's digest).
TENANT_HEADER = "X-Batcher-Tenant"
# Routes a replica and a router serve without an API key: liveness, readiness, capacity, metrics;
# the probe checks its own.
OPEN_PATHS = frozenset({"/health", "/ready", "/v1/state", "/metrics", "/v1/probe"})


def header_matches(headers: Headers | Mapping[str, str], name: str, expected_key: str) -> bool:
    """True when the request carries header `name` exactly once, equal to `expected_key`
    (compared in constant time). An empty `expected_key` matches nothing."""
    try:
        value = single_header(headers, name)
    except AuthError:
        return False
    ok = same_secret(value if value is not None else "", expected_key)
    return ok and value is not None and bool(expected_key)
