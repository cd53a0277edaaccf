"""Gateway metrics in the Prometheus text exposition format (no client library needed)."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 1.0)
TOKENS_PER_TRIP_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 9)
QUEUE_WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    body = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
    return "{" + body + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


@dataclass(slots=True)
class Counter:
    """A monotonically increasing value per label set."""

    name: str
    help: str
    labelled: bool = False  # its series all carry labels: none before the first (no unlabelled 0)
    values: dict[tuple[tuple[str, str], ...], float] = field(default_factory=dict)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        """Add `amount` (≥ 0) to the series with these labels."""
        key = tuple(sorted(labels.items()))
        self.values[key] = self.values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        """Current value of one series (0 if never incremented)."""
        return self.values.get(tuple(sorted(labels.items())), 0.0)

    def render(self) -> list[str]:
        """Exposition lines."""
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        if not self.values and not self.labelled:
            lines.append(f"{self.name} 0")
        for key, v in sorted(self.values.items()):
            lines.append(f"{self.name}{_labels(dict(key))} {_num(v)}")
        return lines


@dataclass(slots=True)
class Gauge:
    """A value that goes up and down."""

    name: str
    help: str
    value: float = 0.0

    def render(self) -> list[str]:
        """Exposition lines."""
        return [
            f"# HELP {self.name} {self.help}",
            f"# TYPE {self.name} gauge",
            f"{self.name} {_num(self.value)}",
        ]


@dataclass(slots=True)
class Histogram:
    """Cumulative buckets, sum and count of observed values."""

    name: str
    help: str
    buckets: Sequence[float]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        """Record one observation."""
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def render(self) -> list[str]:
        """Exposition lines (cumulative `le` buckets, then +Inf, sum, count)."""
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        running = 0
        for bound, n in zip(self.buckets, self.counts, strict=False):
            running += n
            lines.append(f'{self.name}_bucket{{le="{_num(bound)}"}} {running}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{self.name}_sum {_num(self.total)}")
        lines.append(f"{self.name}_count {self.count}")
        return lines


class GatewayMetrics:
    """Everything /metrics exposes."""

    def __init__(self) -> None:
        p = "meshnet_gateway"
        self.ttft = Histogram(f"{p}_time_to_first_token_seconds",
                              "Request arrival to first generated token.", TTFT_BUCKETS)
        self.tpot = Histogram(f"{p}_time_per_output_token_seconds",
                              "Time between consecutive generated tokens.", TPOT_BUCKETS)
        self.prompt_tokens = Counter(f"{p}_prompt_tokens_total", "Prompt tokens prefilled.")
        self.generated_tokens = Counter(f"{p}_generated_tokens_total", "Tokens generated.")
        self.requests = Counter(f"{p}_requests_total", "Chat and text completion requests by outcome.",
                                labelled=True)
        self.failures = Counter(f"{p}_session_failures_total",
                                "Route Sessions that failed, by phase.", labelled=True)
        self.active = Gauge(f"{p}_active_sessions", "Route Sessions in progress.")
        self.queue_depth = Gauge(f"{p}_queue_depth", "Requests waiting in the admission queue.")
        self.queue_wait = Histogram(f"{p}_queue_wait_seconds",
                                    "Time a request spent in the admission queue (admitted, "
                                    "expired or gone).", QUEUE_WAIT_BUCKETS)
        self.restarts = Counter(f"{p}_restarts_total",
                                "Sessions moved to a new route after losing a hop, by outcome "
                                "(resumed: the new route gave its first token; failed: no new route).", labelled=True)
        self.restart_seconds = Histogram(f"{p}_restart_seconds",
                                         "From a lost hop to the first token on the new route "
                                         "(the re-prefill included).", TTFT_BUCKETS)
        self.restart_replays = Counter(f"{p}_restart_replays_total",
                                       "Restarts whose new route rebuilt generated tokens, by how "
                                       "(batched: one prefill; stepwise: one model call per token).", labelled=True)
        self.restart_kept_hops = Counter(f"{p}_restart_kept_hops_total",
                                         "Hops a restart's new route continued on (Kept Hops: their "
                                         "Hot KV State kept the history, only the last token ran again).")
        self.moves = Counter(f"{p}_session_moves_total",
                             "Sessions moved to a new route because the tracker spread sessions "
                             "over a range's replicas, by outcome (resumed, failed, declined: not "
                             "movable now, e.g. still in prefill or restarts off).", labelled=True)
        self.move_seconds = Histogram(f"{p}_move_seconds",
                                      "From a move's order to the first token on the new route "
                                      "(the moved range's re-prefill included): the moved stream's pause.",
                                      TTFT_BUCKETS)
        self.accepted_per_trip = Histogram(f"{p}_speculative_tokens_per_trip",
                                           "Tokens one speculative verify step gave (the drafts the "
                                           "tail kept, plus its own).", TOKENS_PER_TRIP_BUCKETS)
        self.audit_events = Counter(f"{p}_audit_events_total",
                                    "Audit events by kind and outcome (published, dropped, failed).", labelled=True)
        self.sampled = Counter(f"{p}_sessions_sampled_total",
                               "Sessions this gateway sampled for replay validation (their ids kept for a validator).")
        self.verdicts = Counter(f"{p}_validation_verdicts_total",
                                "Validators' verdicts heard on the bus, by outcome (pass, fail, inconclusive): "
                                "behind the sampled count while validation lags or misses sessions.", labelled=True)

    def render(self) -> str:
        """The whole exposition text."""
        lines: list[str] = []
        for metric in (self.ttft, self.tpot, self.prompt_tokens, self.generated_tokens,
                       self.requests, self.failures, self.active, self.queue_depth,
                       self.queue_wait, self.restarts, self.restart_seconds, self.restart_replays,
                       self.restart_kept_hops, self.moves, self.move_seconds, self.accepted_per_trip,
                       self.audit_events, self.sampled, self.verdicts):
            lines += metric.render()
        return "\n".join(lines) + "\n"
