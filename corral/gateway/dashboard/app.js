// Corral's dashboard: plain JavaScript over the same HTTP API as the SDK, with the same key.
// Everything a sandbox can influence (labels, commands, output, audit details) reaches the page
// through textContent only, never as HTML: the agent inside a sandbox is not trusted.
"use strict";

const KEY_ITEM = "corral-api-key";
const view = document.getElementById("view");
const login = document.getElementById("login");
let stopLive = null; // the live view's stream, closed when the page changes

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (name === "class") node.className = value;
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function table(headers, rows) {
  return el("table", {},
    el("thead", {}, el("tr", {}, headers.map((h) => el("th", {}, h)))),
    el("tbody", {}, rows.map((cells) => el("tr", {}, cells.map((c) =>
      c instanceof Node ? el("td", {}, c) : el("td", typeof c === "number" ? { class: "num" } : {}, c))))));
}

const mib = (mb) => `${Math.round(mb)} MiB`;
const when = (ts) => (ts ? new Date(ts * 1000).toLocaleTimeString() : "-");
const pairs = (labels) => Object.entries(labels || {}).map(([k, v]) => `${k}=${v}`).join(", ");

// A response that is not ok as an Error with Corral's message (or the status); a refused key shows the login.
async function checked(response) {
  if (response.status === 401) {
    sessionStorage.removeItem(KEY_ITEM);
    showLogin("That key was not accepted.");
    throw new Error("unauthenticated");
  }
  if (!response.ok) {
    let message = `${response.status}`;
    try { message = (await response.json()).error.message; } catch (_) { /* not a Corral error body */ }
    throw new Error(message);
  }
  return response;
}

async function api(path) {
  const response = await fetch(path, { headers: { Authorization: `Bearer ${sessionStorage.getItem(KEY_ITEM)}` } });
  return (await checked(response)).json();
}

// Each NDJSON line of a streamed response, parsed, until the stream ends or is aborted (the page changed).
async function eachLine(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    let chunk;
    try { chunk = await reader.read(); } catch (_) { return; } // aborted
    if (chunk.done) return;
    buffer += decoder.decode(chunk.value, { stream: true });
    const lines = buffer.split("\n");
    buffer = lines.pop();
    for (const line of lines) {
      if (line) onEvent(JSON.parse(line)); // blank lines are keepalives
    }
  }
}

function page(title, ...content) {
  view.replaceChildren(el("h1", {}, title), ...content);
}

// -- pages ---------------------------------------------------------------------------------------

async function nodesPage() {
  const [stats, cluster] = await Promise.all([api("/v1/nodes"), api("/v1/cluster/nodes")]);
  const rows = stats.map((n) => [
    n.edge_id,
    Object.entries(n.sandboxes).map(([backend, states]) =>
      `${backend}: ${Object.entries(states).map(([s, c]) => `${c} ${s}`).join(", ")}`).join("; ") || "0",
    `${n.cpu_committed} / ${n.cpu_capacity} (${n.cpu_cores} cores)`, n.load_1m.toFixed(2),
    `${mib(n.memory_committed_mb)} / ${mib(n.memory_capacity_mb)}`, mib(n.memory_resident_mb),
    mib(n.memory_reclaimed_mb), `${(n.pressure.memory_some || 0).toFixed(1)}%`, n.refusing || "-",
  ]);
  const known = cluster.map((c) => [c.edge_id, c.state, when(c.last_seen), c.load.sandboxes, pairs(c.load.labels)]);
  page("Nodes",
    table(["node", "sandboxes", "CPU committed", "load", "memory committed", "resident", "reclaimed",
      "memory pressure", "refusing"], rows),
    el("h2", {}, "Every node the shared state knows"),
    table(["node", "state", "last heartbeat", "sandboxes", "labels"], known));
}

async function sandboxesPage(params) {
  const state = params.get("state") || "";
  const label = params.get("label") || "";
  const backend = params.get("backend") || "";
  const query = new URLSearchParams();
  if (state) query.append("state", state);
  else ["creating", "running", "paused"].forEach((s) => query.append("state", s));
  if (label) query.append("label", label);
  let rows = await api(`/v1/sandboxes?${query}`);
  if (backend) rows = rows.filter((s) => s.backend === backend);
  const stateSelect = el("select", { id: "filter-state" },
    ["", "creating", "running", "paused", "ended", "lost"].map((s) =>
      el("option", s === state ? { value: s, selected: "" } : { value: s }, s || "live")));
  const labelInput = el("input", { id: "filter-label", placeholder: "key=value", value: label });
  const backendSelect = el("select", { id: "filter-backend" },
    ["", "container", "microvm", "vm", "fncall"].map((b) =>
      el("option", b === backend ? { value: b, selected: "" } : { value: b }, b || "any backend")));
  const apply = el("button", { id: "filter-apply", onclick: () => {
    const next = new URLSearchParams();
    if (stateSelect.value) next.set("state", stateSelect.value);
    if (labelInput.value) next.set("label", labelInput.value);
    if (backendSelect.value) next.set("backend", backendSelect.value);
    location.hash = `#/sandboxes?${next}`;
  } }, "Filter");
  page(`Sandboxes (${rows.length})`,
    el("div", { class: "filters" }, stateSelect, labelInput, backendSelect, apply),
    table(["id", "state", "backend", "image", "CPU", "memory", "labels", "created", "expires"],
      rows.map((s) => [el("a", { href: `#/sandbox/${s.id}` }, s.id),
        s.state + (s.end_reason ? ` (${s.end_reason})` : ""), s.backend, s.image, s.cpu, mib(s.memory_mb),
        pairs(s.labels), when(s.created_at), when(s.expires_at)])));
}

async function sandboxPage(id) {
  const [info, audit, steps, network] = await Promise.all([
    api(`/v1/sandboxes/${id}`), api(`/v1/sandboxes/${id}/audit`), api(`/v1/sandboxes/${id}/trajectory`),
    api(`/v1/sandboxes/${id}/network`).catch((e) => ({ error: e.message })),
  ]);
  const facts = [["state", info.state + (info.end_reason ? ` (${info.end_reason})` : "")], ["node", info.edge_id],
    ["backend", info.backend], ["image", info.image], ["CPU", info.cpu], ["memory", mib(info.memory_mb)],
    ["labels", pairs(info.labels)], ["created", when(info.created_at)], ["expires", when(info.expires_at)]];
  const policy = network.error ? network.error
    : `${network.address || "loopback only"}; allowed out: ` +
      ((network.allow || []).map((r) => `${r.cidr} ${r.protocol}${r.ports.length ? `:${r.ports.join(",")}` : ""}`)
        .join("; ") || "nothing") + `; denied packets: ${network.denied_egress_packets} out, ` +
      `${network.denied_ingress_packets} in`;
  const terminal = el("div", { id: "terminal" });
  const openTerminal = el("button", { id: "open-terminal", onclick: () => {
    openTerminal.disabled = true;
    runTerminal(id, terminal).catch((error) => terminal.append(el("p", { class: "error" }, error.message)))
      .finally(() => { openTerminal.disabled = false; });
  } }, "Open a terminal");
  page(`Sandbox ${id}`,
    table(["", ""], facts),
    el("h2", {}, "Terminal"),
    ...(["running", "paused"].includes(info.state) ? [openTerminal, terminal]
      : [el("p", { class: "muted" }, `no terminal: the sandbox is ${info.state}`)]),
    el("h2", {}, "Network"), el("p", { id: "network" }, policy),
    el("h2", {}, `Audit events (${audit.length})`),
    table(["time", "severity", "kind", "detail"],
      audit.map((a) => [when(a.at), a.severity, a.kind, JSON.stringify(a.detail)])),
    el("h2", {}, `Trajectory (${steps.length} steps)`),
    table(["#", "kind", "request", "result", "started", "took"], steps.map((s) => {
      const request = s.request.cmd ? [].concat(s.request.cmd).join(" ") : (s.request.path || s.step_id);
      const result = s.result || {};
      const output = ("exit_code" in result ? `exit ${result.exit_code}\n` : "") + (result.stdout || "") +
        (result.stderr || "");
      const took = s.finished_at ? `${Math.round((s.finished_at - s.started_at) * 1000)} ms` : s.state;
      return [s.seq, s.kind, request, el("pre", {}, output || s.state), when(s.started_at), took];
    })));
}

// A shell on a pseudo-terminal in the sandbox, drawn by xterm.js: exec/stream with pty carries its output (leaving
// the page closes the stream, which ends the shell); keystrokes go to commands/{id}/stdin in order, window sizes
// to commands/{id}/resize. The terminal interprets what the sandbox writes; nothing of it becomes page HTML.
const SHELL = ["/bin/sh", "-c", "if command -v bash >/dev/null; then exec bash -l; else exec sh -l; fi"];

async function runTerminal(id, container) {
  const term = new Terminal({ rows: 24, cols: 100, convertEol: false, scrollback: 2000 });
  container.replaceChildren();
  term.open(container);
  const controller = new AbortController();
  const previousStop = stopLive;
  stopLive = () => { controller.abort(); term.dispose(); if (previousStop) previousStop(); };
  const auth = { Authorization: `Bearer ${sessionStorage.getItem(KEY_ITEM)}` };
  const post = (path, init) => fetch(`/v1/sandboxes/${id}/commands/${commandId}/${path}`,
    { method: "POST", headers: auth, ...init });
  let commandId = null;
  let sending = Promise.resolve();
  const pending = [];
  const flush = () => {
    if (!commandId || !pending.length) return;
    const data = pending.splice(0).join("");
    sending = sending.then(() => post("stdin", { body: new TextEncoder().encode(data) }));
  };
  term.onData((data) => { pending.push(data); flush(); });
  term.onResize(({ rows, cols }) => {
    if (commandId) post("resize", { headers: { ...auth, "Content-Type": "application/json" },
      body: JSON.stringify({ rows, cols }) });
  });
  const response = await fetch(`/v1/sandboxes/${id}/exec/stream`, {
    method: "POST", signal: controller.signal, headers: { ...auth, "Content-Type": "application/json" },
    body: JSON.stringify({ cmd: SHELL, pty: { rows: term.rows, cols: term.cols }, timeout_s: 86400,
      env: { TERM: "xterm-256color" } }),
  });
  await checked(response);
  term.focus();
  await eachLine(response, (event) => {
    if (event.type === "started") { commandId = event.command_id; flush(); }
    else if (event.type === "stdout") term.write(event.data);
    else if (event.type === "exit") {
      const code = event.result ? event.result.exit_code : "?";
      term.write(`\r\n[the shell ended: exit ${code}]\r\n`);
    }
  });
}

async function poolsPage() {
  const pools = await api("/v1/fncall/pools");
  page("fncall pools",
    table(["image", "CPU", "memory", "warm", "target", "in use", "waiting", "hits", "misses", "recycled",
      "replaced"], pools.map((p) => [p.image, p.cpu, mib(p.memory_mb), p.warm, p.target, p.in_use, p.waiting,
      p.hits, p.misses, p.recycled, p.replaced])));
}

async function imagesPage() {
  const [images, layers] = await Promise.all([api("/v1/images"), api("/v1/layers")]);
  page("Images",
    table(["image", "layers", "size", "source", "created"], images.map((i) => [i.name,
      i.layers.map((d) => d.slice(0, 19)).join(" "), `${(i.size_bytes / 1048576).toFixed(1)} MiB`,
      i.source || "built here", when(i.created_at)])),
    el("h2", {}, `Layers (${layers.length})`),
    table(["digest", "kind", "size", "labels", "created"], layers.map((l) =>
      [l.digest.slice(0, 23), l.kind, `${(l.size_bytes / 1048576).toFixed(1)} MiB`, pairs(l.labels),
        when(l.created_at)])));
}

// The live view: the event stream, counted per second into created / running / failed over time.
async function burstPage() {
  const seconds = 60;
  const counts = new Map(); // second -> {created, ended, failed}
  let running = 0;
  const totals = el("p", { id: "live-totals" }, "waiting for events...");
  const chart = el("div", { id: "live-chart" });
  page("Live: sandboxes over the last minute", totals, chart,
    el("p", { class: "muted" }, "Bars per second: created (blue), ended (grey), failed (red). From GET /v1/events."));
  const draw = () => {
    const now = Math.floor(Date.now() / 1000);
    const ns = "http://www.w3.org/2000/svg";
    const svg = document.createElementNS(ns, "svg");
    svg.setAttribute("width", "720"); svg.setAttribute("height", "160");
    const peak = Math.max(1, ...[...counts.values()].map((c) => c.created + c.ended + c.failed));
    for (let i = 0; i < seconds; i++) {
      const c = counts.get(now - seconds + 1 + i) || { created: 0, ended: 0, failed: 0 };
      let y = 140;
      for (const [kind, value] of [["created", c.created], ["ended", c.ended], ["failed", c.failed]]) {
        if (!value) continue;
        const h = (value / peak) * 130;
        const bar = document.createElementNS(ns, "rect");
        bar.setAttribute("x", String(i * 12)); bar.setAttribute("y", String(y - h));
        bar.setAttribute("width", "10"); bar.setAttribute("height", String(h));
        bar.setAttribute("class", `bar ${kind}`);
        svg.append(bar);
        y -= h;
      }
    }
    const label = document.createElementNS(ns, "text");
    label.setAttribute("x", "0"); label.setAttribute("y", "156"); label.textContent = `peak ${peak}/s`;
    svg.append(label);
    chart.replaceChildren(svg);
  };
  const controller = new AbortController();
  stopLive = () => controller.abort();
  const timer = setInterval(draw, 1000);
  controller.signal.addEventListener("abort", () => clearInterval(timer));
  const since = await api("/v1/sandboxes");
  running = since.length;
  const response = await fetch("/v1/events?follow=true&from_now=true", {
    headers: { Authorization: `Bearer ${sessionStorage.getItem(KEY_ITEM)}` }, signal: controller.signal });
  let created = 0, ended = 0, failed = 0;
  totals.textContent = `running ${running}; created 0, ended 0, failed 0 since this page opened`;
  draw();
  await eachLine(response, (event) => {
    const second = Math.floor(event.at);
    const c = counts.get(second) || { created: 0, ended: 0, failed: 0 };
    if (event.kind === "sandbox.running") { c.created++; created++; running++; }
    if (event.kind === "sandbox.ended") {
      const bad = ["error", "refused", "lost"].includes(event.detail.reason);
      if (bad) { c.failed++; failed++; } else { c.ended++; ended++; }
      running = Math.max(0, running - 1);
    }
    counts.set(second, c);
    totals.textContent = `running ${running}; created ${created}, ended ${ended}, failed ${failed} since this page opened`;
  });
}

// -- routing ---------------------------------------------------------------------------------------

function showLogin(message) {
  view.replaceChildren(login);
  login.hidden = false;
  document.getElementById("login-error").textContent = message || "";
  document.getElementById("logout").hidden = true;
}

async function route() {
  if (stopLive) { stopLive(); stopLive = null; }
  if (!sessionStorage.getItem(KEY_ITEM)) { showLogin(); return; }
  document.getElementById("logout").hidden = false;
  const [path, query] = (location.hash.slice(1) || "/nodes").split("?");
  const params = new URLSearchParams(query || "");
  for (const link of document.querySelectorAll("header nav a")) {
    link.classList.toggle("current", path.startsWith(link.getAttribute("href").slice(1)));
  }
  try {
    if (path.startsWith("/sandbox/")) await sandboxPage(decodeURIComponent(path.slice("/sandbox/".length)));
    else if (path === "/sandboxes") await sandboxesPage(params);
    else if (path === "/pools") await poolsPage();
    else if (path === "/images") await imagesPage();
    else if (path === "/burst") await burstPage();
    else await nodesPage();
  } catch (error) {
    if (error.message !== "unauthenticated") page("Error", el("p", { class: "error" }, error.message));
  }
}

login.addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY_ITEM, document.getElementById("key").value.trim());
  route();
});
document.getElementById("logout").addEventListener("click", () => {
  sessionStorage.removeItem(KEY_ITEM);
  route();
});
window.addEventListener("hashchange", route);
route();
