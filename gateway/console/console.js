// Meshnet console: the chat and the mesh, fed by this gateway's JSON and SSE endpoints only.
// No framework, no build step; docs/console.md describes what it shows and where it comes from.
"use strict";

const KEY_STORE = "meshnet-api-key";
const $ = (id) => document.getElementById(id);
const state = { mesh: null, meshStream: null, history: [], running: null, chat: 0, retry: 1000, ledgerAt: 0,
  ledgerEvents: null, ledgerWait: null };
const FINAL_READS = 20;  // an ended answer's session is read at most this often, 250 ms apart
const LEDGER_READS = 10;  // the ledger after a session ends: at most this often, 1 s apart

// ---------- access: the key lives in session storage and goes out as a Bearer header ----------

function apiKey() { return sessionStorage.getItem(KEY_STORE) || ""; }

function headers(extra) {
  const h = Object.assign({}, extra || {});
  const key = apiKey();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

class ApiFailure extends Error {
  constructor(status, body) {
    const err = (body && body.error) || {};
    super(err.message || ("HTTP " + status));
    this.status = status;
    this.code = err.code || "";
  }
}

async function api(path, init) {
  const opts = Object.assign({}, init || {});
  opts.headers = headers(opts.headers);
  const resp = await fetch(path, opts);
  if (!resp.ok) {
    let body = null;
    try { body = await resp.json(); } catch (_) { body = null; }
    const failure = new ApiFailure(resp.status, body);
    if (resp.status === 401) askForKey(failure);
    throw failure;
  }
  return resp;
}

function askForKey(failure) {
  const given = apiKey();
  $("key-panel").hidden = false;
  $("key-error").textContent = given
    ? "The gateway refused this key: " + failure.message
    : "";
  setLink("API key required", "s-late");
  if (given) sessionStorage.removeItem(KEY_STORE);
  $("key-input").focus();
}

// A header carries only ISO-8859-1: fetch throws on any other character (a curly quote pasted
// with the key) before a request leaves, so such a key is named here and never kept.
const HEADER_SAFE = /^[\x20-\x7e\xa0-\xff]*$/;

$("key-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const key = $("key-input").value.trim();
  if (!HEADER_SAFE.test(key)) {
    $("key-error").textContent = "This key holds a character an HTTP header cannot carry " +
      "(a curly quote or another non-Latin-1 character, perhaps pasted with it): check the key.";
    return;
  }
  sessionStorage.setItem(KEY_STORE, key);
  $("key-input").value = "";
  $("key-panel").hidden = true;
  start();
});

// ---------- SSE over fetch (EventSource cannot send an Authorization header) ----------

async function readSSE(resp, onEvent) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      let event = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) event = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (data.length) onEvent(event, data.join("\n"));
    }
  }
}

// ---------- small DOM helpers ----------

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c);
  return node;
}

function setLink(text, cls) {
  const link = $("link");
  link.textContent = text;
  link.className = "link " + (cls || "");
}

// Resolves after ms, or as soon as signal (if given) aborts.
function pause(ms, signal) {
  return new Promise((ok) => {
    const timer = setTimeout(ok, ms);
    if (signal) signal.addEventListener("abort", () => { clearTimeout(timer); ok(); }, { once: true });
  });
}

function fmt(n, digits) { return Number(n || 0).toFixed(digits === undefined ? 1 : digits); }

function bytes(n) {
  if (!n) return "0";
  const units = ["B", "KiB", "MiB", "GiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return fmt(n, i ? 1 : 0) + " " + units[i];
}

function badge(text, cls) { return el("span", { class: "badge s-" + (cls || text), text: text }); }

function rangeOf(nodeId) {
  const n = state.mesh && state.mesh.nodes.find((x) => x.node_id === nodeId);
  return n ? nodeId + " [" + n.layer_start + ", " + n.layer_end + ")" : nodeId;
}

// ---------- views ----------

function showView(name) {
  for (const v of ["chat", "mesh"]) {
    $("view-" + v).hidden = v !== name;
    $("tab-" + v).setAttribute("aria-selected", String(v === name));
  }
  syncMesh();
}
$("tab-chat").addEventListener("click", () => showView("chat"));
$("tab-mesh").addEventListener("click", () => showView("mesh"));
document.querySelector("nav").addEventListener("keydown", (ev) => {
  if (ev.key !== "ArrowLeft" && ev.key !== "ArrowRight") return;
  const next = $("tab-chat").getAttribute("aria-selected") === "true" ? "mesh" : "chat";
  showView(next);
  $("tab-" + next).focus();
});

// ---------- mesh ----------

function drawCoverage(mesh) {
  const box = $("coverage");
  box.replaceChildren();
  if (!mesh.coverage.length) box.append(el("p", { class: "note", text: "no node has announced yet" }));
  for (const cov of mesh.coverage) {
    box.append(el("p", {}, cov.model + " (" + cov.n_layer + " layers) ", badge(cov.status)));
    const nodes = mesh.nodes.filter((n) => n.model_revision === cov.model_revision);
    const summary = nodes.map((n) => n.node_id + " layers " + n.layer_start + " to " + (n.layer_end - 1) + " " + n.state);
    const grid = el("div", { class: "grid", role: "img", "aria-label": "coverage of " + cov.model + ": " + summary.join("; ") });
    grid.style.gridTemplateColumns = "minmax(5rem, 9rem) repeat(" + cov.n_layer + ", minmax(0.35rem, 1fr))";
    for (const n of nodes) {
      grid.append(el("div", { class: "label", text: n.node_id, title: n.node_id + ": " + n.state }));
      for (let i = 0; i < cov.n_layer; i++) {
        const on = i >= n.layer_start && i < n.layer_end;
        grid.append(el("div", {
          class: "cell" + (on ? " on s-" + n.state : ""), "data-node": n.node_id, "data-layer": String(i),
          title: n.node_id + " layer " + i + (on ? " (" + n.state + ")" : ""),
        }));
      }
    }
    grid.append(el("div", { class: "label", text: "replicas" }));
    cov.replicas.forEach((r, i) => {
      const cls = r === 0 ? "n0" : cov.under_provisioned.some(([a, b]) => i >= a && i < b) ? "thin" : "full";
      grid.append(el("div", { class: "cell " + cls, title: "layer " + i + ": " + r + " live" }));
    });
    box.append(grid);
    if (cov.gaps.length) {
      box.append(el("p", { class: "error", text: "gap: layers " + cov.gaps.map(([a, b]) => "[" + a + ", " + b + ")").join(" ") }));
    }
    if (cov.under_provisioned.length) {
      box.append(el("p", { class: "note", text: "under-provisioned: " + cov.under_provisioned.map(([a, b]) => "[" + a + ", " + b + ")").join(" ") }));
    }
  }
}

function drawNodes(mesh) {
  const body = $("nodes").tBodies[0];
  body.replaceChildren(...mesh.nodes.map((n) => el("tr", { "data-node": n.node_id, "data-state": n.state },
    el("td", { text: n.node_id }),
    el("td", { text: "[" + n.layer_start + ", " + n.layer_end + ") of " + n.n_layer }),
    el("td", {}, badge(n.state), fetchText(n.fetch)),
    el("td", { text: fmt(n.prefill_tokens_per_second) }),
    el("td", { text: fmt(n.decode_tokens_per_second) }),
    el("td", { text: n.rtt_ms == null ? "–" : fmt(n.rtt_ms) + " ms" }),
    el("td", { text: n.sessions + " / " + n.max_sessions + " (" + n.free_session_slots + " free)" }),
    el("td", { text: bytes(n.cache_bytes) + " / " + bytes(n.kv_capacity_bytes) }),
    el("td", { text: n.last_heartbeat ? new Date(n.last_heartbeat * 1000).toLocaleTimeString() + " (" + fmt(n.age_s) + " s ago)" : "none yet" }),
  )));
}

function fetchText(f) {
  if (!f) return "";
  const pct = f.bytes_total ? Math.round((100 * f.bytes_done) / f.bytes_total) : 0;
  return " " + f.state + " [" + f.layer_start + ", " + f.layer_end + "): " + f.pieces_done + "/" + f.pieces_total +
    " pieces, " + pct + " %" + (f.eta_s != null ? ", " + Math.round(f.eta_s) + " s left" : "");
}

function drawSessions(mesh) {
  const body = $("sessions").tBodies[0];
  if (!mesh.sessions.length) {
    body.replaceChildren(el("tr", {}, el("td", { colspan: "5", class: "note", text: "none" })));
    return;
  }
  body.replaceChildren(...mesh.sessions.map((s) => el("tr", {},
    el("td", { text: s.session_id }),
    el("td", { text: s.phase + (s.queue_position ? " #" + s.queue_position : "") }),
    el("td", { text: String(s.generated_tokens) }),
    el("td", { text: fmt(s.rolling_tokens_per_second) }),
    el("td", {}, s.route_nodes.map(rangeOf).join(" → ") + " ", s.route_policy === "private" ? badge("private", "spare") : ""),
  )));
}

function drawVerdicts(mesh) {
  const list = $("verdicts");
  if (!mesh.verdicts.length) {
    list.replaceChildren(el("li", { class: "note", text: "no verdicts yet" }));
    return;
  }
  list.replaceChildren(...mesh.verdicts.map((v) => el("li", {},
    new Date(v.ts * 1000).toLocaleTimeString() + " " + v.model + " ", badge(v.outcome),
    v.implicated.length ? " implicated: " + v.implicated.join(", ") : "",
    v.cleared.length ? " cleared: " + v.cleared.join(", ") : "",
    v.reason ? " (" + v.reason + ")" : "")));
}

function drawMesh(mesh) {
  const before = state.mesh ? state.mesh.sessions.length : 0;
  state.mesh = mesh;
  const lost = mesh.nodes.filter((n) => n.state === "lost").length;
  const left = mesh.nodes.filter((n) => n.state === "left").length;  // stopped cleanly, not crashed
  $("summary").textContent = mesh.nodes.length + " nodes (" + lost + " lost" + (left ? ", " + left + " left" : "") +
    ") · queue depth " + mesh.queue_depth +
    " · sessions " + mesh.active_sessions + " / " + mesh.max_sessions +
    (mesh.quarantined.length ? " · quarantined: " + mesh.quarantined.join(", ") : "") +
    (mesh.tracker_seen ? "" : " · no tracker status");
  drawCoverage(mesh);
  drawNodes(mesh);
  drawSessions(mesh);
  drawVerdicts(mesh);
  if (mesh.sessions.length < before) ledgerAfterSession();
}

// The tracker stores a session's work a moment after the session ends (its ledger consumer takes
// the audit events in batches, about a second apart): a read right then still has the old ledger,
// so it is read again until its event count has moved and then held for one read (a session's
// events, one per node, can land in two batches), while the Mesh view is on screen.
async function ledgerAfterSession() {
  const token = {};
  state.ledgerWait = token;  // a later session end takes over
  const before = state.ledgerEvents;
  let seen = before;
  for (let i = 0; i < LEDGER_READS && state.ledgerWait === token && state.meshStream; i++) {
    if (i) await pause(1000);
    await refreshLedger(true);
    if (state.ledgerEvents !== before && state.ledgerEvents === seen) break;
    seen = state.ledgerEvents;
  }
  if (state.ledgerWait === token) state.ledgerWait = null;
}

async function refreshLedger(force) {
  if (!force && Date.now() - state.ledgerAt < 15000) return;
  state.ledgerAt = Date.now();
  try {
    const ledger = await (await api("/v1/ledger")).json();
    $("ledger").tBodies[0].replaceChildren(...ledger.nodes.map((a) => el("tr", {},
      el("td", { text: a.node_id }), el("td", { text: fmt(a.prefill_work, 4) }),
      el("td", { text: fmt(a.decode_work, 4) }), el("td", { text: bytes(a.seed_bytes) }))));
    $("ledger-note").textContent = ledger.events + " events · " + ledger.units.work;
    state.ledgerEvents = ledger.events;
  } catch (err) {
    $("ledger-note").textContent = "Work Ledger unavailable: " + err.message;
  }
}

// The mesh stream is open only while the Mesh view is on screen: a browser opens at most 6
// connections to one host across all its tabs, and a tab nobody looks at must not hold one.
// Shown again, the stream reopens and its first event is the whole Mesh State.
function meshOnScreen() { return document.visibilityState === "visible" && !$("view-mesh").hidden; }

function syncMesh() {
  if (meshOnScreen() && !state.meshStream) {
    state.meshStream = new AbortController();
    followMesh(state.meshStream.signal);
    refreshLedger(false);
  } else if (!meshOnScreen() && state.meshStream) {
    stopMesh();
  }
}
document.addEventListener("visibilitychange", syncMesh);

function stopMesh() {
  state.meshStream.abort();
  state.meshStream = null;
  if ($("link").textContent === "live") setLink("connected", "s-serving");
}

async function followMesh(signal) {
  while (!signal.aborted) {
    try {
      const resp = await api("/v1/mesh/events", { signal });
      setLink("live", "s-serving");
      state.retry = 1000;
      await readSSE(resp, (event, data) => { if (event === "mesh") drawMesh(JSON.parse(data)); });
      setLink("mesh stream ended; reconnecting", "s-late");
    } catch (err) {
      if (signal.aborted) return;
      if (err instanceof ApiFailure && err.status === 401) return stopMesh();  // waits for a key
      setLink("gateway unreachable; retrying", "s-lost");
    }
    await pause(state.retry, signal);
    state.retry = Math.min(state.retry * 2, 30000);
  }
}

// The layer ranges named under an answer: the Mesh State, read once while its stream is closed.
async function readMesh() {
  if (state.meshStream) return;
  try {
    state.mesh = await (await api("/v1/mesh")).json();
  } catch (_) { /* node ids alone then */ }
}

// ---------- chat ----------

async function loadModels() {
  const models = (await (await api("/v1/models")).json()).data;
  const select = $("model");
  const chosen = select.value;
  select.replaceChildren(...models.map((m) => el("option", { value: m.id, text: m.id })));
  if (!models.length) select.append(el("option", { value: "", text: "(no routable model yet)" }));
  if (chosen) select.value = chosen;
  // no answer is longer than the model's context: a larger Max tokens is named under the fields
  // (the gateway refuses it with a 400 otherwise); the page's 4096 stands until a model is known
  const model = models.find((m) => m.id === select.value);
  if (model && model.context_length) $("max-tokens").max = String(model.context_length);
}

function newSessionId() {
  const rnd = new Uint8Array(8);
  crypto.getRandomValues(rnd);
  return "console-" + Array.from(rnd, (b) => b.toString(16).padStart(2, "0")).join("");
}

function showStrip(t) {
  const parts = [t.phase];
  if (t.phase === "queued" && t.queue_position) parts.push("position " + t.queue_position);
  if (t.prefill_tokens_total) parts.push("prefill " + t.prefill_tokens_done + "/" + t.prefill_tokens_total);
  parts.push(t.generated_tokens + " tokens", fmt(t.rolling_tokens_per_second) + " tok/s");
  if (t.restarts) parts.push(t.restarts + " restart(s)");
  if (t.moves) parts.push(t.moves + " move(s)");
  $("strip").textContent = parts.join(" · ");
}

// A running answer's telemetry stream, like the mesh stream, is open only while its tab is
// visible (a hidden tab keeps only the answer's own stream); shown again before the answer
// ends, it reopens, and its first events bring the strip up to date.
function syncTelemetry(run) {
  const wanted = document.visibilityState === "visible" && !run.ctl.signal.aborted;
  if (wanted && !run.telemetry) {
    run.telemetry = new AbortController();
    run.following = followTelemetry(run.sid, run.telemetry.signal, run.onTelemetry);
  } else if (!wanted && run.telemetry) {
    run.telemetry.abort();
    run.telemetry = null;
  }
}
document.addEventListener("visibilitychange", () => { if (state.running) syncTelemetry(state.running); });

async function followTelemetry(sid, signal, onEvent) {
  try {
    const resp = await api("/v1/sessions/" + sid + "/events", { signal });
    await readSSE(resp, (event, data) => { if (event === "message") onEvent(JSON.parse(data)); });
  } catch (_) { /* the answer itself reports failures */ }
}

// The session's telemetry once it is over: the gateway notices a Stop a moment later (with its
// next token, or its client check), so a read right after the Stop can still say decode.
async function finalTelemetry(sid) {
  for (let i = 1; ; i++) {
    const t = await (await api("/v1/sessions/" + sid)).json();
    if (t.phase === "completed" || t.phase === "failed" || i === FINAL_READS) return t;
    await pause(250);
  }
}

function addMessage(role, text) {
  const item = el("li", { class: "msg " + role }, el("span", { class: "who", text: role }));
  const body = el("div", { class: role === "assistant" ? "answer" : "text", text: text || "" });
  item.append(body);
  $("transcript").append(item);
  return { item, body };
}

function answerStats(t, ttft, policy) {
  const parts = [fmt(t.average_tokens_per_second) + " tok/s", "first token " + (ttft == null ? "–" : Math.round(ttft) + " ms"),
    t.generated_tokens + " tokens", "route " + (t.route_nodes.map(rangeOf).join(" → ") || "–")];
  if (t.restarts) parts.push(t.restarts + " restart(s)" + (t.lost_node_id ? " (lost " + t.lost_node_id + ")" : ""));
  if (t.moves) parts.push(t.moves + " move(s)");
  if (t.finish_reason) parts.push("finish: " + t.finish_reason);
  const stats = el("div", { class: "stats", text: parts.join(" · ") + " " });
  if (policy === "private") stats.append(badge("private route", "spare"));
  return stats;
}

async function send(ev) {
  ev.preventDefault();
  if (state.running) return;
  const prompt = $("prompt").value.trim();
  if (!prompt) return;
  // the list is read when the page loads: one loaded while no route existed (a node down) has
  // no model to send, so it is read again, and without one nothing is sent
  if (!$("model").value) {
    try { await loadModels(); } catch (_) { /* named below */ }
    if (!$("model").value) {
      $("form-error").textContent = "No routable model yet: no full route serves the model (the Mesh view shows the gaps). Nothing was sent.";
      return;
    }
    if (state.running) return;  // sent by a second click meanwhile
    $("form-error").textContent = "";
  }
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...state.history, { role: "user", content: prompt });
  const body = { model: $("model").value, messages, stream: true };
  // an empty number field is not set: the gateway's default applies (the browser checked the rest)
  if ($("temperature").value !== "") body.temperature = Number($("temperature").value);
  if ($("max-tokens").value !== "") body.max_tokens = Number($("max-tokens").value);
  addMessage("user", prompt);
  $("prompt").value = "";
  const answer = addMessage("assistant", "");
  answer.item.setAttribute("data-state", "streaming");
  const sid = newSessionId();
  const extra = { "Content-Type": "application/json", "x-route-session-id": sid };
  const allow = $("allow-nodes").value.split(",").map((x) => x.trim()).filter(Boolean);
  if (allow.length) extra["x-meshnet-allow-nodes"] = allow.join(",");
  // Stop aborts this request; New chat aborts it too and starts a chat this one must not touch
  const run = { ctl: new AbortController(), chat: state.chat, sid, telemetry: null, following: null };
  const current = () => run.chat === state.chat;
  run.onTelemetry = (t) => { if (current()) showStrip(t); };
  run.ctl.signal.addEventListener("abort", () => syncTelemetry(run));  // the telemetry stream too
  state.running = run;
  setRunning(true);
  const t0 = performance.now();
  let ttft = null;
  let text = "";
  let policy = "";  // set once the gateway answers with a stream
  let unreachable = false;
  let refused = null;
  syncTelemetry(run);
  try {
    const resp = await api("/v1/chat/completions", {
      method: "POST", signal: run.ctl.signal, body: JSON.stringify(body), headers: extra,
    });
    policy = resp.headers.get("x-meshnet-route-policy") || "public";
    if (!state.meshStream) setLink("connected", "s-serving");  // reached again, if it was not
    await readSSE(resp, (_event, data) => {
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new ApiFailure(500, chunk);
      const delta = (chunk.choices && chunk.choices[0] && chunk.choices[0].delta) || {};
      if (delta.content) {
        if (ttft === null) ttft = performance.now() - t0;
        text += delta.content;
        answer.body.textContent = text;
      }
    });
    if (current()) state.history.push({ role: "user", content: prompt }, { role: "assistant", content: text });
    answer.item.setAttribute("data-state", "done");
  } catch (err) {
    answer.item.setAttribute("data-state", "failed");
    answer.item.append(el("p", { class: "error", role: "alert", text: failureText(err, text !== "") }));
    unreachable = err instanceof TypeError;
    if (err instanceof ApiFailure && !policy) refused = err;  // an HTTP error, not a stream
  } finally {
    run.ctl.abort();  // the telemetry stream too (syncTelemetry): the final state is read below
    if (state.running === run) {
      state.running = null;
      setRunning(false);
    }
  }
  await run.following;
  if (!current()) return;  // New chat: this answer is gone
  // no session to read (a refused request never ran: its read would be a 404): the strip must
  // not keep the last phase it heard, the previous answer's "completed" among them
  if (unreachable || refused) {
    $("strip").textContent = unreachable ? "failed · the gateway did not answer"
      : "failed · refused (HTTP " + refused.status + (refused.code ? " " + refused.code : "") + ")";
    return;
  }
  try {
    const t = await finalTelemetry(sid);
    await readMesh();
    if (current()) {
      answer.item.append(answerStats(t, ttft, policy));
      showStrip(t);
    }
  } catch (_) { /* a session never admitted has no telemetry */ }
}

// fetch rejects with a bare TypeError ("Failed to fetch", "network error") when no HTTP answer
// came or the connection broke mid-answer (the gateway stopped, restarted, or is not running)
function failureText(err, midAnswer) {
  if (err.name === "AbortError") return "stopped";
  if (!(err instanceof TypeError)) return "error: " + err.message;
  setLink("gateway unreachable", "s-lost");
  return (midAnswer ? "error: the connection to the gateway broke mid-answer (" : "error: the gateway could not be reached (") +
    err.message + "): is it still running?";
}

function setRunning(running) {
  $("send").disabled = running;
  $("stop").disabled = !running;
}

// The browser checks each field (min, max, step, a number at all) before a send; what it finds
// wrong is written under the fields, not in a bubble that leaves no trace.
function showFieldErrors() {
  const bad = Array.from($("chat-form").elements).filter((f) => f.willValidate && !f.validity.valid);
  for (const f of $("chat-form").elements) {
    if (bad.includes(f)) f.setAttribute("aria-invalid", "true");
    else f.removeAttribute("aria-invalid");
  }
  // a pattern's own message says only "match the requested format": its title says which
  $("form-error").textContent = bad.map((f) => f.labels[0].textContent + ": " + f.validationMessage +
    (f.validity.patternMismatch && f.title ? " " + f.title : "")).join(" ");
}

$("chat-form").addEventListener("invalid", (ev) => { ev.preventDefault(); showFieldErrors(); }, true);
$("chat-form").addEventListener("input", () => { if ($("form-error").textContent) showFieldErrors(); });
$("chat-form").addEventListener("submit", send);
$("prompt").addEventListener("keydown", (ev) => {
  // Enter sends, as in chat apps and llama-server's page; Shift+Enter is a new line (and the
  // Enter that ends an input method's composition composes)
  if (ev.key !== "Enter" || ev.shiftKey || ev.isComposing) return;
  ev.preventDefault();
  $("chat-form").requestSubmit();
});
$("stop").addEventListener("click", () => { if (state.running) state.running.ctl.abort(); });
$("clear").addEventListener("click", () => {
  state.chat += 1;
  if (state.running) {
    state.running.ctl.abort();
    state.running = null;
    setRunning(false);
  }
  state.history = [];
  $("transcript").replaceChildren();
  $("strip").textContent = "idle";
});

// ---------- start ----------

async function start() {
  try {
    await loadModels();
    if (!state.meshStream) setLink("connected", "s-serving");
  } catch (err) {
    if (err instanceof ApiFailure && err.status === 401) return;
    setLink("gateway unreachable: " + err.message, "s-lost");
  }
  syncMesh();
}

start();
