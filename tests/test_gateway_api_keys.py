"""Gateway API keys: pure checks as tables, then a real gateway (scripted route) with the openai SDK."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from gateway.api_keys import (
    bearer_key,
    check_request,
    key_file_lines,
    key_is_valid,
    keys_from,
    needs_key,
)
from gateway.main import build_parser
from gateway.route_client import is_loopback_host as is_loopback
from meshnet.up import _parse as parse_up
from meshnet.up import gateway_keys
from tests.test_gateway_api import MSG, Edge, edge, http, tokenizer  # noqa: F401  (fixtures)

KEY = "sk-mesh-test-1"
OTHER = "sk-mesh-test-2"


def test_keys_come_from_flags_then_the_environment_once_each() -> None:
    assert keys_from(None) == ()
    assert keys_from(["a", " b "], "c, a,,") == ("a", "b", "c")
    assert keys_from([], " ") == ()


def test_a_key_file_has_one_key_a_line_and_skips_blanks_and_comments() -> None:
    assert key_file_lines("# team keys\n\n  key-a  \n  # old: key-z\nkey-b\r\n") == ("key-a", "key-b")
    assert key_file_lines("# rotated out\n\n") == ()


@pytest.mark.parametrize("text", [None, "", "# every key commented out\n\n", b"\xff\xfe"])
@pytest.mark.parametrize("parse", [build_parser().parse_args, parse_up], ids=["gateway", "up"])
def test_a_key_file_without_keys_is_a_usage_error_not_an_open_gateway(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], parse: Any, text: str | bytes | None,
) -> None:
    """`--api-key-file` naming a missing, empty, all-comment or non-UTF-8 file: before, a missing
    one was a traceback and the others started the gateway open to anyone (no key at all)."""
    path = tmp_path / "keys"
    if isinstance(text, bytes):
        path.write_bytes(text)
    elif text is not None:
        path.write_text(text)
    with pytest.raises(SystemExit) as info:
        parse(["--api-key-file", str(path)])
    assert info.value.code == 2 and "--api-key-file" in capsys.readouterr().err


@pytest.mark.parametrize("parse", [build_parser().parse_args, parse_up], ids=["gateway", "up"])
def test_a_blank_api_key_is_a_usage_error_not_an_open_gateway(capsys: pytest.CaptureFixture[str], parse: Any) -> None:
    """`--api-key "$KEY"` with KEY unset: before, the blank key was dropped and the gateway
    started without any key, on whatever --host it was given."""
    for blank in ("", "  "):
        with pytest.raises(SystemExit) as info:
            parse(["--api-key", blank])
        assert info.value.code == 2 and "API key cannot be blank" in capsys.readouterr().err
    assert parse(["--api-key", " key-a "]).api_key == ["key-a"]


@pytest.mark.parametrize("parse", [build_parser().parse_args, parse_up], ids=["gateway", "up"])
def test_a_key_with_a_comma_is_a_usage_error_not_two_shorter_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], parse: Any,
) -> None:
    """`meshnet up` hands its keys to the gateway comma-separated: before, the key `abc,def`
    was refused and `abc` and `def` each let a client in."""
    path = tmp_path / "keys"
    path.write_text("key-a\nabc,def\n")
    for argv in (["--api-key", "abc,def"], ["--api-key-file", str(path)]):
        with pytest.raises(SystemExit):
            parse(argv)
        assert "cannot contain a comma" in capsys.readouterr().err


def test_a_key_files_keys_join_the_flags(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# team\nkey-a\n")
    args = build_parser().parse_args(["--api-key", "key-b", "--api-key-file", str(path)])
    assert args.api_key_file == ("key-a",)


@pytest.mark.parametrize(("header", "key"), [
    (None, None), ("", None), ("Bearer", None), ("Bearer   ", None), ("Basic abc", None),
    (f"Bearer {KEY}", KEY), (f"bearer {KEY}", KEY), (f"  Bearer  {KEY} ", KEY),
])
def test_bearer_key(header: str | None, key: str | None) -> None:
    assert bearer_key(header) == key


def test_a_key_is_valid_only_when_configured() -> None:
    assert key_is_valid(KEY, [OTHER, KEY]) and not key_is_valid("sk-mesh-test", [KEY])
    assert not key_is_valid(None, [KEY]) and not key_is_valid(KEY, [])
    missing, wrong = check_request(None, [KEY]), check_request(f"Bearer {OTHER}", [KEY])
    assert missing is not None and missing.status == 401 and missing.code == "missing_api_key"
    assert wrong is not None and wrong.code == "invalid_api_key"
    assert check_request(f"Bearer {KEY}", [KEY]) is None


@pytest.mark.parametrize(("path", "public", "needed"), [
    ("/v1/chat/completions", False, True), ("/v1/models", True, True), ("/v1/telemetry", False, True),
    ("/healthz", False, False), ("/metrics", False, True), ("/metrics", True, False),
    ("/", False, False), ("/console/console.js", False, False), ("/v1/mesh", False, True),
    ("/v1/mesh/events", True, True), ("/health", False, False), ("/v1/health", False, False),
    ("/tokenize", True, True), ("/detokenize", False, True),
])
def test_which_paths_need_a_key(path: str, public: bool, needed: bool) -> None:
    assert needs_key(path, public) is needed


def test_meshnet_up_is_open_on_loopback_and_generates_a_key_elsewhere() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.4") and not is_loopback("example")
    assert gateway_keys("127.0.0.1", None) == ([], False)
    assert gateway_keys("127.0.0.1", [KEY]) == ([KEY], False)
    keys, generated = gateway_keys("0.0.0.0", None)
    assert generated and len(keys) == 1 and len(keys[0]) >= 32
    assert gateway_keys("0.0.0.0", None)[0] != keys  # fresh per run


@pytest.fixture
def gateway_overrides() -> dict[str, Any]:
    return {"api_keys": (KEY, OTHER)}


async def test_the_openai_sdk_needs_the_key(edge: Edge) -> None:  # noqa: F811
    await edge.announce()
    edge.script.tokens = [*edge.tokenizer.tokenize("Hi"), min(edge.tokenizer.eog_ids)]
    async with openai.AsyncOpenAI(base_url=f"{edge.url}/v1", api_key=KEY, max_retries=0) as client:
        for _ in range(100):  # the announcements reach the gateway's mesh view asynchronously
            if (await client.models.list()).data:
                break
        reply = await client.chat.completions.create(model="bundled", messages=MSG)  # type: ignore[arg-type]
        assert reply.choices[0].message.content == "Hi"
    async with openai.AsyncOpenAI(base_url=f"{edge.url}/v1", api_key="sk-wrong", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError) as err:
            await client.chat.completions.create(model="bundled", messages=MSG)  # type: ignore[arg-type]
    assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
    assert len(edge.script.opened) == 1  # a refused request never reached the tracker or a node


async def test_health_stays_open_and_metrics_need_the_key(
        edge: Edge, http: aiohttp.ClientSession) -> None:  # noqa: F811
    async with http.get(f"{edge.url}/healthz") as resp:
        assert resp.status in (200, 503)  # open: no 401 (503 until a node announces)
    async with http.get(f"{edge.url}/metrics") as resp:
        assert resp.status == 401 and resp.headers["WWW-Authenticate"].startswith("Bearer")
        assert (await resp.json())["error"]["code"] == "missing_api_key"
    async with http.get(f"{edge.url}/metrics", headers={"Authorization": f"Bearer {OTHER}"}) as resp:
        assert resp.status == 200 and "meshnet_gateway" in await resp.text()
    async with http.get(f"{edge.url}/v1/telemetry", headers={"Authorization": "Bearer nope"}) as resp:
        assert resp.status == 401 and (await resp.json())["error"]["type"] == "invalid_request_error"


async def test_a_key_that_is_no_utf8_is_a_401_not_a_500(edge: Edge) -> None:  # noqa: F811
    """`Authorization: Bearer \\xff` (a raw byte no client library would send) is a wrong key."""
    host, port = edge.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\r\nConnection: close\r\n\r\n")
        await writer.drain()
        status_line = await reader.readline()
        rest = await reader.read()
    finally:
        writer.close()
    assert status_line.split()[1] == b"401", status_line + rest
    assert b"invalid_api_key" in rest


async def test_two_different_authorization_headers_are_a_400_not_the_first_key(
        edge: Edge, http: aiohttp.ClientSession) -> None:  # noqa: F811
    """`Authorization: Bearer KEY` then `Authorization: Bearer sk-wrong`: the first was checked
    and the request served, the second never looked at. Now a 400 naming the header (and not
    its values), before the key check; the same key sent twice is that key."""
    from multidict import CIMultiDict

    for second in ("Bearer sk-wrong", f"Bearer {OTHER}"):
        headers = CIMultiDict([("Authorization", f"Bearer {KEY}"), ("Authorization", second)])
        async with http.get(f"{edge.url}/v1/models", headers=headers) as resp:
            err = (await resp.json())["error"]
            assert (resp.status, err["code"], err["param"]) == (400, "duplicate_header", "Authorization"), err
            assert KEY not in err["message"] and "sk-" not in err["message"]
    headers = CIMultiDict([("Authorization", f"Bearer {KEY}"), ("Authorization", f"Bearer {KEY}")])
    async with http.get(f"{edge.url}/v1/models", headers=headers) as resp:
        assert resp.status == 200
