"""The pull connection of durable audit readers (bus/pull_link.py): its parser, and a real server."""

from __future__ import annotations

import pytest

from bus import subjects
from bus.jetstream import DurableAuditReader, JetStreamError
from bus.pull_link import PullLink, PullLinkError, _fatal_status, parse_deliveries
from bus.server import NatsServer
from schemas.audit import NodeWork
from tests.fixtures.nats import BusFactory

HDR = b"NATS/1.0\r\nNats-Msg-Id: abc\r\n\r\n"


def hmsg(subject: bytes, reply: bytes, payload: bytes, headers: bytes = HDR) -> bytes:
    return b"HMSG %s 1 %s %d %d\r\n%s%s\r\n" % (subject, reply, len(headers), len(headers) + len(payload), headers,
                                                payload)


def test_deliveries_statuses_pings_and_errors_are_told_apart_and_a_partial_item_waits() -> None:
    stream = (hmsg(b"mesh.audit.node_work.node.a", b"$JS.ACK.S.c.1.7.7.0.3", b'{"x":1}')
              + b"MSG plain 1 5\r\nhello\r\n"
              + b"PING\r\n"
              + hmsg(b"_INBOX.t.x", b"", b"", b"NATS/1.0 408 Request Timeout\r\n\r\n").replace(b" 1  ", b" 1 ")
              + b"-ERR 'Permissions Violation for Publish to \"x\"'\r\n"
              + b"+OK\r\n")
    items, used = parse_deliveries(stream)
    assert used == len(stream)
    assert items[0] == ("msg", "mesh.audit.node_work.node.a", "$JS.ACK.S.c.1.7.7.0.3", b'{"x":1}')
    assert items[1] == ("msg", "plain", "", b"hello")
    assert items[2] == ("ping",)
    assert items[3] == ("status", 408, "Request Timeout")
    assert items[4][0] == "err" and "Permissions Violation" in items[4][1]
    assert items[5] == ("other", b"+OK")
    # fed a byte at a time, the same items come out, and nothing before a whole item
    buf, got = bytearray(), []
    for i in range(len(stream)):
        buf += stream[i:i + 1]
        part, n = parse_deliveries(buf)
        got += part
        del buf[:n]
    assert got == items and not buf
    # a payload holding CRLF and protocol words is payload, not protocol
    tricky = hmsg(b"s", b"r", b'PING\r\n-ERR x\r\nMSG a 1 3\r\n')
    assert parse_deliveries(tricky)[0] == [("msg", "s", "r", b'PING\r\n-ERR x\r\nMSG a 1 3\r\n')]


def test_a_pull_that_cannot_succeed_again_is_told_from_one_that_merely_ended() -> None:
    assert not any(_fatal_status(c, t) for c, t in ((404, "No Messages"), (408, "Request Timeout"),
                                                   (409, "Exceeded MaxWaiting"), (409, "Leadership Change")))
    assert _fatal_status(409, "Consumer Deleted") and _fatal_status(503, "No Responders")


async def test_a_wrong_login_is_a_typed_error(nats_server: NatsServer) -> None:
    with pytest.raises(PullLinkError, match=r"(?i)authorization"):
        await PullLink.open(nats_server.url, user="tracker", password="wrong", inbox_prefix="_INBOX.tracker")


async def test_a_reader_pulls_in_order_acknowledges_and_fails_typed_when_the_server_goes(
        nats_server: NatsServer, bus_factory: BusFactory) -> None:
    node = await bus_factory("node", name="pl-a")
    await node.ensure_audit_stream()
    events = [NodeWork(source="pl-a", node_id="pl-a", session_id=f"s{i}", route_id="r", model_revision="m",
                       layer_start=0, layer_end=2, prefill_tokens=i, decode_tokens=1) for i in range(30)]
    for e in events:
        await node.publish_audit(e)
    tracker = await bus_factory("tracker", name="pl-t")
    reader = DurableAuditReader(tracker, "pull-link-test", filter_subject=subjects.audit("node_work", "node.pl-a"))
    await reader.open()
    first = await reader.fetch(20, timeout=1.0)
    rest = await reader.fetch(20, timeout=1.0)  # fewer than asked: what is there, at once
    assert [e.data["prefill_tokens"] for e in first + rest] == list(range(30))
    assert [e.seq for e in first + rest] == sorted(e.seq for e in first + rest)
    assert {e.subject for e in first} == {"mesh.audit.node_work.node.pl-a"}
    await reader.ack(first + rest)
    await reader.close()
    again = DurableAuditReader(tracker, "pull-link-test", filter_subject=subjects.audit("node_work", "node.pl-a"))
    await again.open()
    assert await again.fetch(20, timeout=0.3) == []  # all acknowledged: nothing comes back
    await nats_server.stop()
    with pytest.raises(JetStreamError):
        for _ in range(3):  # the loss may be seen at the next pull
            await again.fetch(5, timeout=0.3)
    await again.close()
