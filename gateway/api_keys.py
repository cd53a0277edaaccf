"""Gateway API keys: `Authorization: Bearer KEY` on the client API, as the OpenAI API asks.

    --api-key KEY (repeatable), MESHNET_API_KEYS (comma-separated) and --api-key-file PATH
    (one key per line; keys there and in the environment stay out of `ps`) -> settings.api_keys
    no key configured       -> the gateway is open (meant for loopback; `meshnet up` says so)
    /v1/* without a valid key -> 401, OpenAI error body (code invalid_api_key), WWW-Authenticate
    /healthz (/health, /v1/health) -> always open (load balancers and `meshnet up` poll it)
    / and /console/*         -> always open: the console's static files, no data (it asks for the key)
    /metrics                 -> behind the key unless --metrics-public

Keys are compared in constant time against every configured key, so a wrong key takes as
long as a right one whatever it shares with them.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
from collections.abc import Awaitable, Callable, Iterable, Sequence

from aiohttp import web

from gateway.errors import ApiError

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

API_KEYS_ENV = "MESHNET_API_KEYS"
OPEN_PATHS = frozenset({"/healthz", "/health", "/v1/health", "/"})
OPEN_PREFIX = "/console/"  # the console's static files


class AuthenticationError(ApiError):
    """401: no key or a key the gateway does not know (the OpenAI SDK's AuthenticationError)."""

    status = 401
    type = "invalid_request_error"

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": 'Bearer realm="meshnet"'}


def keys_from(flags: Iterable[str] | None, env: str | None = None) -> tuple[str, ...]:
    """The configured keys (pure): the --api-key flags, then the comma-separated environment
    value; blanks are dropped, order kept, duplicates once."""
    raw = [*(flags or ()), *((env or "").split(","))]
    return tuple(dict.fromkeys(k.strip() for k in raw if k.strip()))


def keys_from_env(flags: Iterable[str] | None, file_keys: Iterable[str] = ()) -> tuple[str, ...]:
    """keys_from with the keys of --api-key-file (`key_file_arg`) after the flags, and
    MESHNET_API_KEYS read from the environment."""
    return keys_from([*(flags or ()), *file_keys], os.environ.get(API_KEYS_ENV))


def key_problem(key: str) -> str | None:
    """Why `key` (stripped) cannot be an API key, or None (pure). A comma is refused because
    MESHNET_API_KEYS, through which `meshnet up` hands the keys to its gateway, separates keys
    with commas: `abc,def` would become the two keys `abc` and `def`."""
    if not key:
        return "an API key cannot be blank"
    if "," in key:
        return "an API key cannot contain a comma (MESHNET_API_KEYS separates keys with commas)"
    return None


def key_arg(value: str) -> str:
    """argparse type of --api-key: the key, stripped; a usage error when `key_problem` finds
    one (`--api-key "$KEY"` with KEY unset must not start a gateway without any key)."""
    key = value.strip()
    problem = key_problem(key)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return key


def key_file_lines(text: str) -> tuple[str, ...]:
    """The keys of a key file's text (pure): one a line, stripped; blank lines and lines
    starting with `#` skipped."""
    return tuple(k for line in text.splitlines() if (k := line.strip()) and not k.startswith("#"))


def key_file_arg(path: str) -> tuple[str, ...]:
    """argparse type of --api-key-file: its keys, or a usage error when it cannot be read or
    holds none (a gateway told to take its keys from a file must never start open because the
    file was missing, truncated or all comments)."""
    try:
        with open(path, encoding="utf-8") as f:
            keys = key_file_lines(f.read())
    except (OSError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read the key file {path!r}: {exc}") from None
    if not keys:
        raise argparse.ArgumentTypeError(f"the key file {path!r} holds no key (one per line; # starts a comment)")
    for n, key in enumerate(keys, 1):
        if problem := key_problem(key):
            raise argparse.ArgumentTypeError(f"key {n} of the key file {path!r}: {problem}")
    return keys


def bearer_key(authorization: str | None) -> str | None:
    """The key of an `Authorization: Bearer KEY` header (pure); None when absent or another scheme."""
    if not authorization:
        return None
    scheme, _, key = authorization.strip().partition(" ")
    key = key.strip()
    return key if scheme.lower() == "bearer" and key else None


def key_owner(authorization: str | None) -> str | None:
    """Who a request belongs to, for per-key fairness (pure): a short digest of its Bearer key
    (never the key itself, which must not reach metrics or logs), None without one."""
    key = bearer_key(authorization)
    if key is None:
        return None
    return "key-" + hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:16]


def key_is_valid(key: str | None, keys: Sequence[str]) -> bool:
    """Whether `key` is one of `keys`, in time independent of where they differ (pure)."""
    if key is None:
        return False
    # a header byte that is no UTF-8 arrives as a lone surrogate: compared as its byte, never an error
    given = key.encode("utf-8", "surrogateescape")
    ok = False
    for k in keys:
        ok |= hmac.compare_digest(given, k.encode("utf-8", "surrogateescape"))
    return ok


def needs_key(path: str, metrics_public: bool) -> bool:
    """Whether a request for `path` must carry a key (pure), when the gateway has keys."""
    if path in OPEN_PATHS or path.startswith(OPEN_PREFIX):
        return False
    if path == "/metrics":
        return not metrics_public
    return True


def check_request(authorization: str | None, keys: Sequence[str]) -> AuthenticationError | None:
    """The 401 for this Authorization header, or None when it carries a valid key (pure)."""
    key = bearer_key(authorization)
    if key is None:
        return AuthenticationError(
            "You didn't provide an API key. Send it as 'Authorization: Bearer KEY' "
            "(the OpenAI SDK's api_key).", code="missing_api_key")
    if not key_is_valid(key, keys):
        return AuthenticationError("Incorrect API key provided.", code="invalid_api_key")
    return None


def api_key_middleware(keys: Sequence[str], *, metrics_public: bool):
    """An aiohttp middleware that refuses requests without a valid key (see the module doc)."""
    configured = tuple(keys)

    @web.middleware
    async def require_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if needs_key(request.path, metrics_public):
            err = check_request(request.headers.get("Authorization"), configured)
            if err is not None:
                return web.json_response(err.body(), status=err.status, headers=err.headers())
        return await handler(request)

    return require_key
