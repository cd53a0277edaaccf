"""Speculative decoding across an emulated WAN (nodes/speculation.py): does drafting pay, and
is it exact?

    python -m bench.speculative [--json] [--quick] [--rtt-ms 0,20,50] [--hops 2,3] [--decode 96]
                                [--concurrency 8] [--draft 8] [--no-self-draft]

For each hop count and RTT it starts nats-server, a tracker and one `meshnet node` per hop, each
node reached only through its own relay (bench/wan.py's far_nodes: one-way delay RTT/2,
announced with --advertise), every node with `--kv-profile exact` (speculation gives plain
decoding's tokens only on an exact route). Two prompt sets of ChatML prompts for the bundled
model: copy-heavy (copy a paragraph, repeat a function, quote a document, fix or re-tense a text: the
answer repeats the prompt, so prompt lookup drafts well) and free text (stories, explanations:
little to look up). Each prompt gets two sessions, one greedy Decode Run of --decode steps each
(stopping at the model's end-of-generation ids): baseline draft=0 and speculative draft=--draft.

Per set and setting it reports:
  tps, baseline_tps       median over the prompts of decode tokens/s: the Decode Run's tokens
                          (all after the prefill's token) over the time from sending the run to
                          its last token
  speedup                 median over the prompts of speculative / baseline tokens/s
  acceptance              drafts kept / drafts sent, summed over the prompts
  accepted_per_trip       tokens per verify step: (kept drafts + verify steps) / verify steps,
                          a verify step being a result with drafted > 0; per prompt also
                          `pipelined`, the steps the head sent before the one before was
                          answered (meshnet node --verify-depth; pass --node-extra=--verify-depth=1
                          to measure without)
  identical_to_baseline   every prompt's speculative tokens equal its baseline tokens (greedy:
                          anything else is a bug)
  aggregate_speedup_c<N>  --concurrency sessions at once (cycling the set's prompts), prefilled
                          first, then all Decode Runs started together: total tokens/s with
                          drafting over without (the mean of two such runs each, in the order
                          without, with, with, without)
  self_draft              (per set; --no-self-draft leaves it out) the same single-stream
                          figures on a second mesh of the same shape whose head drafts with the
                          target model itself (`meshnet node --draft-model` the same GGUF), each
                          against its own baseline run on that mesh: the mechanism's ceiling for
                          acceptance (the draft model runs the route's exact KV profile, so its
                          greedy tokens are the route's); its cost is the draft model's decode
                          steps on the head, which the head's draft length accounts for.
Figures taken on a loaded machine are only good as ratios between runs of the same invocation
(speculative against baseline, one RTT against another).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from artifacts.bundled import resolve_model
from artifacts.revision import model_revision
from bench.cli_args import parse_with_quick
from bench.relay import DelayRelay
from bench.route import open_route, start_tracker, stop_processes
from bench.wan import add_node_arguments, far_nodes
from bus import runloop
from bus.cli_args import number, number_list
from bus.client import Bus
from bus.server import NatsServer
from gateway.route_client import RouteClient
from schemas.frames import DEFAULT_WINDOW, MAX_DRAFT

EXACT = ["--kv-profile", "exact"]


def chatml(user: str) -> str:
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


DOCUMENT = ("The village of Northbrook sits at the foot of a wide green valley. Its market opens every Saturday "
            "and sells bread, cheese and wool. The river that runs through the valley floods every spring and "
            "leaves the fields rich and dark. A stone bridge built in 1820 is the only way across in winter. Most "
            "families in the village keep sheep.")

PROMPTS: dict[str, list[tuple[str, str]]] = {
    "copy": [
        ("copy-paragraph", chatml(
            "Copy this text exactly: The old train station had been closed for twenty years, but every "
            "morning a woman in a blue coat still waited on the platform. She carried a small suitcase "
            "and a paper ticket dated the day the last train left. Nobody in the town knew her name.")),
        ("copy-code", chatml(
            "Repeat this code exactly:\n```python\ndef greet(name, greeting=\"Hello\"):\n"
            "    message = greeting + \", \" + name + \"!\"\n    print(message)\n    return message\n```")),
        ("quote-document", chatml("Quote the sentence about the river from this document:\n\n" + DOCUMENT)),
        ("copy-science", chatml(
            "Copy this text exactly: Water boils at one hundred degrees Celsius at sea level. At higher "
            "altitudes the air pressure is lower, so water boils at a lower temperature. This is why "
            "cooking pasta on a mountain takes longer.")),
        ("fix-spelling", chatml(
            "Fix the spelling mistakes in this text and write the corrected text: The old train staton had been "
            "closed for twenty years, but every morning a woman in a blue coat still waited on the platfrom. She "
            "carried a small suitcase and a paper ticket dated the day the last train left.")),
        ("quote-third-sentence", chatml("Copy the third sentence of this document exactly:\n" + DOCUMENT)),
        ("present-tense", chatml(
            "Rewrite this text in the present tense: The old train station had been closed for twenty years, "
            "but every morning a woman in a blue coat still waited on the platform. She carried a small "
            "suitcase.")),
        ("repeat-document", chatml("Repeat this document exactly:\n" + DOCUMENT)),
    ],
    "free": [
        ("story-robot", chatml("Write a short story about a robot who learns to paint.")),
        ("explain-rain", chatml("Explain why it rains, in simple words.")),
        ("story-fox", chatml("Tell me a story about a fox and a crow who become friends.")),
        ("explain-internet", chatml("Explain how the internet works to a ten year old.")),
    ],
}


def load_vocab(model: Path) -> tuple[dict[str, list[tuple[str, list[int]]]], list[int]]:
    """The prompt sets tokenized, and the model's end-of-generation ids."""
    import llama_cpp

    vocab = llama_cpp.Llama(model_path=str(model), vocab_only=True, verbose=False)
    sets = {name: [(label, vocab.tokenize(text.encode(), add_bos=False, special=True)) for label, text in prompts]
            for name, prompts in PROMPTS.items()}
    v = llama_cpp.llama_model_get_vocab(vocab.model)
    eog = [t for t in range(vocab.n_vocab()) if llama_cpp.llama_vocab_is_eog(v, t)]
    vocab.close()
    return sets, eog


@dataclass
class Run:
    """One Decode Run's tokens, timing and drafting counters."""

    tokens: list[int] = field(default_factory=list)
    t0: float = 0.0
    t_last: float = 0.0
    drafted: int = 0
    accepted: int = 0
    trips: int = 0  # verify steps: results with drafted > 0
    pipelined: int = 0  # steps sent before the one before them was answered

    @property
    def tps(self) -> float:
        return len(self.tokens) / (self.t_last - self.t0) if self.t_last > self.t0 else 0.0


@dataclass
class Ctx:
    http: aiohttp.ClientSession
    bus: Bus
    name: str
    ids: list[str]
    stop_ids: list[int]
    steps: int


async def prefilled(ctx: Ctx, stack: contextlib.AsyncExitStack, prompt: list[int]) -> tuple[RouteClient, int]:
    """A fresh session through the route, prefilled; its client (closed with `stack`) and first token."""
    session = await open_route(ctx.bus, ctx.name, ctx.ids)
    rc = await stack.enter_async_context(RouteClient(session, ctx.http, bus=ctx.bus))
    return rc, (await rc.prefill(prompt)).token_id


async def decode(ctx: Ctx, rc: RouteClient, first: int, draft: int) -> Run:
    run = Run(t0=time.monotonic())
    run.t_last = run.t0
    async for r in rc.decode_run(first, ctx.steps, stop_ids=ctx.stop_ids, draft=draft):
        run.t_last = time.monotonic()
        run.tokens.append(r.token_id)
        run.drafted += r.drafted
        run.accepted += r.accepted
        run.trips += r.drafted > 0
        run.pipelined += r.pipelined
    return run


async def single(ctx: Ctx, prompt: list[int], draft: int) -> tuple[int, Run]:
    """One session: prefill, then one Decode Run."""
    async with contextlib.AsyncExitStack() as stack:
        rc, first = await prefilled(ctx, stack, prompt)
        return first, await decode(ctx, rc, first, draft)


async def concurrent(ctx: Ctx, prompts: list[list[int]], n: int, draft: int) -> tuple[float, list[list[int]], list[str]]:
    """n sessions (cycling `prompts`) prefilled together, then their Decode Runs started together:
    (aggregate decode tokens/s, each session's tokens with the first, errors)."""
    async with contextlib.AsyncExitStack() as stack:
        picked = [prompts[i % len(prompts)] for i in range(n)]
        opened = await asyncio.gather(*(prefilled(ctx, stack, p) for p in picked), return_exceptions=True)
        ok = [o for o in opened if not isinstance(o, BaseException)]
        errors = [f"prefill: {type(o).__name__}: {o}"[:300] for o in opened if isinstance(o, BaseException)]
        runs = await asyncio.gather(*(decode(ctx, rc, first, draft) for rc, first in ok), return_exceptions=True)
        errors += [f"decode: {type(r).__name__}: {r}"[:300] for r in runs if isinstance(r, BaseException)]
        done = [r for r in runs if isinstance(r, Run)]
        wall = max((r.t_last for r in done), default=0.0) - min((r.t0 for r in done), default=0.0)
        tps = sum(len(r.tokens) for r in done) / wall if wall > 0 else 0.0
        by_session = iter(zip(ok, runs, strict=True))
        tokens = []  # in the order of `picked`: [] for a session that failed
        for o in opened:
            r = None if isinstance(o, BaseException) else next(by_session)[1]
            tokens.append([o[1], *r.tokens] if isinstance(r, Run) and not isinstance(o, BaseException) else [])
        return tps, tokens, errors


def ratio(a: float, b: float) -> float | None:
    return a / b if b else None


async def singles(ctx: Ctx, prompts: list[tuple[str, list[int]]], draft: int) -> dict[str, object]:
    """Each prompt alone, without drafting and with up to `draft` drafts per step (in turn):
    the set's medians, its acceptance and tokens per trip, and each prompt's row."""
    rows = []
    for i, (label, prompt) in enumerate(prompts):
        order = (0, draft) if i % 2 == 0 else (draft, 0)  # alternate, so drift favours neither
        runs = {d: await single(ctx, prompt, d) for d in order}
        (first_b, base), (first_s, spec) = runs[0], runs[draft]
        rows.append({"prompt": label, "prompt_tokens": len(prompt), "tokens": len(spec.tokens),
                     "tps": spec.tps, "baseline_tps": base.tps, "speedup": ratio(spec.tps, base.tps),
                     "drafted": spec.drafted, "accepted": spec.accepted, "trips": spec.trips,
                     "pipelined": spec.pipelined,
                     "identical_to_baseline": [first_s, *spec.tokens] == [first_b, *base.tokens],
                     "output": [first_s, *spec.tokens],
                     **({} if [first_s, *spec.tokens] == [first_b, *base.tokens]
                        else {"baseline_output": [first_b, *base.tokens]})})
    drafted = sum(int(r["drafted"]) for r in rows)
    accepted = sum(int(r["accepted"]) for r in rows)
    trips = sum(int(r["trips"]) for r in rows)
    return {
        "tps": statistics.median(float(r["tps"]) for r in rows),
        "baseline_tps": statistics.median(float(r["baseline_tps"]) for r in rows),
        "speedup": statistics.median(float(r["speedup"] or 0.0) for r in rows),
        "acceptance": accepted / drafted if drafted else None,
        "accepted_per_trip": (accepted + trips) / trips if trips else None,
        "identical_to_baseline": all(r["identical_to_baseline"] for r in rows),
        "prompts": rows,
    }


async def one_set(ctx: Ctx, prompts: list[tuple[str, list[int]]], args: argparse.Namespace) -> dict[str, object]:
    out = await singles(ctx, prompts, args.draft)
    rows: list[dict[str, object]] = out.pop("prompts")  # type: ignore[assignment]
    n = args.concurrency
    token_lists = [p for _, p in prompts]
    # without, with, with, without: one pair alone moved the ratio by +-0.2 from run to run
    base1, spec1, spec2, base2 = [await concurrent(ctx, token_lists, n, d) for d in (0, args.draft, args.draft, 0)]
    base_tps, spec_tps = (base1[0] + base2[0]) / 2, (spec1[0] + spec2[0]) / 2
    errors = base1[2] + spec1[2] + spec2[2] + base2[2]
    out[f"aggregate_tps_c{n}"] = spec_tps
    out[f"aggregate_baseline_tps_c{n}"] = base_tps
    out[f"aggregate_speedup_c{n}"] = ratio(spec_tps, base_tps)
    # every concurrent session, either way, against the prompt's single-stream baseline
    single_base = {i: rows[i]["output"] if rows[i]["identical_to_baseline"] else rows[i]["baseline_output"]
                   for i in range(len(rows))}
    out[f"identical_c{n}"] = all(t == single_base[j % len(rows)] for run in (base1, spec1, spec2, base2)
                                 for j, t in enumerate(run[1]) if t)
    out["errors"] = errors
    out["prompts"] = rows
    return out


def reap_children() -> None:
    """SIGKILL any node or tracker process of ours still alive (a node that failed to start
    leaves the ones far_nodes started before it unlisted)."""
    me = str(os.getpid())
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, IndexError):
            stat = Path(f"/proc/{pid}/stat").read_text()
            state, ppid = stat.rsplit(")", 1)[1].split()[:2]
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            if ppid == me and state != "Z" and (b"nodes.main" in cmd or b"meshnet.cli" in cmd):
                os.kill(int(pid), signal.SIGKILL)


async def stop_mesh(nodes: list[asyncio.subprocess.Process], relays: list[DelayRelay]) -> None:
    """Stop a mesh's node processes (SIGKILL for one that outlives SIGTERM's wait) and relays."""
    await stop_processes(nodes, 20)
    for p in nodes:
        if p.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
    for r in relays:
        await r.close()


async def one_config(model: Path, sets: dict[str, list[tuple[str, list[int]]]], stop_ids: list[int],
                     hops: int, rtt_ms: float, args: argparse.Namespace) -> dict[str, object]:
    """One hop count and RTT: the prompt-lookup mesh (every set alone and N at once), then, with
    --self-draft, the same mesh whose head drafts with the target itself (every set alone)."""
    out: dict[str, object] = {"hops": hops, "rtt_ms": rtt_ms, "draft": args.draft, "decode": args.decode,
                              "concurrency": args.concurrency}
    async with NatsServer.start() as nats:
        procs: list[asyncio.subprocess.Process] = []
        relays: list[DelayRelay] = []
        bus: Bus | None = None
        try:
            procs.append(await start_tracker(nats))
            user, password = nats.credentials("gateway")
            bus = await Bus.connect(nats.url, role="gateway", user=user, password=password, name="bench-spec")
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=5.0)
            async with aiohttp.ClientSession(timeout=timeout) as http:
                drafters = [("prompt-lookup", [])]
                if args.self_draft:  # nodes after the head ignore --draft-model
                    drafters.append(("self-draft", ["--draft-model", str(model)]))
                for drafter, extra in drafters:
                    node_args = argparse.Namespace(**{**vars(args), "node_extra": [*args.node_extra, *extra]})
                    try:
                        procs_n, ids, relays_n = await far_nodes(nats, model, hops, rtt_ms / 2e3, None, node_args)
                        procs += procs_n
                        relays += relays_n
                        ctx = Ctx(http, bus, model_revision(model), ids, stop_ids, args.decode)
                        warm = sets["copy"][0][1]
                        await single(Ctx(http, bus, ctx.name, ids, stop_ids, 8), warm, 0)  # warm-up, both paths
                        await single(Ctx(http, bus, ctx.name, ids, stop_ids, 8), warm, args.draft)
                        for name, prompts in sets.items():
                            if drafter == "prompt-lookup":
                                out[name] = await one_set(ctx, prompts, args)
                            else:
                                out[name]["self_draft"] = await singles(ctx, prompts, args.draft)  # type: ignore[index]
                    except Exception as exc:
                        if drafter == "prompt-lookup":
                            raise
                        for name in sets:  # the prompt-lookup figures stand; the ceiling's failure is reported
                            out[name]["errors"].append(f"self-draft: {type(exc).__name__}: {exc}"[:300])  # type: ignore[index]
                    await stop_mesh(procs[1:], relays)  # one mesh at a time on the machine's cores (the tracker stays)
                    del procs[1:]
                    relays.clear()
        finally:
            try:
                await stop_processes(procs, 20)
            finally:
                reap_children()
                for r in relays:
                    await r.close()
                if bus is not None:
                    await bus.close()
    return out


def table(row: dict[str, object], sets: list[str], n: int) -> str:
    def f(v: object, width: int, digits: int = 2) -> str:
        text = "-" if v is None else f"{v:.{digits}f}" if isinstance(v, float) else str(v)
        return text.rjust(width)

    lines = [f"== {row['hops']} hops, RTT {row['rtt_ms']:g} ms (draft {row['draft']}, decode {row['decode']}, "
             f"concurrency {n}) ==",
             f"{'set':<18}{'tps':>8}{'base_tps':>10}{'speedup':>9}{'accept':>8}{'tok/trip':>10}"
             f"{'identical':>11}{f'agg_x_c{n}':>10}{f'ident_c{n}':>10}"]
    for name in sets:
        s = row[name]
        assert isinstance(s, dict)
        lines.append(f"{name:<18}{f(s['tps'], 8, 1)}{f(s['baseline_tps'], 10, 1)}{f(s['speedup'], 9)}"
                     f"{f(s['acceptance'], 8)}{f(s['accepted_per_trip'], 10)}{f(s['identical_to_baseline'], 11)}"
                     f"{f(s[f'aggregate_speedup_c{n}'], 10)}{f(s[f'identical_c{n}'], 10)}")
        for p in s["prompts"]:
            lines.append(f"  {p['prompt']:<16}{f(p['tps'], 8, 1)}{f(p['baseline_tps'], 10, 1)}{f(p['speedup'], 9)}"
                         f"{f(ratio(p['accepted'], p['drafted']), 8)}"
                         f"{f(ratio(p['accepted'] + p['trips'], p['trips']), 10)}"
                         f"{f(p['identical_to_baseline'], 11)}   tokens={p['tokens']} drafted={p['drafted']} "
                         f"accepted={p['accepted']} trips={p['trips']} pipelined={p['pipelined']}")
        for e in s["errors"]:
            lines.append(f"  error: {e}")
        if isinstance(sd := s.get("self_draft"), dict):
            lines.append(f"{name + ' self-draft':<18}{f(sd['tps'], 8, 1)}{f(sd['baseline_tps'], 10, 1)}"
                         f"{f(sd['speedup'], 9)}{f(sd['acceptance'], 8)}{f(sd['accepted_per_trip'], 10)}"
                         f"{f(sd['identical_to_baseline'], 11)}")
    return "\n".join(lines)


async def guarded(model: Path, sets: dict[str, list[tuple[str, list[int]]]], stop_ids: list[int],
                  hops: int, rtt_ms: float, args: argparse.Namespace) -> dict[str, object]:
    """one_config, with SIGTERM cancelling it as Ctrl-C does: its cleanup then stops every process."""
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, task.cancel)
    try:
        return await one_config(model, sets, stop_ids, hops, rtt_ms, args)
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="one JSON object on stdout (the tables go to stderr)")
    p.add_argument("--quick", action="store_true",
                   help="RTT 0 and 20 ms, 2 hops, decode 48, concurrency 4 (flags given still win)")
    p.add_argument("--model", default=None)
    p.add_argument("--rtt-ms", type=number_list(0), default="0,20,50")
    p.add_argument("--hops", type=number_list(1, 30, integer=True), default="2,3")
    p.add_argument("--decode", type=number(2, integer=True), default=96)
    p.add_argument("--concurrency", type=number(1, integer=True), default=8)
    p.add_argument("--draft", type=number(1, MAX_DRAFT, integer=True), default=MAX_DRAFT,
                   help="most drafts per step of the speculative runs")
    p.add_argument("--self-draft", action=argparse.BooleanOptionalAction, default=True,
                   help="after the prompt-lookup runs, run every prompt alone again with the head drafting "
                        "with the target model itself (--draft-model): the mechanism's ceiling (default: on)")
    add_node_arguments(p)  # every node also gets --kv-profile exact
    args = parse_with_quick(p, argv, {"rtt_ms": "0,20", "hops": "2", "decode": 48, "concurrency": 4})
    model = resolve_model(args.model)
    # far_nodes' namespace: what bench.route.spawn_nodes reads, plus the exact KV profile
    args.node_extra = [*EXACT, *args.node_extra]
    args.batch_threads, args.window, args.node_env = 0, DEFAULT_WINDOW, []
    sets, stop_ids = load_vocab(model)
    out_stream = sys.stderr if args.json else sys.stdout
    rows = []
    try:
        for h in args.hops:
            for r in args.rtt_ms:
                row = runloop.run(guarded(model, sets, stop_ids, h, r, args))
                rows.append(row)
                print(table(row, list(sets), args.concurrency), file=out_stream, flush=True)
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        reap_children()
    if args.json:
        print(json.dumps({"model": model.name, "stop_ids": stop_ids,
                          "self_draft": args.self_draft,
                          "prompts": {name: [{"label": label, "text": text} for label, text in ps]
                                      for name, ps in PROMPTS.items()},
                          "rows": rows}, indent=1))
    ok = all(not row[name]["errors"] and row[name]["identical_to_baseline"]  # type: ignore[index]
             and row[name][f"identical_c{args.concurrency}"]  # type: ignore[index]
             and row[name].get("self_draft", {}).get("identical_to_baseline", True)  # type: ignore[index]
             for row in rows for name in sets)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
