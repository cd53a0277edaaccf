"""Gateway settings: where to listen, which bus and model, and every bound."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.admission import DEFAULT_MAX_QUEUE, DEFAULT_QUEUE_TIMEOUT
from gateway.admission_gate import DEFAULT_QUEUE_TICK
from wire.body_deadline import DEFAULT_BODY_MIN_RATE, DEFAULT_BODY_TIMEOUT

DEFAULT_TOKEN_FLUSH_MS = 50  # tokens reach the gateway in batches at most this often (20 per second)
DEFAULT_DRAFT = 8  # most tokens a route's head drafts per step (it drafts fewer where they do not pay)


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    """Everything create_app needs; defaults suit a local mesh."""

    host: str = "127.0.0.1"
    port: int = 8000
    nats_url: str = "nats://127.0.0.1:4222"
    nats_user: str | None = None
    nats_password: str | None = None
    model: str | None = None  # GGUF path or bundled name (None = bundled)
    route_timeout: float = 5.0  # seconds to wait for the tracker's RouteReply
    chunk_size: int | None = None  # prefill tokens per frame (None: chosen per route, prefill_chunk_size)
    token_flush_ms: int = DEFAULT_TOKEN_FLUSH_MS  # the route's head sends decoded tokens at most this often, batched (0: each)
    max_sessions: int = 64  # concurrent Route Sessions driven by this gateway (more requests queue)
    max_queue: int = DEFAULT_MAX_QUEUE  # requests waiting for a route; one more is a 503 queue_full
    queue_timeout: float = DEFAULT_QUEUE_TIMEOUT  # seconds a request may wait; then a 503 queue_timeout
    queue_tick: float = DEFAULT_QUEUE_TICK  # a waiting head asks the tracker again at least this often
    max_body_bytes: int = 4 * 1024 * 1024
    max_telemetry_streams: int = 256  # open /v1/sessions/*/events + /v1/telemetry streams
    max_telemetry_streams_per_client: int = 16  # ... of them held by one client (API key, else address)
    node_timeout: float = 5.0  # a node unheard of for this long is not routable
    session_history: int = 256  # telemetry events kept per session (Last-Event-ID replay)
    global_history: int = 2048  # events kept for /v1/telemetry replay
    retention_seconds: float = 600.0  # finished sessions kept this long ...
    max_finished: int = 1024  # ... and at most this many
    session_wait: float = 30.0  # /events for an unknown id waits this long for it
    keepalive: float = 15.0  # SSE keep-alive comment interval
    body_timeout: float = DEFAULT_BODY_TIMEOUT  # seconds a request body may go without a byte (then 408) ...
    body_min_rate: float = DEFAULT_BODY_MIN_RATE  # ... and bytes/s it must keep up after that grace (wire/body_deadline.py)
    write_timeout: float = 60.0  # an answer's stream that the client takes nothing of for this long: it has left
    decode_event_interval: float = 0.1  # SSE telemetry during decode at most this often
    bus_event_interval: float = 0.25  # bus telemetry during decode at most this often
    audit_queue: int = 1024  # validation events waiting for JetStream (more are dropped, counted)
    audit_drain: float = 2.0  # seconds shutdown waits for queued audit events to be stored
    route_policy: str = "public"  # per request: x-meshnet-route-policy or a route_policy body field
    allow_nodes: tuple[str, ...] = ()  # the allow list of a private default policy
    restart: bool = True  # a session that loses a hop continues on a new route (per request: x-meshnet-restart)
    max_restarts: int = 2  # new routes one request may use after its first
    stall_timeout: float = 10.0  # no token for this long (or 20 measured steps) loses the route; prefill 3x
    api_keys: tuple[str, ...] = ()  # Bearer keys the client API requires (none: open, for loopback)
    metrics_public: bool = False  # /metrics answers without a key even when keys are set
    validate_rate: float = 0.05  # fraction of sessions the validator replays (flagged ones always)
    # "auto": generated tokens replayed in one batch when every hop of the new route runs the exact
    # KV profile, else one step each; "decode": always one step each (exact); "prefill": one batch
    restart_replay: str = "auto"
    # "on": a restart continues on the lost route's surviving hops, which keep the history's Hot
    # KV State (Kept Hops: only the lost range is prefilled again); "off": every hop of the new
    # route prefills the whole history
    restart_keep: str = "on"
    # speculative decoding: the most tokens a route's head drafts per decode step, on routes
    # whose every hop runs the exact KV profile (0: never); a request's `speculative: false` opts out
    draft: int = DEFAULT_DRAFT
