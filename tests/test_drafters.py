"""The head's ModelDrafter (`meshnet node --draft-model`) on a stand-in engine: it runs on the
head's event loop, so it reads a long history a slice per step (drafting nothing meanwhile)
instead of in one call that held the loop for seconds."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from nodes.drafters import CATCH_UP_ROWS, ModelDrafter
from nodes.engine import BatchPart, CacheFullError, ShardOutput, TokenChoice
from schemas.sampling import SamplingParams


class CountingEngine:
    """A whole "model" whose greedy next token is the last one + 1; it records every call's rows
    and the tokens its KV holds."""

    def __init__(self) -> None:
        self.kv: list[int] = []
        self.calls: list[int] = []

    def open_session(self, session_id: str, params: SamplingParams) -> None:
        self.kv = []

    def close_session(self, session_id: str) -> None:
        self.kv = []

    def _run(self, position: int, rows: Sequence[int]) -> ShardOutput:
        assert position <= len(self.kv), (position, len(self.kv))
        self.kv[position:] = [int(t) for t in rows]
        self.calls.append(len(rows))
        return ShardOutput(token=TokenChoice(token_id=self.kv[-1] + 1))

    def forward_batch(self, parts: list[BatchPart]) -> list[ShardOutput]:
        (part,) = parts
        return [self._run(part.position, part.rows)]

    def forward(self, session_id: str, position: int, *, token_ids: np.ndarray) -> ShardOutput:
        return self._run(position, token_ids)


def test_a_long_history_is_read_a_slice_per_step_then_drafted_from() -> None:
    engine = CountingEngine()
    drafter = ModelDrafter(engine)  # type: ignore[arg-type]
    history = list(range(5 * CATCH_UP_ROWS + 7))
    steps = 0
    while not (drafts := drafter.propose("s", history, 3)):
        steps += 1
        assert steps < 10, "the draft model never caught up"
    assert steps == 5  # five whole slices, then the last rows and the drafts in one step
    assert max(engine.calls) <= CATCH_UP_ROWS, engine.calls
    last = history[-1]
    assert drafts == [last + 1, last + 2, last + 3]
    assert engine.kv == history + drafts[:-1]
    # the next step drops the draft the target did not keep and reads only its own token since
    history += [last + 1, 999]
    assert drafter.propose("s", history, 2) == [1000, 1001]
    assert engine.calls[-2:] == [1, 1] and engine.kv == [*history, 1000]


def test_a_short_history_drafts_at_once() -> None:
    engine = CountingEngine()
    drafter = ModelDrafter(engine)  # type: ignore[arg-type]
    assert drafter.propose("s", list(range(CATCH_UP_ROWS)), 2) == [CATCH_UP_ROWS, CATCH_UP_ROWS + 1]


class TwoSlotEngine(CountingEngine):
    """The stand-in with the KV of two sessions, as a whole draft model's budget holds fewer
    sessions than the head's range."""

    def __init__(self) -> None:
        super().__init__()
        self.open: set[str] = set()

    def open_session(self, session_id: str, params: SamplingParams) -> None:
        if len(self.open) == 2:
            raise CacheFullError("no free session slot (2 in use)")
        self.open.add(session_id)
        super().open_session(session_id, params)

    def close_session(self, session_id: str) -> None:
        self.open.discard(session_id)


def test_a_session_the_draft_model_has_no_slot_for_drafts_nothing_instead_of_failing() -> None:
    engine = TwoSlotEngine()
    drafter = ModelDrafter(engine)  # type: ignore[arg-type]
    assert drafter.propose("a", [1], 1) == [2] and drafter.propose("b", [5], 1) == [6]
    assert drafter.propose("c", [7], 2) == []  # before: CacheFullError, and the session's run failed
    drafter.forget("a")
    assert drafter.propose("c", [7], 2) == [8, 9]
