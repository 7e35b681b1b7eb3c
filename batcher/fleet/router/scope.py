"""Whose request is this: the router's stand-in for the replicas' tenant.

The router holds no tenants file; it scopes client request IDs (cancel, dedupe, retry identity)
and prefix affinity by a digest of the credential the caller presented, so two callers never share
an ID space and an anonymous caller learns nothing about anyone's IDs. Two keys of one tenant are
two scopes here (the replica still scopes by tenant): stricter, never looser.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from batcher.http.keys import AuthError, Headers, bearer_token, single_header, to_bytes


def credential(headers: Headers | Mapping[str, str]) -> str:
    """The API key as the replica reads it (`Authorization: Bearer` first, then `x-api-key`);
    the raw header when it is malformed; "" when none. AuthError when a header is sent twice,
    or holds bytes that are not UTF-8 (no key is such, and they could not be passed on)."""
    auth = single_header(headers, "Authorization")
    api_key = single_header(headers, "x-api-key")
    for value in (auth, api_key):
        try:
            (value or "").encode("utf-8")
        except UnicodeEncodeError:
            raise AuthError("invalid API key") from None
    if auth is not None and auth.strip():
        token = bearer_token(auth)
        return token if token is not None else auth
    return api_key.strip() if api_key is not None else ""


def tenant_scope(headers: Headers | Mapping[str, str]) -> str:
    """A short, non-reversible digest of the caller's credential (never the key itself, so it
    may sit in maps and labels)."""
    return hashlib.blake2b(to_bytes(credential(headers)), digest_size=12).hexdigest()
