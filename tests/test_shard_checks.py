"""The backend-independent checks every frame passes before model execution (table-driven)."""

from __future__ import annotations

import numpy as np
import pytest

from nodes.engine import (
    CacheFullError,
    InputShapeError,
    LayerRangeError,
    PositionMismatchError,
    SessionExistsError,
    UnknownSessionError,
)
from nodes.shard_checks import SlotTable, check_forward, check_layer_range
from schemas.capability import ShardRange

HEAD = ShardRange(start=0, end=2, n_layer=4)
MID = ShardRange(start=2, end=3, n_layer=4)
W = 8
ROWS = np.ones((3, W), dtype=np.float32)


def _state(position: int = 0):
    table = SlotTable(2)
    state = table.open("s", None)
    state.position = position
    return state


@pytest.mark.parametrize(
    "layers,position,token_ids,hidden,error",
    [
        (HEAD, 0, np.array([1, 2], np.int32), None, None),
        (HEAD, 0, np.array([1, 2], np.int64), None, None),
        (HEAD, 1, np.array([1], np.int32), None, PositionMismatchError),
        (HEAD, 0, None, ROWS, InputShapeError),
        (HEAD, 0, np.array([], np.int32), None, InputShapeError),
        (HEAD, 0, np.array([[1]], np.int32), None, InputShapeError),
        (HEAD, 0, np.array([1.0], np.float32), None, InputShapeError),
        (HEAD, 0, np.array([100], np.int32), None, InputShapeError),  # vocab is 100
        (HEAD, 0, np.zeros(17, np.int32), None, CacheFullError),  # n_ctx is 16
        (MID, 0, None, ROWS, None),
        (MID, 0, np.array([1], np.int32), None, InputShapeError),
        (MID, 0, None, ROWS.astype(np.float16), InputShapeError),
        (MID, 0, None, ROWS[:, :4], InputShapeError),
        (MID, 0, None, ROWS[0], InputShapeError),
        (MID, 0, None, np.zeros((0, W), np.float32), InputShapeError),
        (MID, 0, None, np.full((1, W), np.nan, np.float32), InputShapeError),
        (MID, 0, None, [[0.0] * W], InputShapeError),
    ],
)
def test_check_forward(layers, position, token_ids, hidden, error) -> None:
    state = _state()

    def call():
        return check_forward(state, position, layers, hidden_size=W, n_vocab=100, n_ctx=16,
                             token_ids=token_ids, hidden=hidden)

    if error is None:
        rows = call()
        assert rows.dtype == (np.int32 if layers.is_head else np.float32)
    else:
        with pytest.raises(error) as info:
            call()
        assert info.value.fields.get("session_id", "s") == "s"
    assert state.position == 0


def test_session_table_slots() -> None:
    table = SlotTable(2)
    a, b = table.open("a", None), table.open("b", None)
    assert {a.slot, b.slot} == {0, 1}
    with pytest.raises(SessionExistsError):
        table.open("a", None)
    with pytest.raises(CacheFullError):
        table.open("c", None)
    table.close("a")
    assert table.open("c", None).slot == a.slot
    with pytest.raises(UnknownSessionError):
        table.get("a")
    assert table.ids() == ["b", "c"]


@pytest.mark.parametrize("start,end,ok", [(0, 4, True), (3, 4, True), (0, 5, False), (2, 2, False), (-1, 2, False)])
def test_check_layer_range(start, end, ok) -> None:
    if ok:
        assert check_layer_range(start, end, 4).n_layers == end - start
    else:
        with pytest.raises(LayerRangeError):
            check_layer_range(start, end, 4)

