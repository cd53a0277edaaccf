"""`meshnet node` argument handling that decides what the tracker is told."""

from __future__ import annotations

import socket

import pytest

from nodes.composite import shard_namespaces
from nodes.main import (
    _engine_opts,
    _listen,
    activation_url,
    build_parser,
    check_args,
    kv_profile,
    loopback_only,
    parse_layers,
)
from nodes.server.table import refusal_reason
from schemas.capability import CapabilityReport, ShardRange
from schemas.route import Hop, RouteSession
from wire.client import H1Connection, activation_address


@pytest.mark.parametrize(
    ("advertise", "host", "port", "expected"),
    [
        (None, "127.0.0.1", 7101, "http://127.0.0.1:7101"),
        ("http://node-b.lan:9000/", "0.0.0.0", 7101, "http://node-b.lan:9000"),
        ("http://node-b.lan/", "0.0.0.0", 7101, "http://node-b.lan:7101"),
        ("http://[fd00::2]", "::", 7101, "http://[fd00::2]:7101"),
        (None, "0.0.0.0", 7101, f"http://{socket.getfqdn() if not socket.getfqdn().startswith('localhost') else socket.gethostname()}:7101"),
    ],
)
def test_activation_url(advertise, host, port, expected) -> None:
    assert activation_url(advertise, host, port) == expected


@pytest.mark.parametrize(
    ("url", "host", "warns"),
    [
        ("http://localhost:7101", "0.0.0.0", True),  # every other machine would reach itself
        ("http://127.0.0.1:7101", "10.0.0.5", True),
        ("http://127.0.0.1:7101", "127.0.0.1", False),  # a node for this machine alone
        ("http://localhost:7101", "localhost", False),
        ("http://10.0.0.5:7101", "0.0.0.0", False),
        ("http://no-such-host.invalid:7101", "0.0.0.0", False),  # not resolvable here: no verdict
    ],
)
def test_a_node_listening_beyond_loopback_warns_when_its_url_resolves_to_loopback(url, host, warns) -> None:
    warning = loopback_only(url, host)
    assert (warning is not None) == warns, warning
    if warns:
        assert "--advertise" in warning


def test_an_ipv6_node_gets_a_url_and_host_header_with_brackets() -> None:
    url = activation_url(None, "::1", 7101)
    assert url == "http://[::1]:7101"
    assert activation_address(url) == ("::1", 7101)  # the frame client reads it back
    assert H1Connection(url)._prefix == "Host: [::1]:7101\r\n"
    try:
        sock = _listen("::1", 0)
    except OSError:
        pytest.skip("no IPv6 loopback here")
    with sock:
        assert sock.family == socket.AF_INET6


def test_parse_layers_accepts_a_half_open_range() -> None:
    assert parse_layers("0:15") == (0, 15)


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["--layers", "0:15", "--kv-profile", "exact"], None),
        (["--layers", "0:15"], None),
        (["--layers", "0:15", "--kv-profile", "exact", "--backend", "torch"], "--kv-profile exact"),
        (["--layers", "0:15", "--backend", "torch"], None),
    ],
)
def test_the_exact_kv_profile_is_a_llama_cpp_flag(argv: list[str], problem: str | None) -> None:
    got = check_args(build_parser().parse_args(argv))
    if problem is None:
        assert got is None
    else:
        assert got is not None and problem in got



@pytest.mark.parametrize(("argv", "head_dim", "profile"), [
    ([], 64, "exact"), ([], 16, "default"), (["--kv-profile", "default"], 64, "default"),
    (["--backend", "torch"], 64, "default"), (["--kv-profile", "exact"], 16, "exact")])
def test_a_llama_node_runs_the_exact_kv_profile_where_the_model_allows_it(
        argv: list[str], head_dim: int, profile: str) -> None:
    args = build_parser().parse_args(["--layers", "0:15", *argv])
    args.kv_profile = kv_profile(args, head_dim)  # an explicit exact a model cannot hold is the engine's error
    assert args.kv_profile == profile
    assert _engine_opts(args).get("kv_profile") == (None if profile == "default" else profile)


def test_a_node_refuses_a_hop_that_names_another_kv_profile() -> None:
    cap = CapabilityReport(model_arch="llama", model_name="m", model_revision="r", runtime="llama.cpp",
                           layers=ShardRange(start=0, end=15, n_layer=30), hidden_size=576, vocab_size=49152,
                           n_ctx=2048, cache_abi="llama.cpp/kv-f16/llama", cache_bytes_per_token=9408,
                           kv_profile="exact")
    route = RouteSession(session_id="s", route_id="r", model="m", model_revision="r",
                         cache_abi="llama.cpp/kv-f16/llama", n_layer=30, hidden_size=576, n_ctx=2048,
                         hops=[Hop(node_id="n", activation_url="http://x", layer_start=0, layer_end=15)])
    assert "KV profile" in (refusal_reason(route, 0, cap) or "")
    exact = route.model_copy(update={"hops": [route.hops[0].model_copy(update={"kv_profile": "exact"})]})
    assert refusal_reason(exact, 0, cap) is None


@pytest.mark.parametrize(("argv", "problem"), [
    (["--layers", "0:15", "--layers", "15:30"], None),
    (["--layers", "0:15", "--layers", "15:30", "--node-id", "a", "--node-id", "b", "--port", "7001"], None),
    (["--layers", "0:15", "--layers", "15:30", "--node-id", "a"], "2 --node-id values"),
    (["--layers", "0:15", "--layers", "15:30", "--node-id", "a", "--node-id", "a"], "its own --node-id"),
    (["--layers", "0:15", "--layers", "15:30", "--port", "1", "--port", "2", "--port", "3"], "--port values"),
    (["--layers", "0:15", "--layers", "15:30", "--advertise", "http://x:1"], "one --advertise per --layers"),
    (["--layers", "0:15", "--layers", "15:30", "--advertise", "http://x:1", "--advertise", "http://y:2",
      "--advertise", "http://z:3"], "--advertise URLs"),
    (["--layers", "0:15", "--layers", "15:30", "--advertise", "http://x"], None),
    (["--layers", "0:15", "--layers", "15:30", "--advertise", "http://x:1", "--advertise", "http://y:2"], None),
    (["--layers", "0:15", "--layers", "15:30", "--manifest", "m.json"], "piece store"),
    (["--layers", "0:15", "--node-id", "a", "--node-id", "b", "--port", "1", "--port", "2"], None),
])
def test_a_composite_node_names_each_shard_or_none(argv: list[str], problem: str | None) -> None:
    got = check_args(build_parser().parse_args(argv))
    assert got is None if problem is None else (got is not None and problem in got), got


def test_a_composite_node_gives_each_shard_its_range_id_and_port() -> None:
    args = build_parser().parse_args(["--layers", "0:10", "--layers", "10:20", "--layers", "20:30",
                                      "--node-id", "a", "--node-id", "b", "--node-id", "c", "--port", "7000",
                                      "--draft-model", "d.gguf"])
    shards = shard_namespaces(args)
    assert [(s.layers, s.node_id, s.port) for s in shards] == [((0, 10), "a", 7000), ((10, 20), "b", 7001),
                                                              ((20, 30), "c", 7002)]
    assert [s.draft_model is not None for s in shards] == [True, False, False]  # the head drafts
    ports = build_parser().parse_args(["--layers", "0:15", "--layers", "15:30", "--port", "9", "--port", "5"])
    assert [s.port for s in shard_namespaces(ports)] == [9, 5]
    single = shard_namespaces(build_parser().parse_args(["--layers", "0:30"]))
    assert [(s.layers, s.node_id, s.port) for s in single] == [((0, 30), None, 0)]
    again = build_parser().parse_args(["--layers", "0:30", "--node-id", "a", "--port", "1", "--node-id", "b",
                                       "--port", "2"])
    assert [(s.node_id, s.port) for s in shard_namespaces(again)] == [("b", 2)]  # one node: the last wins


def test_a_composite_node_announces_each_shard_where_other_machines_reach_it() -> None:
    """Bound to 0.0.0.0, a composite node's shards announce the address the operator names: one
    portless URL for all (each shard's own port added), or one URL each (relays, NAT)."""
    host = build_parser().parse_args(["--layers", "0:15", "--layers", "15:30", "--host", "0.0.0.0",
                                      "--port", "7101", "--advertise", "http://10.0.0.5"])
    assert [activation_url(s.advertise, s.host, s.port) for s in shard_namespaces(host)] == [
        "http://10.0.0.5:7101", "http://10.0.0.5:7102"]
    each = build_parser().parse_args(["--layers", "0:15", "--layers", "15:30", "--advertise", "http://a:9001/",
                                      "--advertise", "http://b:9002"])
    assert [activation_url(s.advertise, s.host, 0) for s in shard_namespaces(each)] == [
        "http://a:9001", "http://b:9002"]


@pytest.mark.parametrize("url", ["notaurl", "https://x:1", "http://x:99999", "http://x:0", "http://x:1/frames",
                                 "http://:1"])
def test_an_advertised_url_no_hop_could_use_is_refused_at_start(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Announced as it was, every route through the node would fail at its first frame."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--layers", "0:15", "--advertise", url])
    assert "--advertise" in capsys.readouterr().err
    assert build_parser().parse_args(["--layers", "0:15", "--advertise", "http://10.0.0.2:7001/"]).advertise


@pytest.mark.parametrize("flag", ["--ctx=-1", "--window=0", "--port=70000", "--lease=-5", "--threads=0",
                                  "--max-sessions=0", "--idle-timeout=nan", "--evidence-mb=1.5"])
def test_a_numeric_flag_out_of_range_is_a_usage_error_before_the_model_loads(
        flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: --ctx -1 grew past 12 GB, --window 0 joined the mesh and failed every route,
    --port 70000 loaded the model and died with a traceback."""
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--layers", "0:19", flag])
    assert exc.value.code == 2
    assert f"argument {flag.split('=')[0]}" in capsys.readouterr().err
