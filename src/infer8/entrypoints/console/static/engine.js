// The engine view: reads /console/api/events (fetch + Authorization, not EventSource).
"use strict";

const WINDOW = 150;  // records kept for the charts (15 s at 10 records/s)
const COLORS = { free: "#222b38", cached: "#2f6f68", shared: "#e4eaf2" };
const CELL_FREE = 0, CELL_CACHED = 1, CELL_SHARED = 2, CELL_FIRST_OWNER = 3;

const view = {
  info: null,
  model: null,
  lastSeq: 0,
  numRecords: 0,
  history: { t: [], running: [], waiting: [], preempted: [], prefill: [], decode: [], stepMs: [] },
  cells: null,
  cellBlocks: 1,
  reqs: [],
  numPreemptions: 0,
  dirty: false,
  burst: null,
};

function $(id) { return document.getElementById(id); }

function slotColor(slot) {
  const hue = (slot * 137.508 + 15) % 360;
  return "hsl(" + hue.toFixed(0) + ", 68%, 62%)";
}

function cellColor(value) {
  if (value === CELL_FREE) return COLORS.free;
  if (value === CELL_CACHED) return COLORS.cached;
  if (value === CELL_SHARED) return COLORS.shared;
  return slotColor(value - CELL_FIRST_OWNER);
}

function decodeCells(b64) {
  const raw = atob(b64);
  const cells = new Uint8Array(raw.length);
  for (let i = 0; i < raw.length; i++) cells[i] = raw.charCodeAt(i);
  return cells;
}

function push(name, value) {
  const series = view.history[name];
  series.push(value);
  if (series.length > WINDOW) series.shift();
}

function onInfo(info) {
  view.info = info;
  $("stat-max-seqs").textContent = "of max " + info.max_num_seqs;
  $("kv-title").textContent = info.num_blocks.toLocaleString() + " blocks × " + info.block_size + " tokens";
  const capacity = $("kv-capacity");
  capacity.replaceChildren();
  const add = (label, value, cls) => {
    const span = document.createElement("span");
    span.append(label + " ");
    const b = document.createElement("b");
    b.textContent = value;
    if (cls) b.className = cls;
    span.appendChild(b);
    capacity.appendChild(span);
  };
  add("dtype", info.kv_cache_dtype);
  add("capacity", info.capacity_tokens.toLocaleString() + " tokens");
  add("memory", (info.kv_cache_memory_bytes / 1048576).toFixed(1) + " MiB");
  if (info.is_fp8) {
    const gain = info.capacity_tokens / Math.max(1, info.bf16_capacity_tokens);
    add("same memory in bf16", info.bf16_capacity_tokens.toLocaleString() + " tokens");
    add("FP8 holds", "×" + gain.toFixed(2), "gain");
    add("scales", info.kv_scale);
  } else {
    add("prefix caching", info.enable_prefix_caching ? "on" : "off");
  }
  $("saturation").hidden = !info.is_fp8;
  $("sat-note").className = info.is_fp8 ? "legend" : "sat-empty";
  $("sat-note").textContent = info.is_fp8
    ? "K/V values clipped at the FP8 maximum when written, per layer (cumulative)."
    : "The cache is " + info.kv_cache_dtype + ": nothing is clipped. Serve with --kv-cache-dtype fp8 to see it.";
}

function onStep(record) {
  if (record.seq <= view.lastSeq) return;  // a record built before this stream's first one
  view.lastSeq = record.seq;
  view.numRecords++;
  push("t", record.t);
  push("running", record.running);
  push("waiting", record.waiting);
  push("preempted", record.preempted);
  push("prefill", record.steps ? record.prefill_tokens / record.steps : 0);
  push("decode", record.steps ? record.decode_tokens / record.steps : 0);
  push("stepMs", record.steps ? record.step_ms : null);
  view.numPreemptions += record.preemptions;
  view.cells = decodeCells(record.kv);
  view.cellBlocks = record.kv_cell_blocks || 1;
  view.reqs = record.reqs;
  const map = $("kv-map");
  map.dataset.kvUsed = String(record.kv_used);
  map.dataset.kvCached = String(record.kv_cached);
  map.dataset.signature = record.kv.length + ":" + hash(record.kv);
  map.dataset.cellBlocks = String(view.cellBlocks);
  document.body.dataset.records = String(view.numRecords);
  $("stat-running").textContent = record.running;
  $("stat-waiting").textContent = record.waiting;
  // --scheduling-policy priority: the queue by priority, lowest value (first to run) first
  const byPriority = (record.waiting_by_priority || []).map(([p, n]) => "p" + p + ": " + n);
  $("stat-waiting-sub").textContent = byPriority.length ? byPriority.join(" · ") : "queued";
  $("stat-preempted").textContent = record.preempted;
  $("stat-preemptions").textContent = view.numPreemptions + " preemptions";
  const total = record.kv_total;
  $("stat-kv").textContent = formatPercent(record.kv_used, total);
  $("stat-kv-blocks").textContent = infer8.formatNumber(record.kv_used) + " / " +
    infer8.formatNumber(total) + " blocks · " + infer8.formatNumber(record.kv_cached) + " cached";
  $("kv-cell-note").textContent = view.cellBlocks > 1
    ? "one cell = " + view.cellBlocks + " blocks (its most frequent holder)"
    : "one cell = one block";
  // Averaged by the server over its recent steps: no browser clock is involved.
  $("stat-decode").textContent = infer8.formatNumber(record.decode_tokens_per_s);
  $("stat-prefill").textContent = infer8.formatNumber(record.prefill_tokens_per_s);
  $("stat-step").textContent = record.mean_step_ms === null ? "–" : record.mean_step_ms.toFixed(1);
  $("stat-steps").textContent = "ms, " + record.steps_per_s.toFixed(1) + " steps/s";
  if (record.saturated) drawSaturation(record.saturated);
  drawTable();  // with the figures above, so the page never shows a batch and a table that disagree
  view.dirty = true;
}

function hash(text) {
  let h = 0;
  for (let i = 0; i < text.length; i++) h = (h * 31 + text.charCodeAt(i)) | 0;
  return (h >>> 0).toString(16);
}

function onMetrics(m) {
  ["ttft", "tpot", "e2e"].forEach((name) => {
    const values = m[name + "_s"];
    values.forEach((v, i) => { $(name + "-" + i).textContent = infer8.formatSeconds(v); });
  });
  // TTFT and end to end over the same finished requests (the server's), so TTFT never exceeds
  // end to end; TPOT is /metrics' inter-token latency.
  const source = $("ttft-0").closest(".panel").querySelector("h3 .aside");
  source.textContent = "over " + infer8.formatNumber(m.latency_requests) + " finished · TPOT: /metrics";
  source.title = "TTFT and end to end: the same requests, the latest that finished while the " +
    "view was open (up to 1,000); TPOT: inter-token latency from /metrics";
  if (m.prefix_cache_hit_rate !== null) {
    $("stat-prefix").textContent = (100 * m.prefix_cache_hit_rate).toFixed(0) + "%";
    $("stat-prefix-sub").textContent = infer8.formatNumber(m.prefix_cache_hits) + " of " + infer8.formatNumber(m.prefix_cache_queries) + " tokens";
  }
  if (m.spec_decode_acceptance_rate !== null) {  // speculative decoding on, drafts verified
    $("stat-decode-sub").textContent = "tokens/s · drafts " +
      (100 * m.spec_decode_acceptance_rate).toFixed(0) + "% accepted";
    $("stat-decode-sub").title = infer8.formatNumber(m.spec_decode_num_accepted_tokens) + " of " +
      infer8.formatNumber(m.spec_decode_num_draft_tokens) + " draft tokens accepted (vllm:spec_decode_*)";
  }
  const finished = $("finished");
  finished.replaceChildren();
  for (const [reason, count] of Object.entries(m.finished)) {
    const span = document.createElement("span");
    span.textContent = reason + ": " + infer8.formatNumber(count);
    finished.appendChild(span);
  }
  $("sat-total").textContent = infer8.formatNumber(m.fp8_saturated) + " clipped";
}

function drawSaturation(values) {
  charts.bars($("saturation"), values, "#ff8f6b");
}

// A share with the digits it needs: 96 of 22,487 blocks is 0.43%, never "0%".
function formatPercent(part, total) {
  if (!part || !total) return "0%";
  const pct = (100 * part) / total;
  if (pct < 0.01) return "<0.01%";
  const digits = pct < 1 || (pct > 99 && part < total) ? 2 : pct < 10 ? 1 : 0;
  return pct.toFixed(digits) + "%";
}

function drawKvMap() {
  const canvas = $("kv-map");
  const cells = view.cells;
  if (!cells) return;
  const { ctx, width, height } = charts.prepare(canvas);
  const n = cells.length;
  let size = Math.floor(Math.sqrt((width * height) / n));
  while (size > 2 && Math.ceil(n / Math.floor(width / size)) * size > height) size--;
  size = Math.max(2, Math.min(size, 40));
  const cols = Math.max(1, Math.floor(width / size));
  const gap = size >= 6 ? 1 : 0;
  for (let i = 0; i < n; i++) {
    ctx.fillStyle = cellColor(cells[i]);
    ctx.fillRect((i % cols) * size, Math.floor(i / cols) * size, size - gap, size - gap);
  }
}

function drawTable() {
  const rows = $("req-rows");
  rows.replaceChildren();
  $("req-count").textContent = view.reqs.length ? view.reqs.length + " requests" : "";
  for (const [slot, id, prompt, output, blocks] of view.reqs) {
    const tr = document.createElement("tr");
    const name = document.createElement("td");
    const swatch = document.createElement("span");
    swatch.className = "swatch";
    swatch.style.background = slotColor(slot);
    name.title = id;
    name.append(swatch, id.length > 20 ? id.slice(0, 11) + "…" + id.slice(-6) : id);
    tr.appendChild(name);
    for (const value of [prompt, output, blocks]) {
      const td = document.createElement("td");
      td.textContent = value;
      tr.appendChild(td);
    }
    rows.appendChild(tr);
  }
}

function draw() {
  requestAnimationFrame(draw);
  if (!view.dirty) return;
  view.dirty = false;
  const h = view.history;
  charts.timeSeries($("chart-requests"), [
    { color: "#ff6b6b", values: h.preempted },
    { color: "#f0c75e", values: h.waiting },
    { color: "#7c9cff", values: h.running, fill: "rgba(124,156,255,.15)" },
  ], { windowSize: WINDOW, minMax: 4 });
  charts.timeSeries($("chart-tokens"), [
    { color: "#4fd1a5", values: h.decode },
    { color: "#f5a35c", values: h.prefill },
  ], { windowSize: WINDOW, stacked: true, minMax: 4 });
  charts.timeSeries($("chart-step"), [
    { color: "#c3a6ff", values: h.stepMs.map((v) => v || 0), fill: "rgba(195,166,255,.12)" },
  ], { windowSize: WINDOW, minMax: 10 });
  drawKvMap();
}

async function connect() {
  for (;;) {
    try {
      const response = await infer8.fetch("/console/api/events", { headers: { Accept: "text/event-stream" } });
      if (response.status === 401) return;
      if (!response.ok) throw new Error("HTTP " + response.status);
      infer8.setStatus("online", "streaming engine records");
      await infer8.readEvents(response, (name, data) => {
        const payload = JSON.parse(data);
        if (name === "info") onInfo(payload);
        else if (name === "step") onStep(payload);
        else if (name === "metrics") onMetrics(payload);
      });
    } catch (err) {
      infer8.setStatus("offline", String(err));
    }
    await new Promise((r) => setTimeout(r, 1000));
  }
}

// -- the load button ---------------------------------------------------------------------------
const WORDS = ("the engine schedules every request in tokens not phases so a long prompt is " +
  "split into chunks while short answers keep decoding each step the batch changes as requests " +
  "arrive and finish and the cache hands out blocks of sixteen tokens that return to the pool " +
  "when a request leaves prefixes that many requests share are kept and reused").split(" ");

function burstPrompt(i, numWords, shared) {
  const words = [];
  let seed = shared ? 7 : i * 7919 + 13;
  for (let w = 0; w < numWords; w++) {
    if (shared && w === numWords - 4) seed = i * 7919 + 13;
    seed = (seed * 1103515245 + 12345) & 0x7fffffff;
    words.push(WORDS[seed % WORDS.length]);
  }
  return "Request " + (shared ? "" : i + " ") + ": " + words.join(" ") + (shared ? " (" + i + ")" : "") + ". Continue:";
}

async function fireBurst() {
  const count = Math.max(1, Math.min(512, parseInt($("burst-count").value, 10) || 16));
  const maxTokens = Math.max(1, parseInt($("burst-max-tokens").value, 10) || 64);
  const numWords = Math.max(1, parseInt($("burst-prompt-words").value, 10) || 40);
  const shared = $("burst-shared").value === "yes";
  const controller = new AbortController();
  view.burst = controller;
  $("burst").disabled = true;
  $("burst-cancel").disabled = false;
  // Browsers open at most 6 HTTP/1.1 connections per server, so the burst travels as a few
  // requests with a list of prompts each: every prompt is its own engine request.
  const numHttp = Math.min(4, count);
  let done = 0, failed = 0;
  const progress = () => { $("burst-progress").textContent = done + "/" + count + " done" + (failed ? ", " + failed + " failed" : ""); };
  progress();
  const one = async (part) => {
    const prompts = [];
    for (let i = part; i < count; i += numHttp) prompts.push(burstPrompt(i, numWords, shared));
    try {
      const response = await infer8.fetch("/v1/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify({
          model: view.model,
          prompt: prompts,
          max_tokens: maxTokens,
          temperature: 0.8,
          ignore_eos: true,
        }),
        signal: controller.signal,
      });
      await response.json();
      if (!response.ok) failed += prompts.length;
    } catch (err) {
      if (err.name !== "AbortError") failed += prompts.length;
    }
    done += prompts.length;
    progress();
  };
  await Promise.all(Array.from({ length: numHttp }, (_, part) => one(part)));
  view.burst = null;
  $("burst").disabled = false;
  $("burst-cancel").disabled = true;
}

document.addEventListener("DOMContentLoaded", async () => {
  const models = await infer8.unlock();
  view.model = models.data[0].id;
  $("burst").addEventListener("click", fireBurst);
  $("burst-cancel").addEventListener("click", () => { if (view.burst) view.burst.abort(); });
  window.addEventListener("resize", () => { view.dirty = true; });
  requestAnimationFrame(draw);
  connect();
});
