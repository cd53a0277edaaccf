"""Session-scoped activation credentials: who may send frames to one hop of a Route Session.

The scheme (threat model in docs/activation-protocol.md, "Credentials"):

- Every node holds a random 32-byte frame key K, made when the process starts, and gives it to
  the tracker on `meshkey.join.<node_id>` (outside `mesh.>`: no monitor and no other node can
  read it).
- For a Route Session the tracker derives, for each hop i, the credential
  C_i = HMAC-SHA256(K_i, "frame" | session | route | epoch | i | expiry), 128 bits. Whoever
  sends frames to hop i presents C_i in the `x-meshnet-credential` HTTP header; hop i
  recomputes it from its own key and the open directive, so the credential itself never
  travels to the hop that checks it.
- The gateway gets every C_i in its route reply (its private inbox). Hop i forwards to hop i+1,
  so the open directive (readable by monitors) carries C_{i+1} sealed for hop i:
  C_{i+1} XOR HMAC-SHA256(K_i, "seal" | session | route | epoch | i | expiry), a one-time pad
  that only K_i opens. What a monitor sees is useless for forging a frame.
- On a route of 3 or more hops the tail sends each decode token straight to the head over a
  Return Stream (docs/activation-protocol.md, "Direct return"), which the head opens with the
  tail's C_n-1: the directive carries it sealed for hop 0 with a pad of its own ("seal-return").
- A new epoch (a restart on a new route) or a new session gets new credentials; every
  credential expires at `expires_at` (unix seconds).

Pure functions; the keys are bytes, the credentials lower-case hex.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

CREDENTIAL_HEADER = "x-meshnet-credential"
KEY_BYTES = 32
CREDENTIAL_BYTES = 16
CREDENTIAL_TTL_S = 24 * 3600  # a Route Session's credentials last at most this long


def new_frame_key() -> bytes:
    """A node's frame key (once per process)."""
    return secrets.token_bytes(KEY_BYTES)


def _pad(key: bytes, purpose: str, session_id: str, route_id: str, epoch: int, hop_index: int,
         expires_at: int) -> bytes:
    scope = f"meshnet/{purpose}/v1\n{session_id}\n{route_id}\n{epoch}\n{hop_index}\n{expires_at}".encode()
    return hmac.new(key, scope, hashlib.sha256).digest()[:CREDENTIAL_BYTES]


def hop_credential(key: bytes, session_id: str, route_id: str, epoch: int, hop_index: int,
                   expires_at: int) -> str:
    """C_i: what a sender presents to hop `hop_index`, whose frame key is `key`."""
    return _pad(key, "frame", session_id, route_id, epoch, hop_index, expires_at).hex()


def seal(key: bytes, credential: str, session_id: str, route_id: str, epoch: int, hop_index: int,
         expires_at: int, purpose: str = "seal") -> str:
    """Another hop's credential, sealed for hop `hop_index` (whose frame key is `key`): the next
    hop's (`purpose` "seal"), or the tail's for the head's Return Stream ("seal-return"; each
    purpose its own pad, so no pad seals two credentials)."""
    pad = _pad(key, purpose, session_id, route_id, epoch, hop_index, expires_at)
    return bytes(a ^ b for a, b in zip(bytes.fromhex(credential), pad, strict=True)).hex()


def unseal(key: bytes, sealed: str, session_id: str, route_id: str, epoch: int, hop_index: int,
           expires_at: int, purpose: str = "seal") -> str:
    """What `seal` sealed for hop `hop_index` (XOR with the same pad); ValueError if malformed."""
    raw = bytes.fromhex(sealed)
    if len(raw) != CREDENTIAL_BYTES:
        raise ValueError(f"a sealed credential is {CREDENTIAL_BYTES} bytes")
    return seal(key, sealed, session_id, route_id, epoch, hop_index, expires_at, purpose)


def credential_matches(presented: str | None, expected: str) -> bool:
    """Constant-time comparison of a presented credential with the expected one."""
    if not presented or not expected:
        return False
    return hmac.compare_digest(presented.encode("ascii", "replace"), expected.encode())
