// specdec's page: a chat with the served model, each token shown by who proposed it.
// Plain JavaScript, no build step, nothing fetched from outside this server.
"use strict";

const $ = (id) => document.getElementById(id);
const MEMBERS = ["draft-model", "suffix", "prompt-lookup", "prediction", "eagle3", "medusa", "hydra"];
const state = { messages: [], key: sessionStorage.getItem("specdec-key") || "", busy: null, health: null };

function byClass(by) { return "by-" + (MEMBERS.includes(by) ? by : "other"); }

function legend() {
  const box = $("legend");
  box.replaceChildren();
  const own = document.createElement("span");
  own.className = "own";
  own.textContent = "plain text: the target's own token";
  box.append(own);
  for (const m of ["draft-model", "suffix", "prompt-lookup", "prediction", "eagle3"]) {
    const s = document.createElement("span");
    s.className = "d " + byClass(m);
    s.textContent = m === "eagle3" ? "heads (EAGLE, Medusa)" : m;
    box.append(s);
  }
  const note = document.createElement("span");
  note.className = "muted";
  note.textContent = "underlined: drafted and accepted; hover a piece for its pass";
  box.append(note);
}

function showError(text) {
  const e = $("error");
  e.textContent = text;
  e.hidden = !text;
}

function headers() {
  const h = { "Content-Type": "application/json" };
  if (state.key) h.Authorization = "Bearer " + state.key;
  return h;
}

async function init() {
  legend();
  const r = await fetch("/health");
  const h = (state.health = await r.json());
  $("model").textContent = h.draft ? "draft " + h.draft : "";
  pickable([{ id: h.model }]);
  const sel = $("method");
  for (const m of h.methods) {
    const o = document.createElement("option");
    o.value = m;
    o.textContent = m === h.method ? m + " (server default)" : m;
    if (m === h.method) o.selected = true;
    sel.append(o);
  }
  $("key-box").hidden = !h.keys;
  $("key").value = state.key;
  if (!h.keys || state.key) await models();
  $("prompt").focus();
}

// The model picker: what /v1/models lists (with a key where the server asks for one; until then
// the model /health names).
function pickable(list) {
  const sel = $("model-pick");
  const was = sel.value;
  sel.replaceChildren();
  for (const m of list) {
    const o = document.createElement("option");
    o.value = o.textContent = m.id;
    if (m.max_model_len) o.title = "context " + m.max_model_len + " tokens";
    sel.append(o);
  }
  if (list.some((m) => m.id === was)) sel.value = was;
}

async function models() {
  const r = await fetch("/v1/models", { headers: headers() });
  if (r.ok) pickable((await r.json()).data);
}

function number(id) {
  const v = $(id).value.trim();
  return v === "" ? null : Number(v);
}

function body(method, stream, k, messages = state.messages) {
  const b = {
    model: $("model-pick").value,
    messages,
    stream,
    max_tokens: number("max-tokens") || 256,
    temperature: number("temperature") || 0,
    top_p: number("top-p") || 1,
    top_k: number("top-k") || 0,
  };
  if (number("seed") !== null) b.seed = number("seed");
  if (stream) b.stream_options = { include_usage: true, include_steps: true };
  const m = method || state.health.method;  // (the method this request runs; k only where it drafts)
  if (k && m !== "none") b.speculative = { method: m, k };
  else if (method) b.speculative = { method };
  return b;
}

async function refused(r) {
  let msg = r.status + " " + r.statusText;
  try { msg = (await r.json()).error.message; } catch (_) { /* not JSON */ }
  if (r.status === 401) {
    $("key-box").hidden = false;
    $("key").focus();
    return "the server refused the API key: " + msg;
  }
  return msg;
}

// One streamed answer: the server-sent events read as they come, into `run` (what a Stop leaves
// is kept there too).
async function streamed(method, out, signal, run) {
  const t0 = (run.t0 = performance.now());
  const r = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(body(method, true, number("k"))), signal });
  if (!r.ok) throw new Error(await refused(r));
  const reader = r.body.getReader();
  const dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += dec.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") continue;
        const c = JSON.parse(data);
        if (c.error) throw new Error(c.error.message);
        if (c.usage) run.usage = c.usage;
        const delta = c.choices && c.choices[0] ? c.choices[0].delta : null;
        const text = delta && delta.content ? delta.content : "";
        if (text && run.ttft === null) run.ttft = performance.now() - t0;
        if (c.speculative) count(run, c.speculative);
        if (text) show(out, text, c.speculative);
        run.text += text;
        figures(run);
      }
    }
  }
  run.end = performance.now();
  figures(run);
  return run;
}

function count(run, s) {
  run.accepted += s.accepted;
  run.proposed += s.proposed;
  run.tokens += s.tokens;
  if (s.pass > 0) { run.passes += 1; run.stepTokens += s.tokens; }
}

// A chunk's text: its accepted drafts (coloured by who drafted them), then the target's own token.
function show(out, text, s) {
  const cut = s ? Math.min(s.drafted_chars, text.length) : 0;
  const tip = s ? (s.pass ? `pass ${s.pass} · ${s.tokens} token${s.tokens === 1 ? "" : "s"} committed · ${s.proposed} proposed, ${s.accepted} accepted` + (s.by ? " · drafted by " + s.by : "") : "the first token (prefill)") : "";
  if (cut > 0) {
    const d = document.createElement("span");
    d.className = "d " + byClass(s.by);
    d.dataset.by = s.by;
    d.dataset.accepted = s.accepted;
    d.title = tip;
    d.textContent = text.slice(0, cut);
    out.append(d);
  }
  if (cut < text.length) {
    const o = document.createElement("span");
    o.className = "t";
    o.title = tip ? tip + " · the target's own token" : "";
    o.textContent = text.slice(cut);
    out.append(o);
  }
  const log = $("log");
  log.scrollTop = log.scrollHeight;
}

function figures(run) {
  const secs = ((run.end || performance.now()) - run.t0) / 1000;
  const tokens = run.usage ? run.usage.completion_tokens : run.tokens;
  $("f-rate").textContent = secs > 0 && tokens ? (tokens / secs).toFixed(1) : "–";
  $("f-alpha").textContent = run.proposed ? (run.accepted / run.proposed).toFixed(2) : "–";
  $("f-tau").textContent = run.passes ? (run.stepTokens / run.passes).toFixed(2) : "–";
  $("f-ttft").textContent = run.ttft === null ? "–" : Math.round(run.ttft) + " ms";
  const acc = $("f-accepted");
  acc.textContent = String(run.accepted);
  acc.dataset.shown = String(run.accepted);
  if (run.usage && run.usage.speculative) acc.dataset.usage = String(run.usage.speculative.accepted_tokens);
}

// The same conversation without its last answer, decoded plainly (the comparison).
async function plainRun(signal) {
  const t0 = performance.now();
  const asked = body("none", false, null, state.messages.slice(0, -1));
  const r = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(asked), signal });
  if (!r.ok) throw new Error(await refused(r));
  const j = await r.json();
  return { text: j.choices[0].message.content, secs: (performance.now() - t0) / 1000 };
}

async function send(ev) {
  if (ev) ev.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || state.busy) return;
  const key = $("key").value.trim();
  if (key !== state.key) {
    state.key = key;
    sessionStorage.setItem("specdec-key", key);
    models().catch(() => {});
  }
  showError("");
  $("f-compare").textContent = "";
  $("f-compare").className = "";
  state.messages.push({ role: "user", content: text });
  const u = document.createElement("div");
  u.className = "msg user";
  u.textContent = text;
  const a = document.createElement("div");
  a.className = "msg assistant";
  $("log").append(u, a);
  $("prompt").value = "";
  const ctl = (state.busy = new AbortController());
  $("send").disabled = true;
  $("stop").disabled = false;
  const method = $("method").value === state.health.method ? null : $("method").value;
  const run = { text: "", ttft: null, usage: null, accepted: 0, proposed: 0, passes: 0, tokens: 0, stepTokens: 0, t0: 0, end: null };
  let answered = false;
  try {
    await streamed(method, a, ctl.signal, run);
    answered = true;
    state.messages.push({ role: "assistant", content: run.text });
    if ($("compare").checked && !ctl.signal.aborted) {
      $("f-compare").textContent = "running plain for comparison…";
      const plain = await plainRun(ctl.signal);
      const secs = (run.end - run.t0) / 1000;
      const same = plain.text === run.text;
      const greedy = Number($("temperature").value) === 0;
      $("f-compare").textContent = `plain ${plain.secs.toFixed(2)} s, this ${secs.toFixed(2)} s: ${(plain.secs / secs).toFixed(2)}× ` +
        (greedy ? (same ? "· text identical ✓" : "· text differs ✗") : "· sampled: texts may differ");
      $("f-compare").className = greedy ? (same ? "same" : "differ") : "";
      $("f-compare").dataset.speedup = (plain.secs / secs).toFixed(3);
      $("f-compare").dataset.identical = String(same);
    }
  } catch (e) {
    const stopped = e.name === "AbortError";
    if (!answered) {
      // (a stopped answer's text stays in the conversation, as the page shows it; none: the turn goes)
      if (stopped) a.append(document.createTextNode(" [stopped]"));
      if (stopped && run.text) state.messages.push({ role: "assistant", content: run.text });
      else state.messages.pop();
    } else if (stopped) {
      $("f-compare").textContent = "comparison stopped";  // (the answer stands)
    }
    if (!stopped) showError(String(e.message || e));
  } finally {
    state.busy = null;
    $("send").disabled = false;
    $("stop").disabled = true;
    $("prompt").focus();
  }
}

function stop() { if (state.busy) state.busy.abort(); }

// a piece's pass, for a tap as for a hover (a touch screen shows no titles)
function explain(e) {
  const piece = e.target.closest("#log .msg.assistant span[title]");
  if (piece && piece.title) $("step").textContent = piece.title;
}
$("log").addEventListener("click", explain);
$("log").addEventListener("mouseover", explain);
$("form").addEventListener("submit", send);
$("stop").addEventListener("click", stop);
$("clear").addEventListener("click", () => { stop(); state.messages = []; $("log").replaceChildren(); showError(""); });
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); }
});
document.addEventListener("keydown", (e) => { if (e.key === "Escape") stop(); });
init().catch((e) => showError("cannot reach the server: " + e.message));
