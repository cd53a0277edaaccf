"""The console's Mesh State decisions (pure): node states and coverage rows."""

from __future__ import annotations

import pytest

from gateway.mesh_board import coverage_row, inbound_rtts, node_state, stragglers


@pytest.mark.parametrize(("age", "heard", "spare", "quarantined", "expected"), [
    (0.5, True, False, False, "serving"),
    (0.5, False, False, False, "loading"),
    (0.5, True, True, False, "spare"),
    (3.0, True, False, False, "late"),
    (0.5, True, False, True, "quarantined"),
    (6.0, True, False, True, "lost"),
    (6.0, False, True, False, "lost"),
])
def test_node_state(age: float, heard: bool, spare: bool, quarantined: bool, expected: str) -> None:
    assert node_state(age, heard=heard, spare=spare, quarantined=quarantined, node_timeout=5.0) == expected


def test_fetching_and_straggler_states() -> None:
    assert node_state(0.5, heard=False, spare=True, quarantined=False, node_timeout=5.0, fetching=True) == "fetching"
    assert node_state(0.5, heard=True, spare=False, quarantined=False, node_timeout=5.0, straggler=True) == "straggler"
    assert node_state(3.0, heard=True, spare=False, quarantined=False, node_timeout=5.0, straggler=True) == "late"


def test_stragglers_are_slow_against_their_own_range() -> None:
    head, tail = ("r", 0, 15), ("r", 15, 30)
    speeds = {"a": (head, 100.0), "b": (head, 90.0), "c": (head, 30.0), "d": (tail, 10.0), "e": (head, 0.0)}
    assert stragglers(speeds) == {"c"}  # d has no peer to compare with; e is not measured yet


@pytest.mark.parametrize(("ranges", "target", "status", "gaps", "under"), [
    ([(0, 4), (4, 8)], 1, "covered", [], []),
    ([(0, 4), (6, 8)], 1, "gap", [(4, 6)], []),
    ([(0, 8), (0, 4)], 2, "under_provisioned", [], [(4, 8)]),
    ([(0, 3), (5, 8), (0, 8)], 2, "under_provisioned", [], [(3, 5)]),
    ([], 1, "gap", [(0, 8)], []),
])
def test_coverage_row(ranges, target, status, gaps, under) -> None:  # type: ignore[no-untyped-def]
    row = coverage_row("m", "rev", 8, ranges, target)
    assert (row.status, row.gaps, row.under_provisioned) == (status, gaps, under)
    assert len(row.replicas) == 8 and sum(row.replicas) == sum(min(e, 8) - s for s, e in ranges)


@pytest.mark.parametrize(("reports", "expected"), [
    ([], {}),
    ([{}], {}),
    ([{"t": 20.0}], {"t": 20.0}),
    ([{"t": 20.0, "m": 5.0}, {"t": 3.0}], {"t": 3.0, "m": 5.0}),  # a node's card shows its nearest sender's figure
    ([{"t": 3.0}, {"t": 20.0}], {"t": 3.0}),
])
def test_inbound_rtts_keep_each_nodes_smallest_measured_round_trip(reports, expected) -> None:  # type: ignore[no-untyped-def]
    assert inbound_rtts(reports) == expected


def _ann(node_id: str, start: int, end: int, **update: object):  # type: ignore[no-untyped-def]
    from schemas.capability import CapabilityReport, ShardRange
    from schemas.node import NodeAnnouncement

    cap = CapabilityReport(
        model_arch="llama", model_name="m", model_revision="rev1", runtime="llama.cpp",
        layers=ShardRange(start=start, end=end, n_layer=30), hidden_size=8, vocab_size=8,
        n_ctx=512, cache_abi="abi", cache_bytes_per_token=1)
    return NodeAnnouncement(node_id=node_id, activation_url="http://x", capability=cap,
                            started_at=1.0).model_copy(update=update)


def test_a_node_stopped_cleanly_shows_as_left_not_serving_then_lost() -> None:
    """`meshnet node` stopped with Ctrl-C announces it is leaving. The board took that for a
    fresh announcement: the node stayed `serving` (its range counted as covered), then turned
    `late` and red `lost` like a crash. It is `left` at once, out of coverage, and its last
    beats keep nothing alive."""
    from gateway.mesh_board import MeshBoard
    from schemas.node import NodeHeartbeat

    board = MeshBoard(node_timeout=5.0)
    board.on_announce(_ann("a", 0, 30), now=0.0)
    board.on_heartbeat(NodeHeartbeat(node_id="a", started_at=1.0), now=0.5)
    board.on_announce(_ann("a", 0, 30, leaving=True), now=1.0)
    board.on_heartbeat(NodeHeartbeat(node_id="a", started_at=1.0), now=1.2)
    state = board.state(queue_depth=0, active=0, max_sessions=1, sessions=[], now=1.5)
    assert [(c.node_id, c.state) for c in state.nodes] == [("a", "left")]
    assert state.coverage[0].status == "gap"
    board.on_announce(_ann("a", 0, 30, started_at=2.0), now=2.0)  # started again: a new process
    assert board.state(queue_depth=0, active=0, max_sessions=1, sessions=[], now=2.1).nodes[0].state == "loading"
