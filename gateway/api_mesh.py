"""GET /v1/models (and /v1/models/{model}), /healthz, /metrics and /v1/ledger: what the mesh
can route, how the gateway does, and what each node earned (the tracker's Work Ledger)."""

from __future__ import annotations

from aiohttp import web

from gateway.api_chat import error_response
from gateway.errors import ModelNotFoundError, ServiceUnavailableError
from gateway.state import BUS_STATE, MESH, METRICS, MODEL


def _models(request: web.Request) -> list[dict[str, object]]:
    """The models this gateway can serve and the mesh can route right now."""
    served, mesh = request.app[MODEL], request.app[MESH]
    routable = mesh.find(served.revision)
    if routable is None:
        return []
    return [{
        "id": served.public_name(routable),
        "object": "model",
        "created": routable.created,
        "owned_by": "meshnet",
        "revision": routable.revision,
        "n_layer": routable.n_layer,
        "context_length": routable.n_ctx,
        "nodes": list(routable.node_ids),
    }]


async def list_models(request: web.Request) -> web.Response:
    """GET /v1/models: the models this gateway can serve and the mesh can route right now."""
    return web.json_response({"object": "list", "data": _models(request)})


async def get_model(request: web.Request) -> web.Response:
    """GET /v1/models/{model}: one of them (the OpenAI SDK's models.retrieve) under any name a
    chat request may use for it (its id, an alias, the revision, the GGUF's name), else 404."""
    name = request.match_info["model"]
    models = _models(request)
    if models and request.app[MODEL].matches(name, request.app[MESH]):
        return web.json_response(models[0])
    return error_response(ModelNotFoundError(name))


async def healthz(request: web.Request) -> web.Response:
    """200 once a full route exists for the served model, else 503 with the reason."""
    served, mesh = request.app[MODEL], request.app[MESH]
    bus = request.app[BUS_STATE].get("bus")
    connected = bool(getattr(bus, "is_connected", False))
    if not connected:
        return web.json_response({"status": "unavailable", "reason": "not connected to NATS"},
                                 status=503)
    routable = mesh.find(served.revision)
    if routable is None:
        return web.json_response(
            {"status": "unavailable", "reason": mesh.unroutable_reason(served.revision)},
            status=503,
        )
    return web.json_response({
        "status": "ok", "model": served.public_name(routable), "nodes": list(routable.node_ids),
    })


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text exposition of the gateway's metrics."""
    text = request.app[METRICS].render()
    return web.Response(
        body=text.encode(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
    )


async def ledger(request: web.Request) -> web.Response:
    """The Work Ledger as the tracker last stored it (docs/gateway.md)."""
    from bus.jetstream import JetStreamError, read_ledger
    from schemas.ledger import ledger_view

    bus = request.app[BUS_STATE].get("bus")
    if bus is None or not getattr(bus, "is_connected", False):
        return error_response(ServiceUnavailableError("not connected to NATS", code="unavailable"))
    try:
        state = await read_ledger(bus)
    except JetStreamError as exc:
        return error_response(ServiceUnavailableError(str(exc), code="no_ledger"))
    return web.json_response(ledger_view(state))
