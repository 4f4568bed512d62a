// kvmesh fleet dashboard: polls /dashboard/status and renders it. Every value goes in as text
// (textContent), never as markup: engine names, models and refusal messages come from outside.
"use strict";

const POLL_MS = 2000;

function $(id) {
  return document.getElementById(id);
}

function set(id, text, value) {
  const el = $(id);
  el.textContent = text;
  if (value !== undefined) el.dataset.value = String(value);
}

function ms(v) {
  return v === null || v === undefined ? "–" : v < 10 ? v.toFixed(1) + " ms" : Math.round(v) + " ms";
}

function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024;
    i++;
  }
  return (i === 0 ? n : n.toFixed(1)) + " " + units[i];
}

function cell(row, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  row.appendChild(td);
  return td;
}

function fill(tbody, items, render) {
  const rows = items.map((item) => {
    const tr = document.createElement("tr");
    render(tr, item);
    return tr;
  });
  tbody.replaceChildren(...rows);
}

function render(s) {
  const n = s.node;
  set("node", [n.mode, n.node_id, "policy " + n.policy, "v" + n.version, "up " + n.uptime_secs + " s"].filter(Boolean).join(" · "));
  set("req-rate", s.requests.per_sec.toFixed(1), s.requests.per_sec);
  set("inflight", String(s.requests.inflight), s.requests.inflight);
  set("inflight-cap", "cap " + s.requests.max_inflight);
  set("hit-ratio", (100 * s.hit_ratio).toFixed(1) + " %", s.hit_ratio);
  set("tokens", s.cached_tokens + " of " + s.prompt_tokens + " prompt tokens cached");
  const t = s.ttft_ms;
  set("ttft", [t.p50, t.p90, t.p99].map(ms).join(" / "), t.p50 === null ? "" : t.p50);
  set("ttft-samples", t.samples + " answers, last minute");
  set("residency", String(s.residency.digests), s.residency.digests);
  set("residency-sources", Object.entries(s.residency.entries).map(([k, v]) => k + " " + v).join(", ") + " entries");
  set("peers", s.gossip.enabled ? String(s.gossip.peers) : "off", s.gossip.peers);
  set("gossip-bytes", s.gossip.enabled ? bytes(s.gossip.bytes_sent) + " sent, " + bytes(s.gossip.bytes_received) + " received" : "no [cluster]");

  fill($("engines").tBodies[0], s.engines, (tr, e) => {
    tr.dataset.engine = e.name;
    const name = cell(tr, e.name);
    name.title = e.url;
    cell(tr, e.kind);
    cell(tr, e.healthy ? "up" : "down", e.healthy ? "up" : "down");
    cell(tr, String(e.inflight), "num").dataset.field = "inflight";
    cell(tr, bytes(e.pending_prefill_bytes), "num");
    cell(tr, String(e.residency_digests), "num").dataset.field = "residency";
    cell(tr, String(e.answers_last_minute), "num").dataset.field = "answers";
    cell(tr, ms(e.ttft_ms.p50), "num");
    cell(tr, ms(e.ttft_ms.p99), "num");
    cell(tr, e.models.join(", "));
  });

  fill($("refusals").tBodies[0], s.refusals, (tr, r) => {
    cell(tr, new Date(r.at_unix_ms).toLocaleTimeString());
    cell(tr, String(r.status), "num");
    cell(tr, r.code).dataset.field = "code";
    cell(tr, r.method + " " + r.path);
    cell(tr, r.model);
    cell(tr, r.client);
    cell(tr, r.message).title = "request id " + r.request_id;
  });
  $("no-refusals").hidden = s.refusals.length > 0;

  const c = s.config;
  set("config", "configuration reloads: " + c.reloads_applied + " applied, " + c.reloads_refused + " refused" +
    (c.last_reload_successful ? "" : " (the last was refused: the previous configuration runs)") +
    (c.restart_pending_keys > 0 ? "; " + c.restart_pending_keys + " changed keys wait for a restart" : ""));
}

async function poll() {
  try {
    // A status that hangs must show as a problem, not stop the polling.
    const r = await fetch("/dashboard/status", { cache: "no-store", signal: AbortSignal.timeout(5000) });
    if (!r.ok) throw new Error("status " + r.status);
    render(await r.json());
    $("problem").hidden = true;
    set("updated", "updated " + new Date().toLocaleTimeString());
    document.body.dataset.polls = String(Number(document.body.dataset.polls) + 1);
  } catch (e) {
    const p = $("problem");
    p.textContent = "cannot read /dashboard/status: " + e.message;
    p.hidden = false;
  }
  setTimeout(poll, POLL_MS);
}

poll();
