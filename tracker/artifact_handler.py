"""ArtifactHandler: a tracker's part in the Shard Swarm. It keeps who seeds which pieces
(tracker/inventory.py) from `have` reports and answers who to fetch an artifact from."""

from __future__ import annotations

import logging

from schemas.artifacts import ArtifactHave, BadPieceReport, PeersReply, PeersRequest
from tracker.awake import AwakeClock
from tracker.inventory import ArtifactInventory

log = logging.getLogger("meshnet.tracker")


class ArtifactHandler:
    def __init__(self, inventory: ArtifactInventory, clock: AwakeClock) -> None:
        self.inventory = inventory
        self.clock = clock

    async def on_have(self, msg: ArtifactHave) -> None:
        self.inventory.update(msg, self.clock())

    async def on_bad_piece(self, msg: BadPieceReport) -> None:
        n = self.inventory.report_bad(msg)
        log.warning("artifact %s: %s reports a bad piece %s from %s (%s); %d bad from that peer",
                    msg.artifact_id[:12], msg.node_id, msg.piece_id[:16], msg.peer_node_id, msg.reason, n)

    def handle_peers_request(self, req: PeersRequest) -> PeersReply:
        """Who seeds an artifact (the asker left out; peers reported bad listed last)."""
        return self.inventory.peers(req.artifact_id, exclude=req.node_id, now=self.clock())
