"""Turn generated token ids into safe text deltas: whole UTF-8 characters, stop strings cut."""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence
from dataclasses import dataclass


class IncrementalDetokenizer:
    """Feeds token bytes through an incremental UTF-8 decoder so a delta never splits a char."""

    def __init__(self, token_bytes: Callable[[int], bytes]) -> None:
        self._token_bytes = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        """Text completed by this token (may be empty while a character is incomplete)."""
        return self._decoder.decode(self._token_bytes(token_id))

    def flush(self) -> str:
        """Whatever is left at the end (an incomplete character becomes U+FFFD)."""
        return self._decoder.decode(b"", final=True)


@dataclass(slots=True, frozen=True)
class StopScan:
    """Result of feeding text to a StopMatcher: what may be emitted, and whether a stop hit."""

    emit: str
    stopped: bool


def held_back_length(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best


def scan_for_stop(buffer: str, stops: Sequence[str]) -> tuple[int, int]:
    """(index of the earliest stop string in buffer or -1, length to hold back otherwise)."""
    hits = [i for i in (buffer.find(s) for s in stops) if i >= 0]
    if hits:
        return min(hits), 0
    return -1, held_back_length(buffer, stops)


class StopMatcher:
    """Holds back text that could be the start of a stop string; never emits a stop string."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._pending = ""
        self.stopped = False

    def feed(self, text: str) -> StopScan:
        """Add generated text; returns the part that is safe to show."""
        if self.stopped:
            return StopScan("", True)
        if not self._stops:
            return StopScan(text, False)
        buffer = self._pending + text
        index, hold = scan_for_stop(buffer, self._stops)
        if index >= 0:
            self.stopped = True
            self._pending = ""
            return StopScan(buffer[:index], True)
        cut = len(buffer) - hold
        self._pending = buffer[cut:]
        return StopScan(buffer[:cut], False)

    def flush(self) -> str:
        """At the end of generation without a stop: release the held-back text."""
        out, self._pending = self._pending, ""
        return "" if self.stopped else out
