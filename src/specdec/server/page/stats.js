// specdec's stats page: the server's Prometheus metrics as tables, refreshed every 2 s.
"use strict";

// Prometheus text format -> [{name, labels, value}]
function parse(text) {
  const out = [];
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = line.match(/^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s+(\S+)/);
    if (!m) continue;
    const labels = {};
    for (const kv of (m[3] || "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[kv[1]] = kv[2];
    out.push({ name: m[1], labels, value: Number(m[4]) });
  }
  return out;
}

function rows(tbody, cells) {
  tbody.replaceChildren(...cells.map((r) => {
    const tr = document.createElement("tr");
    for (const c of r) { const td = document.createElement("td"); td.textContent = c; tr.append(td); }
    return tr;
  }));
}

const fmt = (v, d = 0) => (v === undefined || Number.isNaN(v) ? "–" : v.toFixed(d));

async function refresh() {
  const samples = parse(await (await fetch("/metrics")).text());
  const get = (name, labels = {}) => {
    const s = samples.find((x) => x.name === name && Object.entries(labels).every(([k, v]) => x.labels[k] === v));
    return s ? s.value : undefined;
  };
  const methods = [...new Set(samples.filter((s) => s.name === "specdec_target_passes_total").map((s) => s.labels.method))].sort();
  rows(document.querySelector("#methods tbody"), methods.map((m) => [
    m,
    fmt(get("specdec_acceptance_rate", { method: m }), 2),
    fmt(get("specdec_tokens_per_pass", { method: m }), 2),
    fmt(get("specdec_draft_tokens_total", { method: m })),
    fmt(get("specdec_accepted_tokens_total", { method: m })),
    fmt(get("specdec_target_passes_total", { method: m })),
  ]));
  const mean = (h) => { const n = get(h + "_count"); return n ? (1000 * get(h + "_sum")) / n : undefined; };
  rows(document.querySelector("#server tbody"), [
    ["tokens generated", fmt(get("specdec_generated_tokens_total"))],
    ["prompt tokens", fmt(get("specdec_prompt_tokens_total"))],
    ["batch now", fmt(get("specdec_batch_size"))],
    ["queue now", fmt(get("specdec_queue_depth"))],
    ["drafting on", get("specdec_drafting_enabled") ? "yes" : "no"],
    ["mean time to first token, ms", fmt(mean("specdec_time_to_first_token_seconds"))],
    ["mean time per token after the first, ms", fmt(mean("specdec_inter_token_latency_seconds"), 1)],
  ]);
  rows(document.querySelector("#requests tbody"), samples.filter((s) => s.name === "specdec_requests_total")
    .map((s) => [s.labels.endpoint, s.labels.status, fmt(s.value)]));
  document.getElementById("updated").textContent = new Date().toLocaleTimeString();
}

async function loop() {
  try { await refresh(); } catch (e) { document.getElementById("updated").textContent = "cannot read /metrics: " + e.message; }
  setTimeout(loop, 2000);
}
fetch("/health").then((r) => r.json()).then((h) => { document.getElementById("model").textContent = h.model; }).catch(() => {});
loop();
