"""Artifact inventory: which node seeds which pieces of which artifact (plain data, no I/O).

Fed by `mesh.artifact.<id>.have.<node>` messages and bad-piece reports; read by fetchers through
`mesh.tracker.artifact.peers`. An entry not refreshed within `ttl_s` is dropped (a seeder
re-announces every few seconds), and so is every entry of a node the registry lost. A peer
reported for bad pieces is listed after the clean ones, with its count, so fetchers try it last.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from schemas.artifacts import ArtifactHave, BadPieceReport, PeersReply, SeedPeer

DEFAULT_TTL_S = 30.0
MAX_BAD = 1024  # bad pieces remembered per (artifact, peer)


@dataclass(slots=True)
class _Entry:
    have: ArtifactHave
    seen_at: float


@dataclass(slots=True)
class ArtifactInventory:
    ttl_s: float = DEFAULT_TTL_S
    _by_artifact: dict[str, dict[str, _Entry]] = field(default_factory=lambda: defaultdict(dict))
    _bad: dict[tuple[str, str], set[str]] = field(default_factory=lambda: defaultdict(set))  # (aid, peer) -> piece ids

    def update(self, have: ArtifactHave, now: float) -> None:
        self._by_artifact[have.artifact_id][have.node_id] = _Entry(have, now)

    def report_bad(self, report: BadPieceReport) -> int:
        """Record a bad piece from a peer the inventory lists for that artifact (others are
        ignored: 0); how many distinct bad pieces that peer has sent (at most MAX_BAD kept)."""
        if report.peer_node_id not in self._by_artifact.get(report.artifact_id, {}):
            return 0
        bad = self._bad[(report.artifact_id, report.peer_node_id)]
        if len(bad) < MAX_BAD:
            bad.add(report.piece_id)
        return len(bad)

    def forget_node(self, node_id: str) -> None:
        for entries in self._by_artifact.values():
            entries.pop(node_id, None)
        for key in [k for k in self._bad if k[1] == node_id]:
            del self._bad[key]

    def expire(self, now: float) -> list[tuple[str, str]]:
        """Drop entries older than ttl_s; the (artifact, node) pairs dropped."""
        gone = []
        for aid, entries in self._by_artifact.items():
            for node_id in [n for n, e in entries.items() if now - e.seen_at > self.ttl_s]:
                del entries[node_id]
                gone.append((aid, node_id))
        return gone

    def bad_count(self, artifact_id: str, node_id: str) -> int:
        return len(self._bad.get((artifact_id, node_id), ()))

    def peers(self, artifact_id: str, *, exclude: str = "", now: float | None = None) -> PeersReply:
        """The live seeders of an artifact, clean ones first, then by pieces held (most first)."""
        entries = self._by_artifact.get(artifact_id, {})
        live = [e for n, e in entries.items() if n != exclude and (now is None or now - e.seen_at <= self.ttl_s)]
        peers = [SeedPeer(node_id=e.have.node_id, seed_url=e.have.seed_url, have=e.have.have,
                          complete=e.have.complete, bad_pieces=self.bad_count(artifact_id, e.have.node_id))
                 for e in live]
        peers.sort(key=lambda p: (p.bad_pieces, -_held_hint(entries[p.node_id].have), p.node_id))
        n = max((e.have.n_pieces for e in live), default=0)
        return PeersReply(artifact_id=artifact_id, n_pieces=n, peers=peers)

    def artifacts(self) -> dict[str, int]:
        """Artifact id -> number of live seeders."""
        return {aid: len(e) for aid, e in self._by_artifact.items() if e}


def _held_hint(have: ArtifactHave) -> int:
    return have.held_bytes
