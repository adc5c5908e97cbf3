"""The status page: static HTML whose script polls /api/status every two seconds and
draws the rank table, the straggler (the rank the others wait for, if one is), rank 0's
loss curve (SVG) and the event log."""

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
</style>
</head>
<body>
<h1>shardwire</h1>
<div id="summary">loading...</div>
<div id="straggler" class="failed"></div>
<table id="ranks">
  <thead><tr><th>rank</th><th>host</th><th>node</th><th>state</th><th>step</th>
  <th>heartbeat (s)</th><th>samples/s</th><th>loss</th><th>sent MiB</th>
  <th>received MiB</th><th>busy</th></tr></thead>
  <tbody></tbody>
</table>
<h2>generations</h2>
<table id="generations">
  <thead><tr><th>generation</th><th>ranks</th><th>nodes</th><th>started</th>
  <th>ran (s)</th><th>ended by</th></tr></thead>
  <tbody></tbody>
</table>
<h2>loss (rank 0)</h2>
<svg id="loss" width="640" height="240" role="img" aria-label="loss curve"></svg>
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
function drawLoss(points) {
  const svg = document.getElementById("loss");
  const w = 640, h = 240, pad = 30;
  svg.innerHTML = "";
  if (points.length < 2) return;
  const xs = points.map(p => p.step), ys = points.map(p => p.loss);
  const x0 = Math.min(...xs), x1 = Math.max(...xs);
  const y0 = Math.min(...ys), y1 = Math.max(...ys);
  const sx = s => pad + (s - x0) / Math.max(x1 - x0, 1e-9) * (w - 2 * pad);
  const sy = v => h - pad - (v - y0) / Math.max(y1 - y0, 1e-9) * (h - 2 * pad);
  const path = points.map((p, i) => (i ? "L" : "M") + sx(p.step) + " " + sy(p.loss));
  const ns = "http://www.w3.org/2000/svg";
  const line = document.createElementNS(ns, "path");
  line.setAttribute("d", path.join(" "));
  line.setAttribute("fill", "none");
  line.setAttribute("stroke", "#1f77b4");
  line.setAttribute("stroke-width", "2");
  line.setAttribute("id", "loss-line");
  svg.appendChild(line);
  for (const [text, x, y] of [[y1.toFixed(3), 2, pad], [y0.toFixed(3), 2, h - pad],
                              ["step " + x1, w - 90, h - 8]]) {
    const label = document.createElementNS(ns, "text");
    label.setAttribute("x", x); label.setAttribute("y", y);
    label.setAttribute("font-size", "11"); label.textContent = text;
    svg.appendChild(label);
  }
}
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
    drawLoss(s.losses);
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
