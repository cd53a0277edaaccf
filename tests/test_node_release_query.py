"""The `used` value of a node's DELETE /v1/sessions/<id> (nodes/server/app.py, row_count)."""

from __future__ import annotations

import pytest

from nodes.server.app import row_count


@pytest.mark.parametrize(("text", "rows"), [("0", 0), ("37", 37), ("", None), ("-3", None), ("+3", None),
                                            ("\u00b2", None), ("\u0661\u0662", None), ("9" * 5000, None),
                                            ("3.0", None)])
def test_used_is_ascii_digits_or_nothing(text: str, rows: int | None) -> None:
    """'²' passes str.isdigit and int() refuses it (and 5,000 digits): the release answered 500
    and did not end the session; now such a value is ignored like any other non-number."""
    assert row_count(text) == rows
