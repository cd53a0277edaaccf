"""Frame credentials (schemas/credentials.py, tracker/credentials.py): bound to session, route,
epoch, hop and expiry; sealed next-hop credentials open only with that hop's key."""

from __future__ import annotations

import pytest

from nodes.server.admission import check_credential
from schemas.credentials import credential_matches, hop_credential, new_frame_key, seal, unseal
from schemas.route import Hop, RouteSession
from tracker.credentials import grant_credentials

SCOPE = ("s1", "r1", 1, 0, 2_000_000_000)


def test_a_credential_is_bound_to_every_part_of_its_scope() -> None:
    key = new_frame_key()
    base = hop_credential(key, *SCOPE)
    assert base == hop_credential(key, *SCOPE) and len(base) == 32
    others = [("s2", "r1", 1, 0, 2_000_000_000), ("s1", "r2", 1, 0, 2_000_000_000),
              ("s1", "r1", 2, 0, 2_000_000_000), ("s1", "r1", 1, 1, 2_000_000_000),
              ("s1", "r1", 1, 0, 2_000_000_001)]
    assert all(hop_credential(key, *o) != base for o in others)
    assert hop_credential(new_frame_key(), *SCOPE) != base  # another node's key


def test_a_sealed_credential_opens_only_with_its_hops_key_and_scope() -> None:
    k0, k1 = new_frame_key(), new_frame_key()
    c1 = hop_credential(k1, "s1", "r1", 1, 1, 2_000_000_000)
    sealed = seal(k0, c1, *SCOPE)
    assert sealed != c1
    assert unseal(k0, sealed, *SCOPE) == c1
    assert unseal(k1, sealed, *SCOPE) != c1  # the wrong key
    assert unseal(k0, sealed, "s1", "r1", 2, 0, 2_000_000_000) != c1  # the wrong epoch
    with pytest.raises(ValueError):
        unseal(k0, "abcd", *SCOPE)


def test_grant_seals_each_next_credential_and_keeps_credentials_out_of_the_session() -> None:
    keys = {n: new_frame_key() for n in ("a", "b", "c")}
    hops = [Hop(node_id=n, activation_url="http://x", layer_start=i * 10, layer_end=i * 10 + 10)
            for i, n in enumerate(keys)]
    session = RouteSession(session_id="s1", route_id="r1", epoch=3, model="m", model_revision="v",
                           cache_abi="c", n_layer=30, hidden_size=8, n_ctx=64, hops=hops)
    granted, creds = grant_credentials(session, keys, 2_000_000_000)
    assert granted.expires_at == 2_000_000_000 and len(creds) == 3
    for i, hop in enumerate(granted.hops):
        assert creds[i] == hop_credential(keys[hop.node_id], "s1", "r1", 3, i, 2_000_000_000)
        if i + 1 < 3:
            assert unseal(keys[hop.node_id], hop.sealed_next, "s1", "r1", 3, i, 2_000_000_000) == creds[i + 1]
        else:
            assert hop.sealed_next == ""
    # 3 hops: the head opens the tail's Return Stream with the tail's credential, sealed with a pad
    # of its own purpose (the same pad sealing two credentials would give their XOR away)
    head = granted.hops[0]
    assert unseal(keys["a"], head.sealed_return, "s1", "r1", 3, 0, 2_000_000_000, purpose="seal-return") == creds[2]
    assert unseal(keys["a"], head.sealed_return, "s1", "r1", 3, 0, 2_000_000_000) != creds[2]
    assert not any(h.sealed_return for h in granted.hops[1:])
    two, _ = grant_credentials(session.model_copy(update={"hops": hops[:2]}), keys, 2_000_000_000)
    assert not any(h.sealed_return for h in two.hops)  # 2 hops: the tail answers the head anyway
    dumped = granted.model_dump_json()
    assert not any(c in dumped for c in creds)
    assert granted.grant(creds).credentials == creds and not any(c in granted.model_dump_json() for c in creds)


def test_check_credential() -> None:
    good = "ab" * 16
    assert check_credential(good, 100, good, 99.0) is None
    for presented in (None, "", "ab" * 15, "cd" * 16, "é" * 32):
        err = check_credential(good, 100, presented, 99.0)
        assert err is not None and err.code == "bad_credential" and err.status == 401
    expired = check_credential(good, 100, good, 130.0)
    assert expired is not None and "expired" in expired.message and "30 s ago by this node's clock" in expired.message
    assert not credential_matches(None, good) and not credential_matches(good, "")
