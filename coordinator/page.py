"""The status page: static HTML whose script polls /api/status and /api/links every two
seconds and draws the job's progress (step of the run's total, with the time left at the
recent pace), the rank table, the straggler (the rank the others wait for, if one is),
the slow link and a rank x rank heat map of the peer links (up to HEATMAP_RANKS ranks;
the busiest links as a table at any size), rank 0's training and held-out loss, its
throughput and its share of time spent waiting for collectives over the run (SVG) and
the event log."""

HEATMAP_RANKS = 64  # above this many ranks the page lists the busiest links only

STATUS_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>shardwire status</title>
<style>
  body { font: 14px system-ui, sans-serif; margin: 1.5em; color: #222; }
  h1 { font-size: 1.3em; margin: 0 0 .2em; }
  #summary { color: #555; margin-bottom: 1em; }
  table { border-collapse: collapse; margin-bottom: 1.5em; }
  th, td { border: 1px solid #ccc; padding: .25em .6em; text-align: right; }
  th { background: #f3f3f3; }
  td.text { text-align: left; }
  .failed { color: #b00; font-weight: bold; }
  #events { font-family: monospace; white-space: pre-wrap; background: #fafafa;
            border: 1px solid #ddd; padding: .5em; max-height: 15em; overflow: auto; }
  svg { border: 1px solid #ddd; background: #fff; }
  #heatmap rect.slow { stroke: #b00; stroke-width: 2; }
  .note { color: #666; max-width: 46em; }
</style>
</head>
<body>
<h1>shardwire</h1>
<div id="summary">loading...</div>
<div id="progress"><progress id="progress-bar" max="1" value="0"></progress>
  <span id="progress-text"></span></div>
<div id="straggler" class="failed"></div>
<table id="ranks">
  <thead><tr><th>rank</th><th>host</th><th>node</th><th>state</th><th>step</th>
  <th>heartbeat (s)</th><th>samples/s</th><th>loss</th><th>sent MiB</th>
  <th>received MiB</th><th>busy</th></tr></thead>
  <tbody></tbody>
</table>
<h2>links</h2>
<div id="slowlink" class="failed"></div>
<label>colour by <select id="figure">
  <option value="bytes">bytes sent</option>
  <option value="bandwidth">bandwidth</option>
  <option value="rtt_s">round trip</option>
</select></label>
<div><svg id="heatmap" width="360" height="360" role="img" aria-label="links heat map"></svg></div>
<table id="links">
  <thead><tr><th>from</th><th>to</th><th>path</th><th>sent MiB</th><th>messages</th>
  <th>MB/s</th><th>round trip (ms)</th></tr></thead>
  <tbody></tbody>
</table>
<p class="note">A row is the sender, a column the receiver; darker means more bytes (from
white for none to the busiest link, and never dark below 1 MiB), less bandwidth or a
longer round trip. Ranks of one node move their collectives through the
node's shared-memory arena, which is not a link: that traffic is in the rank table.</p>
<h2>generations</h2>
<table id="generations">
  <thead><tr><th>generation</th><th>ranks</th><th>nodes</th><th>started</th>
  <th>ran (s)</th><th>ended by</th></tr></thead>
  <tbody></tbody>
</table>
<h2>loss (rank 0)</h2>
<svg id="loss" width="640" height="240" role="img" aria-label="loss curves"></svg>
<h2>throughput and waiting (rank 0)</h2>
<svg id="throughput" width="640" height="200" role="img" aria-label="throughput"></svg>
<svg id="waiting" width="640" height="160" role="img" aria-label="waiting share"></svg>
<h2>events</h2>
<div id="events"></div>
<script>
const MiB = 1024 * 1024;
function cell(text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}
// A line chart of named series ({name, color, points: [{x, y}]}) with a legend; the
// y axis starts at zero where asked (heights compared), else at the lowest value.
function drawChart(id, series, {fromZero = false, yMax = null, unit = ""} = {}) {
  const svg = document.getElementById(id);
  const w = +svg.getAttribute("width"), h = +svg.getAttribute("height"), pad = 34;
  const ns = "http://www.w3.org/2000/svg";
  svg.innerHTML = "";
  const shown = series.filter(s => s.points.length > 0);
  const all = shown.flatMap(s => s.points);
  if (all.length < 2) return;
  const xs = all.map(p => p.x), ys = all.map(p => p.y);
  const x0 = Math.min(...xs), x1 = Math.max(...xs);
  const y0 = fromZero ? 0 : Math.min(...ys), y1 = yMax === null ? Math.max(...ys) : yMax;
  const sx = x => pad + (x - x0) / Math.max(x1 - x0, 1e-9) * (w - 2 * pad);
  const sy = v => h - pad - (v - y0) / Math.max(y1 - y0, 1e-9) * (h - 2 * pad);
  const text = (t, x, y, color) => {
    const label = document.createElementNS(ns, "text");
    label.setAttribute("x", x); label.setAttribute("y", y);
    label.setAttribute("font-size", "11"); label.textContent = t;
    if (color) label.setAttribute("fill", color);
    svg.appendChild(label);
  };
  shown.forEach((s, i) => {
    const line = document.createElementNS(ns, "path");
    const d = s.points.map((p, j) => (j ? "L" : "M") + sx(p.x) + " " + sy(p.y));
    line.setAttribute("d", d.join(" "));
    line.setAttribute("fill", "none");
    line.setAttribute("stroke", s.color);
    line.setAttribute("stroke-width", "2");
    line.setAttribute("id", s.id);
    svg.appendChild(line);
    text("\u2014 " + s.name, w - 190, 14 + 14 * i, s.color);
  });
  const fmt = v => Math.abs(v) >= 100 ? v.toFixed(0) : v.toPrecision(3);
  text(fmt(y1) + unit, 2, pad, null);
  text(fmt(y0) + unit, 2, h - pad, null);
  text("step " + x1, w - 90, h - 8, null);
}
function duration(s) {
  if (s < 60) return `${Math.round(s)} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
  return `${Math.floor(s / 3600)} h ${Math.round((s % 3600) / 60)} min`;
}
function drawProgress(p, state) {
  const bar = document.getElementById("progress-bar");
  const label = document.getElementById("progress-text");
  if (!p.total_steps) {
    bar.style.display = "none";
    label.textContent = p.step ? `step ${p.step} (the script gave no total)` : "";
    return;
  }
  bar.style.display = "";
  bar.value = Math.min(1, p.step / p.total_steps);
  const share = Math.floor(100 * p.step / p.total_steps);
  const left = state !== "running" ? "" : p.eta_s === null ? ", time left: not known yet"
    : `, about ${duration(p.eta_s)} left`;
  label.textContent = `step ${p.step} of ${p.total_steps} (${share} %)${left}`;
}
const HEATMAP_RANKS = __HEATMAP_RANKS__;
function shade(link, figure, lo, hi) {
  const v = link[figure];
  if (v === null || v === undefined) return "#eee";
  if (figure === "bytes" && v === 0) return "#fff";
  let t;
  if (figure === "bytes") {  // from zero, and at least a MiB for the darkest: a link
    t = v / Math.max(hi, MiB);  // that moved next to nothing is never dark
  } else {
    t = hi > lo ? (v - lo) / (hi - lo) : 1;
  }
  if (figure === "bandwidth") t = 1 - t;  // slow links dark
  const light = Math.round(92 - 62 * t);
  return `hsl(210, 70%, ${light}%)`;
}
function drawLinks(l) {
  const figure = document.getElementById("figure").value;
  document.getElementById("slowlink").textContent = l.slow ? `slow link: ${l.slow.text}` : "";
  const svg = document.getElementById("heatmap");
  svg.innerHTML = "";
  const n = l.world_size, ns = "http://www.w3.org/2000/svg";
  const values = l.links.map(k => k[figure]).filter(v => v !== null && v !== undefined);
  const lo = Math.min(...values), hi = Math.max(...values);
  svg.style.display = n > 0 && n <= HEATMAP_RANKS ? "" : "none";
  if (n > 0 && n <= HEATMAP_RANKS) {
    const size = 360, pad = 24, cell = (size - pad) / n;
    const cells = new Map();
    for (const k of l.links) {
      const key = `${k.src}-${k.dst}`;
      const had = cells.get(key);  // tcp and shm of one pair: the busier one colours it
      if (!had || k.bytes > had.bytes) cells.set(key, k);
    }
    for (const [key, k] of cells) {
      const r = document.createElementNS(ns, "rect");
      r.setAttribute("id", "link-" + key);
      r.setAttribute("x", pad + k.dst * cell); r.setAttribute("y", pad + k.src * cell);
      r.setAttribute("width", cell); r.setAttribute("height", cell);
      r.setAttribute("fill", shade(k, figure, lo, hi));
      if (l.slow && l.slow.src === k.src && l.slow.dst === k.dst) r.setAttribute("class", "slow");
      const title = document.createElementNS(ns, "title");
      title.textContent = `rank ${k.src} -> rank ${k.dst} (${k.path}): ` +
        `${(k.bytes / MiB).toFixed(1)} MiB` +
        (k.bandwidth === null ? "" : `, ${(k.bandwidth / 1e6).toFixed(1)} MB/s`) +
        (k.rtt_s === null ? "" : `, round trip ${(k.rtt_s * 1e3).toFixed(2)} ms`);
      r.appendChild(title);
      svg.appendChild(r);
    }
    const step = Math.max(1, Math.ceil(n / 16));
    for (let i = 0; i < n; i += step) {
      for (const [x, y] of [[pad + (i + 0.3) * cell, 14], [2, pad + (i + 0.7) * cell]]) {
        const label = document.createElementNS(ns, "text");
        label.setAttribute("x", x); label.setAttribute("y", y);
        label.setAttribute("font-size", "10"); label.textContent = i;
        svg.appendChild(label);
      }
    }
  }
  const body = document.querySelector("#links tbody");
  body.innerHTML = "";
  for (const k of l.links.slice(0, 20)) {
    const tr = document.createElement("tr");
    tr.append(cell(k.src), cell(k.dst), cell(k.path, "text"), cell((k.bytes / MiB).toFixed(1)),
              cell(k.messages), cell(k.bandwidth === null ? "" : (k.bandwidth / 1e6).toFixed(1)),
              cell(k.rtt_s === null ? "" : (k.rtt_s * 1e3).toFixed(2)));
    body.appendChild(tr);
  }
  if (l.total > 20) {
    const tr = document.createElement("tr");
    tr.append(cell(`${l.total - 20} quieter links not listed (/api/links)`, "text"));
    body.appendChild(tr);
  }
}
let lastLinks = null;
document.getElementById("figure").addEventListener(
  "change", () => lastLinks && drawLinks(lastLinks));
async function refresh() {
  try {
    const s = await (await fetch("/api/status")).json();
    document.getElementById("summary").textContent =
      `run ${s.run_id}: ${s.state}, world size ${s.world_size}, generation ${s.generation}` +
      (s.max_restarts ? `, restarts ${s.restarts} of ${s.max_restarts}` : "") +
      (s.failure ? ` - failure: ${s.failure}` : "");
    document.getElementById("straggler").textContent =
      s.straggler ? `straggler: ${s.straggler}` : "";
    const gens = document.querySelector("#generations tbody");
    gens.innerHTML = "";
    for (const g of s.generations) {
      const tr = document.createElement("tr");
      tr.append(cell(g.generation), cell(g.world_size), cell(g.nodes),
                cell(new Date(g.started_at * 1000).toLocaleTimeString(), "text"),
                cell(g.duration_s === null ? "running" : g.duration_s.toFixed(1)),
                cell(g.ended_by, g.ended_by && g.ended_by !== "finished" ? "text failed" : "text"));
      gens.appendChild(tr);
    }
    const body = document.querySelector("#ranks tbody");
    body.innerHTML = "";
    for (const r of s.ranks) {
      const tr = document.createElement("tr");
      tr.append(cell(r.rank), cell(r.host, "text"), cell(r.node_id, "text"),
                cell(r.state, r.state === "failed" ? "text failed" : "text"), cell(r.step),
                cell(r.heartbeat_age_s.toFixed(1)), cell(r.samples_per_s.toFixed(0)),
                cell(r.loss === null ? "" : r.loss.toFixed(4)),
                cell((r.bytes_sent / MiB).toFixed(1)), cell((r.bytes_received / MiB).toFixed(1)),
                cell(r.busy_s ? `${r.busy_s.toFixed(0)} s at ${r.busy_at}` : "", "text busy"));
      if (r.busy_stack) tr.title = r.busy_stack;
      body.appendChild(tr);
    }
    if (s.total > s.ranks.length) {
      const tr = document.createElement("tr");
      tr.append(cell(`ranks ${s.offset + s.ranks.length} to ${s.total - 1} not shown ` +
                     `(/api/status?offset=${s.offset + s.ranks.length})`, "text"));
      body.appendChild(tr);
    }
    drawProgress(s.progress, s.state);
    drawChart("loss", [
      {name: "training loss", color: "#1f77b4", id: "loss-line",
       points: s.losses.map(p => ({x: p.step, y: p.loss}))},
      {name: "held-out loss", color: "#ff7f0e", id: "held-out-line",
       points: s.held_out.map(p => ({x: p.step, y: p.loss}))}]);
    drawChart("throughput", [
      {name: "samples/s", color: "#2ca02c", id: "throughput-line",
       points: s.throughput.filter(p => p.samples_per_s > 0)
                           .map(p => ({x: p.step, y: p.samples_per_s}))}], {fromZero: true});
    drawChart("waiting", [
      {name: "waiting for collectives", color: "#d62728", id: "waiting-line",
       points: s.throughput.filter(p => p.comm_share !== null)
                           .map(p => ({x: p.step, y: 100 * p.comm_share}))}],
      {fromZero: true, yMax: 100, unit: " %"});
    lastLinks = await (await fetch("/api/links")).json();
    drawLinks(lastLinks);
    document.getElementById("events").textContent = s.events.map(
      e => new Date(e.time * 1000).toLocaleTimeString() + "  " + e.text).join("\\n");
  } catch (err) {
    document.getElementById("summary").textContent = "coordinator unreachable: " + err;
  }
}
refresh();
setInterval(refresh, 2000);
</script>
</body>
</html>
"""
STATUS_PAGE = STATUS_PAGE.replace("__HEATMAP_RANKS__", str(HEATMAP_RANKS))
