"""`meshnet node` argument handling that decides what the tracker is told."""

from __future__ import annotations

import socket

import pytest

from nodes.main import activation_url, parse_layers


@pytest.mark.parametrize(
    ("advertise", "host", "port", "expected"),
    [
        (None, "127.0.0.1", 7101, "http://127.0.0.1:7101"),
        ("http://node-b.lan:9000/", "0.0.0.0", 7101, "http://node-b.lan:9000"),
        (None, "0.0.0.0", 7101, f"http://{socket.getfqdn()}:7101"),
    ],
)
def test_activation_url(advertise, host, port, expected) -> None:
    assert activation_url(advertise, host, port) == expected


def test_parse_layers_accepts_a_half_open_range() -> None:
    assert parse_layers("0:15") == (0, 15)
