"""Typed application keys for everything the gateway's handlers share."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from gateway.admission_gate import AdmissionGate
from gateway.audit_publisher import AuditPublisher
from gateway.generation import RouteClientFactory
from gateway.mesh_view import MeshView
from gateway.metrics import GatewayMetrics
from gateway.replay_vault import ReplayVault
from gateway.route_watch import RouteWatch
from gateway.routing import Router
from gateway.served_model import ServedModel
from gateway.settings import GatewaySettings
from gateway.telemetry_hub import TelemetryHub

SETTINGS = web.AppKey("settings", GatewaySettings)
MODEL = web.AppKey("served_model", ServedModel)
MESH = web.AppKey("mesh_view", MeshView)
HUB = web.AppKey("telemetry_hub", TelemetryHub)
METRICS = web.AppKey("metrics", GatewayMetrics)
ROUTER = web.AppKey("router", Router)
HTTP = web.AppKey("http", aiohttp.ClientSession)
OPEN_ROUTE = web.AppKey("open_route", RouteClientFactory)
STREAMS = web.AppKey("streams", set[asyncio.Task[object]])
# the telemetry and mesh SSE streams among them, with their requests (the per-client bounds)
TELEMETRY_STREAMS = web.AppKey("telemetry_streams", dict[asyncio.Task[object], web.Request])
BUS_STATE = web.AppKey("bus_state", dict[str, object])
AUDIT = web.AppKey("audit_publisher", AuditPublisher)
GATE = web.AppKey("admission_gate", AdmissionGate)
WATCH = web.AppKey("route_watch", RouteWatch)
VAULT = web.AppKey("replay_vault", ReplayVault)
