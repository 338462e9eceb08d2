// The status page: polls /api/status every second and updates the figures, pipeline, charts and logs in place.
"use strict";

const POLL_MS = 1000;
const EVENTS_SHOWN = 200;

// uint64 fields arrive as strings in the proto JSON mapping.
const num = (v) => Number(v || 0);

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

function bytes(n) {
  let v = num(n);
  for (const unit of ["B", "KiB", "MiB"]) {
    if (v < 1024) return unit === "B" ? `${v.toFixed(0)} B` : `${v.toFixed(1)} ${unit}`;
    v /= 1024;
  }
  return `${v.toFixed(1)} GiB`;
}

function duration(s) {
  s = Math.round(s);
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
  if (h) return `${h}h${String(m).padStart(2, "0")}m`;
  return m ? `${m}m${String(sec).padStart(2, "0")}s` : `${sec}s`;
}

function setText(id, text) {
  document.getElementById(id).textContent = text;
}

// The step driver's phases (scheduler/stepdriver.py) in words.
const PHASES = {
  dispatched: "computing microbatches", microbatches_done: "averaging gradients", norms_in: "deciding the update",
  decided: "applying the update", applied: "committing the step", committed: "step committed",
  evaluating: "validating",
};

function renderFigures(s) {
  const hasVal = s.history.some((p) => p.has_val_loss);
  const phase = PHASES[s.phase];
  setText("state", phase ? `${s.state}: ${phase}` : s.state);
  setText("step", `${num(s.step)} / ${num(s.steps)}`);
  setText("loss", s.history.length ? s.loss.toFixed(4) : "n/a");
  setText("val-loss", hasVal ? `${s.val_loss.toFixed(4)} (${s.val_bits_per_byte.toFixed(3)} bits/byte)` : "n/a");
  setText("tokens", s.history.length ? Math.round(s.tokens_per_s).toLocaleString("en") : "n/a");
  setText("eta", s.state === "training" && s.history.length ? duration(s.eta_s) : "n/a");
  setText("plan", `epoch ${num(s.plan_epoch)}, ${s.stages.length} stage(s)`);
  setText("bottleneck", s.bottleneck || "n/a");
  setText("failures", String(num(s.failures)));
}

// Colour from red (slowest) to green (fastest node); utilisation would replace speed once the cost model fills it.
function nodeColour(node, fastest) {
  if (!fastest) return "hsl(210, 40%, 86%)";
  const hue = Math.round(120 * Math.min(1, node.microbatches_per_s / fastest));
  return `hsl(${hue}, 60%, 78%)`;
}

function linkLabel(links, arrow) {
  return links.map((l) => {
    const bw = l.bandwidth_mbps ? `${l.bandwidth_mbps.toFixed(1)} Mbit/s` : "bandwidth n/a";
    const reversed = l.transport === "reversed" ? " (reversed: over the receiver's connection)"
      : l.transport.startsWith("relayed") ? ` (${l.transport})` : "";
    return `${arrow} ${l.src}→${l.dst}${reversed}: ${l.codec || "?"} ${l.compression_ratio.toFixed(2)}×, ${bw}`;
  });
}

function renderPipeline(s) {
  const nodes = new Map(s.nodes.map((n) => [n.node_id, n]));
  const fastest = Math.max(0, ...s.nodes.filter((n) => n.alive).map((n) => n.microbatches_per_s));
  const box = document.getElementById("pipeline");
  const parts = [];
  s.stages.forEach((stage, i) => {
    if (i > 0) {
      const prev = new Set(s.stages[i - 1].node_ids), cur = new Set(stage.node_ids);
      const fwd = s.links.filter((l) => prev.has(l.src) && cur.has(l.dst));
      const back = s.links.filter((l) => cur.has(l.src) && prev.has(l.dst));
      const link = el("div", "link");
      link.append(el("span", "arrow", "⇄"));
      for (const line of [...linkLabel(fwd, "▶"), ...linkLabel(back, "◀")]) link.append(el("span", "", line));
      if (!fwd.length && !back.length) link.append(el("span", "", "no traffic yet"));
      parts.push(link);
    }
    const col = el("div", "stage");
    col.dataset.stage = stage.index;
    const util = stage.utilisation ? `, ${Math.round(stage.utilisation * 100)}% busy` : "";
    col.append(el("h3", "", `stage ${stage.index} · layers ${stage.layer_start}–${stage.layer_end - 1}${util}`));
    for (const id of stage.node_ids) {
      const n = nodes.get(id);
      const card = el("div", "node");
      card.dataset.node = id;
      card.append(el("span", "id", id));
      if (n && !n.alive) {
        card.classList.add("dead");
        card.append(el("span", "gone", "gone"));
      }
      if (n) {
        card.style.background = nodeColour(n, fastest);
        card.append(el("div", "detail", `${n.region} · ${n.device || "?"} · ${n.role} · ${n.microbatches_per_s.toFixed(2)} microbatches/s`));
      }
      col.append(card);
    }
    parts.push(col);
  });
  if (!parts.length) parts.push(el("p", "", "waiting for nodes to join and a plan…"));
  box.replaceChildren(...parts);
}

function renderNodes(s) {
  const rows = s.nodes.map((n) => {
    const tr = el("tr", n.alive ? "" : "dead");
    tr.dataset.node = n.node_id;
    const staged = n.stage >= 0;
    for (const cell of [
      n.node_id, n.region, staged ? String(n.stage) : "-", staged ? `${n.layer_start}-${n.layer_end - 1}` : "-",
      n.role, n.alive ? "alive" : "gone", n.reachability || "-", n.device ? `${n.device} ${n.precision}` : "-", n.microbatches_per_s.toFixed(2), `${n.last_heartbeat_s.toFixed(1)}s ago`,
      bytes(n.bytes_received), bytes(n.bytes_sent), `${n.compression_ratio.toFixed(2)}×`,
    ]) tr.append(el("td", "", cell));
    return tr;
  });
  document.querySelector("#nodes tbody").replaceChildren(...rows);
}

// What went wrong, shown above everything else: an operator must not scroll the event log to see it.
const PROBLEMS = new Set(["failure", "dead", "aborted", "evicted", "clipped", "stopped"]);
const PROBLEMS_SHOWN = 5;

function renderProblems(s) {
  const problems = s.events.filter((e) => PROBLEMS.has(e.kind)).slice(-PROBLEMS_SHOWN).reverse();
  const box = document.getElementById("problems");
  box.hidden = !problems.length;
  const items = problems.map((e) => {
    const li = el("li", "problem");
    li.dataset.kind = e.kind;
    li.append(el("span", "time", new Date(e.at * 1000).toLocaleTimeString("en-GB") + " "));
    li.append(el("span", `kind kind-${e.kind}`, e.kind));
    li.append(document.createTextNode(` ${e.node_id} ${e.detail}`));
    return li;
  });
  const failures = num(s.failures), dead = s.nodes.filter((n) => !n.alive).length;
  document.getElementById("problems-summary").textContent =
    `${failures} failed step(s), ${dead} node(s) gone; the latest:`;
  document.getElementById("problem-list").replaceChildren(...items);
}

function renderEvents(s) {
  const items = s.events.slice(-EVENTS_SHOWN).reverse().map((e) => {
    const li = el("li");
    li.dataset.kind = e.kind;
    li.append(el("span", "time", new Date(e.at * 1000).toLocaleTimeString("en-GB") + " "));
    li.append(el("span", `kind kind-${e.kind}`, e.kind));
    li.append(document.createTextNode(` ${e.node_id} ${e.detail}`));
    return li;
  });
  document.getElementById("events").replaceChildren(...items);
}

function lineChart(id, xTitle, yTitle, datasets) {
  return new Chart(document.getElementById(id), {
    type: "line",
    data: { datasets },
    options: {
      // Redraws every second: animating them would only lag and blur the numbers.
      animation: false,
      responsive: true,
      maintainAspectRatio: false,
      parsing: false,
      scales: { x: { type: "linear", title: { display: true, text: xTitle } },
                y: { title: { display: true, text: yTitle } } },
    },
  });
}

const lossChart = lineChart("loss-chart", "step", "loss", [
  { label: "training", data: [], borderColor: "#1f5fbf", backgroundColor: "#1f5fbf", pointRadius: 0, borderWidth: 1.5 },
  { label: "validation", data: [], borderColor: "#d9730d", backgroundColor: "#d9730d", pointRadius: 3 },
]);
const tokensChart = lineChart("tokens-chart", "step", "tokens/s", [
  { label: "tokens/s", data: [], borderColor: "#17803d", backgroundColor: "#17803d", pointRadius: 0, borderWidth: 1.5 },
]);

function renderCharts(s) {
  const steps = s.history.map((p) => num(p.step) + 1);
  lossChart.data.datasets[0].data = s.history.map((p, i) => ({ x: steps[i], y: p.loss }));
  lossChart.data.datasets[1].data = s.history.flatMap((p, i) => (p.has_val_loss ? [{ x: steps[i], y: p.val_loss }] : []));
  tokensChart.data.datasets[0].data = s.history.map((p, i) => ({ x: steps[i], y: p.tokens_per_s }));
  // One x-axis for both, the run's steps: a step's loss and its speed sit one above the other.
  const last = Math.max(num(s.steps), steps.length ? steps[steps.length - 1] : 1);
  for (const chart of [lossChart, tokensChart]) {
    chart.options.scales.x.min = 1;
    chart.options.scales.x.max = last;
    chart.canvas.dataset.xAxis = `step 1-${last}`;
    chart.update();
    // The point count lets tests (and curious users) see that the chart grows without reading pixels.
    chart.canvas.dataset.points = String(chart.data.datasets[0].data.length);
  }
}

async function poll() {
  try {
    // A page behind a viewer token was opened as /?token=...: its data needs the same token.
    const reply = await fetch("/api/status" + location.search, { cache: "no-store" });
    if (!reply.ok) throw new Error(`HTTP ${reply.status}`);
    const s = await reply.json();
    renderFigures(s);
    renderProblems(s);
    renderPipeline(s);
    renderCharts(s);
    renderNodes(s);
    renderEvents(s);
    document.getElementById("offline").hidden = true;
  } catch {
    document.getElementById("offline").hidden = false;
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

poll();
