"""The live status page (/status): one self-contained HTML document, its CSS and JS inline, no external
fonts, scripts or images (its Content-Security-Policy forbids them). It polls /status.json every second
and draws its charts on <canvas> itself. Every number it shows is also in a DOM element with an id or a
data-field and its raw value in data-value, for scripts and tests."""

from __future__ import annotations

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Sluice status</title>
<style>
:root { --fg: #1e293b; --muted: #64748b; --line: #e2e8f0; --bg: #f8fafc; --card: #ffffff;
  --blue: #2563eb; --red: #dc2626; --green: #16a34a; --amber: #d97706; --violet: #7c3aed;
  --cyan: #0891b2; --slate: #64748b; }
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.4 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif;
  color: var(--fg); background: var(--bg); }
header { display: flex; align-items: baseline; gap: 16px; flex-wrap: wrap; padding: 14px 24px;
  background: #0f172a; color: #f1f5f9; }
header h1 { font-size: 20px; margin: 0; font-weight: 600; }
header .meta { color: #94a3b8; font-size: 13px; }
main { padding: 16px 24px 32px; max-width: 1500px; margin: 0 auto; }
.badge { display: inline-block; padding: 1px 8px; border-radius: 10px; font-size: 12px;
  font-weight: 600; background: #334155; color: #e2e8f0; }
.badge.ok { background: #166534; color: #dcfce7; }
.badge.bad { background: #991b1b; color: #fee2e2; }
.badge.warn { background: #92400e; color: #fef3c7; }
#banner { display: none; margin: 0 0 12px; padding: 8px 12px; border-radius: 6px;
  background: #fee2e2; color: #991b1b; }
.tiles { display: grid; grid-template-columns: repeat(auto-fill, minmax(230px, 1fr)); gap: 10px;
  margin-bottom: 16px; }
.tile { background: var(--card); border: 1px solid var(--line); border-radius: 8px; padding: 10px 12px; }
.tile .label { color: var(--muted); font-size: 12px; text-transform: uppercase; letter-spacing: .03em; }
.tile .value { font-size: 22px; font-weight: 600; font-variant-numeric: tabular-nums; margin-top: 2px; }
.tile .value small { font-size: 12px; color: var(--muted); font-weight: 400; }
.charts { display: grid; grid-template-columns: repeat(auto-fill, minmax(620px, 1fr)); gap: 12px;
  margin-bottom: 16px; }
.card { background: var(--card); border: 1px solid var(--line); border-radius: 8px; padding: 10px 14px; }
.card h2 { font-size: 14px; margin: 0 0 6px; font-weight: 600; }
.legend { display: flex; gap: 14px; flex-wrap: wrap; font-size: 12px; color: var(--muted);
  margin-bottom: 4px; min-height: 18px; }
.legend span.key { display: inline-block; width: 12px; height: 3px; margin-right: 5px;
  vertical-align: middle; }
.legend b { color: var(--fg); font-weight: 600; font-variant-numeric: tabular-nums; }
canvas { width: 100%; height: 190px; display: block; }
table { border-collapse: collapse; width: 100%; font-size: 13px; }
th, td { text-align: right; padding: 5px 8px; border-bottom: 1px solid var(--line); white-space: nowrap;
  font-variant-numeric: tabular-nums; }
th { color: var(--muted); font-weight: 600; font-size: 12px; }
th:first-child, td:first-child, td.text, th.text { text-align: left; }
.tables { display: grid; gap: 12px; }
.pipeline dl { display: grid; grid-template-columns: max-content 1fr; gap: 3px 14px; margin: 0; }
.pipeline dt { color: var(--muted); }
.pipeline dd { margin: 0; overflow-wrap: anywhere; }
.empty { color: var(--muted); font-style: italic; }
</style>
</head>
<body data-updates="0">
<header>
  <h1>Sluice</h1>
  <span class="meta" id="target"></span>
  <span id="health" class="badge">loading</span>
  <span class="meta">up <span id="uptime">-</span></span>
  <span class="meta">updated <span id="updated">-</span></span>
</header>
<main>
<div id="banner"></div>
<section class="tiles">
  <div class="tile"><div class="label">Input rate</div>
    <div class="value"><span id="v-input-rate" data-value="">-</span> <small>rec/s</small></div></div>
  <div class="tile"><div class="label">Rate limit</div>
    <div class="value"><span id="v-rate-limit" data-value="">-</span> <small>rec/s</small></div></div>
  <div class="tile"><div class="label">Processing rate</div>
    <div class="value"><span id="v-processing-rate" data-value="">-</span> <small>rec/s</small></div></div>
  <div class="tile"><div class="label">Scheduling delay</div>
    <div class="value"><span id="v-scheduling-delay" data-value="">-</span></div></div>
  <div class="tile"><div class="label">Batch duration</div>
    <div class="value"><span id="v-batch-duration" data-value="">-</span></div></div>
  <div class="tile"><div class="label">Buffered</div>
    <div class="value"><span id="v-buffered-records" data-value="">-</span> <small>rec</small>
    <small id="v-buffered-bytes" data-value="">-</small></div></div>
  <div class="tile"><div class="label">Block log on disk</div>
    <div class="value"><span id="v-wal-disk-bytes" data-value="">-</span></div></div>
  <div class="tile"><div class="label">Records received</div>
    <div class="value"><span id="v-records-received" data-value="">-</span>
    <small>acked <span id="v-records-acked" data-value="">-</span></small></div></div>
  <div class="tile"><div class="label">Sessions</div>
    <div class="value"><span id="v-sessions-active" data-value="">-</span></div></div>
  <div class="tile"><div class="label">Spark batches completed</div>
    <div class="value"><span id="v-batches" data-value="">-</span>
    <small>estimator <span id="v-estimator"></span></small></div></div>
</section>
<section class="charts">
  <div class="card"><h2>Rates (records/s)</h2><div class="legend" id="l-rates"></div>
    <canvas id="c-rates"></canvas></div>
  <div class="card"><h2>Batches (seconds)</h2><div class="legend" id="l-batches"></div>
    <canvas id="c-batches"></canvas></div>
  <div class="card"><h2>Buffered records</h2><div class="legend" id="l-buffer"></div>
    <canvas id="c-buffer"></canvas></div>
  <div class="card"><h2>Bytes: buffered and block log on disk</h2><div class="legend" id="l-bytes"></div>
    <canvas id="c-bytes"></canvas></div>
  <div class="card"><h2>Input rate by stream (records/s)</h2><div class="legend" id="l-streams"></div>
    <canvas id="c-streams"></canvas></div>
  <div class="card pipeline"><h2>Pipeline</h2><div id="pipeline"><span class="empty">-</span></div></div>
</section>
<section class="tables">
  <div class="card"><h2>Streams</h2><table id="streams"><thead><tr>
    <th class="text">stream</th><th class="text">state</th><th>input/s</th><th>rate limit</th>
    <th class="text">share</th><th>received</th><th>acked</th><th>buffered</th><th>buffered bytes</th>
    <th>on disk</th><th>backlog</th><th>sessions</th><th class="text">credit paused</th>
  </tr></thead><tbody></tbody></table></div>
  <div class="card"><h2>Sessions</h2><table id="sessions"><thead><tr>
    <th class="text">id</th><th class="text">stream</th><th class="text">principal</th>
    <th class="text">producer</th><th>credit</th><th>next seq</th><th>durable up to</th>
    <th class="text">state</th></tr></thead><tbody></tbody></table></div>
  <div class="card"><h2>Last batches</h2><table id="batches"><thead><tr>
    <th class="text">batch</th><th class="text">completed</th><th>records</th><th>processing rate</th>
    <th>scheduling delay</th><th>duration</th></tr></thead><tbody></tbody></table></div>
</section>
</main>
<script>
"use strict";
const WINDOWS = [60, 120, 300];  // seconds shown in the charts: the smallest that holds the history
let WINDOW = 60;
const PALETTE = ["#2563eb", "#16a34a", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#65a30d", "#475569"];
let updates = 0;

window.addEventListener("error", (e) => { document.body.dataset.errors = String(e.message); });

function fmtNum(v) {
  if (v === null || v === undefined || Number.isNaN(v)) return "-";
  const a = Math.abs(v);
  if (a >= 1e9) return (v / 1e9).toFixed(2) + "G";
  if (a >= 1e6) return (v / 1e6).toFixed(2) + "M";
  if (a >= 1e4) return (v / 1e3).toFixed(1) + "k";
  if (a >= 100 || Number.isInteger(v)) return Math.round(v).toLocaleString("en-US");
  return v.toFixed(1);
}
function fmtInt(v) { return v === null || v === undefined ? "-" : Math.round(v).toLocaleString("en-US"); }
function fmtRate(v) { return v === null || v === undefined ? "unlimited" : fmtNum(v); }
function fmtBytes(v) {
  if (v === null || v === undefined) return "-";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return (i === 0 ? Math.round(v) : v.toFixed(1)) + " " + units[i];
}
function fmtSec(v) {
  if (v === null || v === undefined) return "-";
  return v < 1 ? Math.round(v * 1000) + " ms" : v.toFixed(2) + " s";
}
function fmtAgo(s) {
  s = Math.max(0, Math.round(s));
  const d = Math.floor(s / 86400), h = Math.floor(s % 86400 / 3600), m = Math.floor(s % 3600 / 60);
  return d ? d + "d " + h + "h" : h ? h + "h " + m + "m" : m ? m + "m " + s % 60 + "s" : s + "s";
}
function setValue(id, value, text) {
  const el = document.getElementById(id);
  el.dataset.value = value === null || value === undefined ? "" : String(value);
  el.textContent = text;
}
function cell(row, text, value, field, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (field) {
    td.dataset.field = field;
    td.dataset.value = value === null || value === undefined ? "" : String(value);
  }
  if (cls) td.className = cls;
  row.appendChild(td);
}
function fillTable(id, rows, build, emptyText) {
  const body = document.querySelector("#" + id + " tbody");
  body.replaceChildren();
  if (!rows.length) {
    const tr = document.createElement("tr");
    const td = document.createElement("td");
    td.colSpan = document.querySelectorAll("#" + id + " th").length;
    td.className = "empty";
    td.textContent = emptyText;
    tr.appendChild(td);
    body.appendChild(tr);
    return;
  }
  for (const r of rows) { const tr = document.createElement("tr"); build(tr, r); body.appendChild(tr); }
}

function niceStep(range, ticks) {
  const raw = range / ticks, p = Math.pow(10, Math.floor(Math.log10(raw))), f = raw / p;
  return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * p;
}
// series: [{name, color, t: [...epoch s], v: [...], dash, points}]; fmt formats the y axis
function drawChart(canvasId, legendId, series, now, fmt) {
  const canvas = document.getElementById(canvasId);
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
    canvas.width = Math.round(w * dpr); canvas.height = Math.round(h * dpr);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, h);
  const left = 64, right = 10, top = 8, bottom = 22;
  const pw = w - left - right, ph = h - top - bottom;
  let max = 0;
  for (const s of series) for (const v of s.v) if (v !== null && v > max) max = v;
  if (max <= 0) max = 1;
  const step = niceStep(max, 4);
  const ymax = Math.ceil(max * 1.05 / step) * step;
  const x = (t) => left + pw * (1 - (now - t) / WINDOW), y = (v) => top + ph * (1 - v / ymax);
  ctx.font = "11px system-ui, sans-serif";
  ctx.fillStyle = "#64748b"; ctx.strokeStyle = "#e2e8f0"; ctx.lineWidth = 1;
  ctx.textAlign = "right"; ctx.textBaseline = "middle";
  for (let v = 0; v <= ymax + step / 2; v += step) {
    const yy = Math.round(y(v)) + 0.5;
    ctx.beginPath(); ctx.moveTo(left, yy); ctx.lineTo(left + pw, yy); ctx.stroke();
    ctx.fillText(fmt(v), left - 6, yy);
  }
  ctx.textAlign = "center"; ctx.textBaseline = "top";
  for (let ago = WINDOW; ago >= 0; ago -= WINDOW / 5) {
    const xx = Math.round(x(now - ago)) + 0.5;
    ctx.beginPath(); ctx.moveTo(xx, top); ctx.lineTo(xx, top + ph); ctx.stroke();
    const label = ago >= 60 && ago % 60 === 0 ? "-" + ago / 60 + " min" : "-" + ago + " s";
    ctx.fillText(ago ? label : "now", Math.min(xx, left + pw - 14), top + ph + 5);
  }
  ctx.save();
  ctx.beginPath(); ctx.rect(left, top, pw, ph); ctx.clip();
  for (const s of series) {
    ctx.strokeStyle = s.color; ctx.fillStyle = s.color; ctx.lineWidth = 2;
    ctx.setLineDash(s.dash ? [6, 4] : []);
    ctx.beginPath();
    let drawing = false;
    for (let i = 0; i < s.t.length; i++) {
      const v = s.v[i];
      if (v === null || v === undefined) { drawing = false; continue; }
      if (drawing) ctx.lineTo(x(s.t[i]), y(v)); else ctx.moveTo(x(s.t[i]), y(v));
      drawing = true;
    }
    ctx.stroke();
    if (s.points) {
      for (let i = 0; i < s.t.length; i++) {
        if (s.v[i] === null || s.v[i] === undefined) continue;
        ctx.beginPath(); ctx.arc(x(s.t[i]), y(s.v[i]), 2.5, 0, 2 * Math.PI); ctx.fill();
      }
    }
  }
  ctx.restore();
  ctx.setLineDash([]);
  const legend = document.getElementById(legendId);
  legend.replaceChildren();
  for (const s of series) {
    const item = document.createElement("span");
    const key = document.createElement("span");
    key.className = "key"; key.style.background = s.color;
    const last = [...s.v].reverse().find((v) => v !== null && v !== undefined);
    const b = document.createElement("b");
    b.textContent = last === undefined ? (s.none || "-") : fmt(last);
    item.append(key, s.name + " ", b);
    legend.appendChild(item);
  }
}

function render(d) {
  const now = d.time, h = d.history, b = d.batches, tot = d.totals, lb = d.last_batch;
  const oldest = Math.min(h.t.length ? h.t[0] : now, b.t.length ? b.t[0] : now);
  WINDOW = WINDOWS.find((w) => now - oldest <= w) || WINDOWS[WINDOWS.length - 1];
  document.getElementById("target").textContent =
    (d.target || "") + (d.transport ? " \\u00b7 " + d.transport : "");
  const health = document.getElementById("health");
  health.textContent = d.health;
  health.className = "badge " + (d.health === "SERVING" ? "ok" : "bad");
  document.getElementById("uptime").textContent = fmtAgo(now - d.started);
  document.getElementById("updated").textContent = new Date(now * 1000).toLocaleTimeString("en-GB");
  setValue("v-input-rate", d.rate.input, fmtNum(d.rate.input));
  setValue("v-rate-limit", d.rate.limit, fmtRate(d.rate.limit));
  setValue("v-processing-rate", lb ? lb.processing_rate : null, fmtNum(lb ? lb.processing_rate : null));
  setValue("v-scheduling-delay", lb ? lb.scheduling_delay : null, fmtSec(lb ? lb.scheduling_delay : null));
  setValue("v-batch-duration", lb ? lb.batch_duration : null, fmtSec(lb ? lb.batch_duration : null));
  setValue("v-buffered-records", tot.buffered_records, fmtInt(tot.buffered_records));
  setValue("v-buffered-bytes", tot.buffered_bytes, fmtBytes(tot.buffered_bytes));
  setValue("v-wal-disk-bytes", tot.wal_disk_bytes, fmtBytes(tot.wal_disk_bytes));
  setValue("v-records-received", tot.records_received_total, fmtInt(tot.records_received_total));
  setValue("v-records-acked", tot.records_acked_total, fmtInt(tot.records_acked_total));
  setValue("v-sessions-active", tot.sessions_active, fmtInt(tot.sessions_active));
  setValue("v-batches", d.batches_completed, fmtInt(d.batches_completed));
  document.getElementById("v-estimator").textContent =
    d.rate.estimator + (d.rate.pinned ? ", pinned" : "");

  drawChart("c-rates", "l-rates", [
    { name: "input", color: "#2563eb", t: h.t, v: h.input_rate },
    { name: "limit", color: "#dc2626", t: h.t, v: h.rate_limit, dash: true, none: "unlimited" },
    { name: "processing", color: "#16a34a", t: b.t, v: b.processing_rate, points: true },
  ], now, fmtNum);
  drawChart("c-batches", "l-batches", [
    { name: "scheduling delay", color: "#d97706", t: b.t, v: b.scheduling_delay, points: true },
    { name: "batch duration", color: "#7c3aed", t: b.t, v: b.batch_duration, points: true },
  ], now, (v) => fmtSec(v));
  drawChart("c-buffer", "l-buffer", [
    { name: "buffered records", color: "#0891b2", t: h.t, v: h.buffered_records },
  ], now, fmtNum);
  drawChart("c-bytes", "l-bytes", [
    { name: "buffered", color: "#0891b2", t: h.t, v: h.buffered_bytes },
    { name: "block log on disk", color: "#64748b", t: h.t, v: h.wal_disk_bytes },
  ], now, fmtBytes);
  drawChart("c-streams", "l-streams", Object.keys(h.streams).sort().map((name, i) => (
    { name: name, color: PALETTE[i % PALETTE.length], t: h.t, v: h.streams[name] })), now, fmtNum);

  fillTable("streams", d.streams, (tr, s) => {
    tr.dataset.stream = s.stream;
    cell(tr, s.stream, s.stream, "stream");
    cell(tr, s.state, s.state, "state", "text");
    cell(tr, fmtNum(s.input_rate), s.input_rate, "input_rate");
    cell(tr, s.state === "serving" ? fmtRate(s.rate_limit) : "-", s.rate_limit, "rate_limit");
    cell(tr, s.share || "", s.share, "share", "text");
    cell(tr, fmtInt(s.records_received_total), s.records_received_total, "records_received_total");
    cell(tr, fmtInt(s.records_acked_total), s.records_acked_total, "records_acked_total");
    cell(tr, fmtInt(s.buffered_records), s.buffered_records, "buffered_records");
    cell(tr, fmtBytes(s.buffered_bytes), s.buffered_bytes, "buffered_bytes");
    cell(tr, fmtBytes(s.wal_disk_bytes), s.wal_disk_bytes, "wal_disk_bytes");
    cell(tr, fmtInt(s.backlog), s.backlog, "backlog");
    cell(tr, fmtInt(s.sessions_active), s.sessions_active, "sessions_active");
    cell(tr, s.credit_paused.join(", "), s.credit_paused.join(","), "credit_paused", "text");
  }, "no streams");
  fillTable("sessions", d.sessions, (tr, s) => {
    tr.dataset.session = String(s.session_id);
    cell(tr, String(s.session_id), s.session_id, "session_id", "text");
    cell(tr, s.stream, s.stream, "stream", "text");
    cell(tr, s.principal, s.principal, "principal", "text");
    cell(tr, s.producer_id, s.producer_id, "producer_id", "text");
    cell(tr, fmtInt(s.credit), s.credit, "credit");
    cell(tr, fmtInt(s.next_seq), s.next_seq, "next_seq");
    cell(tr, fmtInt(s.durable_up_to), s.durable_up_to, "durable_up_to");
    cell(tr, s.state, s.state, "state", "text");
  }, "no open sessions");
  const recent = b.t.map((t, i) => i).slice(-10).reverse();
  fillTable("batches", recent, (tr, i) => {
    cell(tr, "#" + b.batch_id[i], b.batch_id[i], "batch_id", "text");
    cell(tr, new Date(b.t[i] * 1000).toLocaleTimeString("en-GB"), b.t[i], "t", "text");
    cell(tr, fmtInt(b.records[i]), b.records[i], "records");
    cell(tr, fmtNum(b.processing_rate[i]), b.processing_rate[i], "processing_rate");
    cell(tr, fmtSec(b.scheduling_delay[i]), b.scheduling_delay[i], "scheduling_delay");
    cell(tr, fmtSec(b.batch_duration[i]), b.batch_duration[i], "batch_duration");
  }, "no batch completed yet");

  const box = document.getElementById("pipeline");
  box.replaceChildren();
  const p = d.pipeline;
  if (!p) {
    const none = document.createElement("span");
    none.className = "empty"; none.id = "pipeline-state"; none.dataset.value = "";
    none.textContent = "no Spark query on this node";
    box.appendChild(none);
  } else {
    const dl = document.createElement("dl");
    const item = (label, text, id) => {
      const dt = document.createElement("dt"); dt.textContent = label;
      const dd = document.createElement("dd"); dd.textContent = text;
      if (id) { dd.id = id; dd.dataset.value = text; }
      dl.append(dt, dd);
    };
    item("pipeline", p.pipeline, "pipeline-name");
    item("state", p.state, "pipeline-state");
    item("generation", String(p.generation), "pipeline-generation");
    item("trigger", fmtSec(p.trigger_interval));
    item("query", p.query_id || "-");
    const s = p.last_swap;
    item("last swap", s ? s.from + " \\u2192 " + s.to + ": " + s.outcome + " in " + fmtSec(s.duration) +
      (s.error ? " (" + s.error + ")" : "") : "none");
    box.appendChild(dl);
  }
  document.getElementById("banner").style.display = "none";
  updates += 1;
  document.body.dataset.updates = String(updates);
  document.body.dataset.snapshotTime = String(now);
}

async function poll() {
  try {
    const response = await fetch("status.json", { cache: "no-store" });
    if (!response.ok) throw new Error("HTTP " + response.status);
    render(await response.json());
  } catch (e) {
    const banner = document.getElementById("banner");
    banner.textContent = "cannot read status.json: " + e.message + " (retrying every second)";
    banner.style.display = "block";
  }
}
poll();
setInterval(poll, 1000);
window.addEventListener("resize", poll);
</script>
</body>
</html>
"""
