"""Drafting policies replayed offline on bench/speculative.py's prompt sets: how far can prompt
lookup go on these answers, without a mesh?

    python -m bench.lookup_replay [--json] [--rtt-ms 20,50] [--decode 96] [--model PATH]

It decodes each prompt greedily with llama.cpp (one thread, the exact KV profile's flash
attention and q8_0 K cache, stopping at an end-of-generation id or after --decode tokens), then
times one model call of n rows after a 64-token prefix for n = 1, 2, 4, 8, 16 (median of 7:
what a verify step of n - 1 drafts costs the route, all hops together) and replays every answer
through each policy. A step costs the RTT plus the call of its 1 + drafted rows and yields the
drafts the answer agrees with plus one token; nothing is pipelined (the hops of a real route
also overlap a step's trip with the next step's drafting, see bench/speculative.py).

Policies (all draft from the session's own prompt and answer so far, k = --draft):
  lookup         nodes.speculation.lookup_draft, the head's drafter, at its full reach
  head           what the head sends, unpipelined: lookup_draft at the length
                 nodes.speculation.DraftState chooses from its running acceptance, the RTT and
                 the row costs below as if measured (no probe step)
  oracle-length  the same drafts cut to what the answer keeps: no draft-length policy does better
  tree-N         candidate trees: up to N continuations from distinct earlier occurrences of the
                 last 4..1 tokens (their first tokens differ), all verified in one call, the one
                 the answer agrees with longest kept

Baseline in the same run: plain decoding, RTT + one row's call per token. It prints, per set and
RTT, the median over the prompts of baseline time / policy time (and each prompt's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from artifacts.bundled import resolve_model
from bench.speculative import PROMPTS
from nodes.speculation import LOOKUP_NGRAM, LOOKUP_REACH, DraftState, lookup_draft

ROW_COUNTS = (1, 2, 4, 8, 16)
Drafter = Callable[[list[int], list[int]], list[list[int]]]  # (history, answer to come) -> candidates
# a fresh drafter per answer, given the RTT and the row costs; it may be told what each step kept
Policy = Callable[[float, dict[int, float]], "Replayed"]


class Replayed:
    """One answer's drafter in a replay: stateless policies wrap a Drafter; `book` hears what
    each step kept."""

    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter

    def candidates(self, history: list[int], answer: list[int]) -> list[list[int]]:
        return self.drafter(history, answer)

    def book(self, drafted: int, kept: int) -> None:
        pass


class HeadPlan(Replayed):
    """The head's choice: a DraftState told the trip and row costs it would have measured."""

    def __init__(self, k: int, rtt_ms: float, costs: dict[int, float]) -> None:
        self.plan = DraftState(k, latency_s=rtt_ms / 1e3, c1_s=call_ms(costs, 1) / 1e3,
                               m_s=(call_ms(costs, 1 + k) - call_ms(costs, 1)) / k / 1e3)

    def candidates(self, history: list[int], answer: list[int]) -> list[list[int]]:
        n = self.plan.length(len(answer))
        return [lookup_draft(history, n)] if n else []

    def book(self, drafted: int, kept: int) -> None:
        self.plan.kept(drafted, kept)


def greedy_answers(model: Path, steps: int) -> dict[str, list[tuple[str, list[int], list[int]]]]:
    """Per set, each prompt's (label, prompt ids, greedy answer ids)."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(model), n_ctx=1024, n_threads=1, n_threads_batch=1, flash_attn=True,
                           type_k=8, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    out: dict[str, list[tuple[str, list[int], list[int]]]] = {}
    try:
        for name, prompts in PROMPTS.items():
            for label, text in prompts:
                ids = llm.tokenize(text.encode(), add_bos=False, special=True)
                llm.reset()
                answer: list[int] = []
                for t in llm.generate(ids, temp=0.0, top_k=1):
                    if llama_cpp.llama_vocab_is_eog(vocab, t) or len(answer) >= steps:
                        break
                    answer.append(int(t))
                out.setdefault(name, []).append((label, ids, answer))
        return out
    finally:
        llm.close()


def row_costs(model: Path, repeats: int = 7) -> dict[int, float]:
    """Milliseconds of one model call of n rows after a 64-token prefix (median of `repeats`)."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(model), n_ctx=256, n_threads=1, n_threads_batch=1, flash_attn=True,
                           type_k=8, verbose=False)
    try:
        prefix = list(range(100, 164))
        llm.eval(prefix)
        times: dict[int, list[float]] = {n: [] for n in ROW_COUNTS}
        for r in range(repeats + 1):  # sizes interleaved, so drift lands on all; the first round warms up
            for n in ROW_COUNTS:
                llm.n_tokens = len(prefix)  # eval drops the KV rows past it
                t0 = time.perf_counter()
                llm.eval(list(range(200, 200 + n)))
                if r:
                    times[n].append((time.perf_counter() - t0) * 1e3)
        costs = {n: statistics.median(ts) for n, ts in times.items()}
        return costs
    finally:
        llm.close()


def call_ms(costs: dict[int, float], rows: int) -> float:
    """A call of `rows` rows, interpolated between the measured counts."""
    xs = sorted(costs)
    return float(np.interp(rows, xs, [costs[x] for x in xs]))


def kept(candidate: Sequence[int], answer: Sequence[int]) -> int:
    """How many leading drafts of `candidate` the answer agrees with."""
    n = 0
    for d, t in zip(candidate, answer, strict=False):
        if d != t:
            break
        n += 1
    return n


def continuations(history: Sequence[int], k: int, most: int) -> list[list[int]]:
    """Up to `most` continuations of the history's last 4..1 tokens from distinct earlier
    occurrences (latest first, longest match first; first tokens distinct), each at most as long
    as lookup_draft proposes after such a match."""
    arr = np.asarray(history, dtype=np.int64)
    n_hist, found, firsts = len(arr), [], set()
    for n in LOOKUP_NGRAM:
        if n_hist <= n:
            continue
        tail = arr[n_hist - n:]
        reach = min(k, LOOKUP_REACH.get(n, k))
        for i in np.flatnonzero(arr[:n_hist - n] == tail[0])[::-1]:
            if i + n < n_hist and np.array_equal(arr[i:i + n], tail) and int(arr[i + n]) not in firsts:
                firsts.add(int(arr[i + n]))
                found.append([int(t) for t in arr[i + n:min(i + n + reach, n_hist)]])
                if len(found) == most:
                    return found
    return found


def policies(k: int) -> dict[str, Policy]:
    def lookup(history: list[int], _: list[int]) -> list[list[int]]:
        return [lookup_draft(history, k)]

    def oracle_length(history: list[int], answer: list[int]) -> list[list[int]]:
        d = lookup_draft(history, k)
        return [d[:kept(d, answer)]]

    def tree(most: int) -> Drafter:
        return lambda history, _: continuations(history, k, most)

    def fixed(drafter: Drafter) -> Policy:
        return lambda rtt, costs: Replayed(drafter)

    return {"lookup": fixed(lookup), "head": lambda rtt, costs: HeadPlan(k, rtt, costs),
            "oracle-length": fixed(oracle_length), "tree-2": fixed(tree(2)), "tree-4": fixed(tree(4))}


def replay(prompt: list[int], answer: list[int], policy: Policy, rtt_ms: float, costs: dict[int, float]) -> float:
    """Speedup of `policy` over plain decoding on one answer: baseline time / replayed time."""
    drafter, spent, i = policy(rtt_ms, costs), 0.0, 0
    while i < len(answer):
        candidates = [c for c in drafter.candidates(prompt + answer[:i], answer[i:]) if c]
        spent += rtt_ms + call_ms(costs, 1 + sum(len(c) for c in candidates))
        got = max((kept(c, answer[i:]) for c in candidates), default=0)
        drafter.book(sum(len(c) for c in candidates), got)
        i += 1 + got
    return len(answer) * (rtt_ms + call_ms(costs, 1)) / spent if spent else 1.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--rtt-ms", default="20,50", help="comma-separated round-trip times to replay at")
    p.add_argument("--decode", type=int, default=96, help="greedy tokens per answer at most")
    p.add_argument("--draft", type=int, default=8, help="the most drafted tokens per step")
    p.add_argument("--model", type=Path, default=None, help="GGUF (default: the bundled model)")
    args = p.parse_args(argv)
    model = args.model or resolve_model(None)
    rtts = [float(x) for x in args.rtt_ms.split(",")]
    answers = greedy_answers(model, args.decode)
    costs = row_costs(model)
    report: dict[str, object] = {"model": str(model), "row_costs_ms": costs, "results": []}
    results: list[dict[str, object]] = report["results"]  # type: ignore[assignment]
    for rtt in rtts:
        for pname, policy in policies(args.draft).items():
            for sname, items in answers.items():
                per = {label: replay(prompt, answer, policy, rtt, costs) for label, prompt, answer in items}
                results.append({"rtt_ms": rtt, "policy": pname, "set": sname,
                                "speedup": statistics.median(per.values()), "per_prompt": per})
    if args.json:
        json.dump(report, sys.stdout, indent=1)
        print()
        return 0
    print("row costs (ms per call of n rows): " + ", ".join(f"{n}: {c:.1f}" for n, c in costs.items()))
    print(f"{'RTT':>5} {'policy':<14} {'set':<5} {'speedup':>7}  per prompt")
    for r in results:
        per = ", ".join(f"{v:.2f}" for v in r["per_prompt"].values())  # type: ignore[union-attr]
        print(f"{r['rtt_ms']:>5.0f} {r['policy']:<14} {r['set']:<5} {r['speedup']:>7.2f}  {per}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
