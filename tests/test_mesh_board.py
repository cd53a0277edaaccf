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
