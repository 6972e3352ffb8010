// GanttView's drawing, in the browser: panels of Timelines (and step curves) as SVG.
// Python sends data (see gantt.py); this file only draws. Play, zoom and hover run here,
// so they work without a kernel (a static page keeps them).

const LANE = 28, BAR = 15, STRIP = 5, LEFT = 66, RIGHT = 14, TOP = 24, BOTTOM = 30;
const STYLE = `
.mp-gantt .legend { display: flex; gap: 12px; flex-wrap: wrap; margin: 0 0 4px ${LEFT}px; }
.mp-gantt .chip { display: inline-block; width: 11px; height: 11px; margin-right: 4px;
                  vertical-align: -1px; border-radius: 2px; }
`;

// Round tick positions covering [lo, hi], about `count` of them.
function ticks(lo, hi, count) {
  const raw = (hi - lo) / Math.max(count, 1);
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw) || raw;
  const out = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) out.push(t);
  return { values: out, step };
}

function fmt(ms, step) {
  const digits = step >= 1 ? 0 : Math.min(3, Math.ceil(-Math.log10(step)));
  return ms.toFixed(digits);
}

function render({ model, el: host }) {
  const root = viewRoot(host, "mp-gantt", STYLE);
  const bar = html("div", "bar", root);
  const play = html("button", "play", bar, "\u25B6 play");
  const slider = html("input", "time", bar);
  Object.assign(slider, { type: "range", min: 0, max: 1000, value: 1000 });
  const readout = html("span", "readout", bar);
  const reset = html("button", "reset", bar, "reset zoom");
  html("span", "hint", bar, "wheel: zoom \u00B7 drag: pan \u00B7 hover: details");
  const reason = html("div", "reason", root);
  const legend = html("div", "legend", root);
  const body = html("div", "panels", root);
  const tip = html("div", "tip", root);

  let cursor = 1;  // fraction of each playing panel's axis shown; 1 = everything
  let view = [0, 1];  // the zoomed window, as fractions of every panel's axis
  let frame = null, dragging = null, draws = 0;

  function playing() { return model.get("panels").filter((p) => p.plays); }

  function drawLegend(panels) {
    legend.replaceChildren();
    const seen = new Map();
    for (const p of panels) {
      if (p.kind !== "gantt") continue;
      const used = new Set(p.events.map((e) => e[1]));
      for (const [kind, color] of Object.entries(p.colors)) if (used.has(kind)) seen.set(kind, color);
    }
    for (const [kind, color] of seen) {
      const item = html("span", "", legend);
      html("span", "chip", item).style.background = color;
      item.appendChild(document.createTextNode(kind));
    }
  }

  function frameOf(svg, width, height, panel) {
    const plotW = width - LEFT - RIGHT;
    const lo = view[0] * panel.axis_ms, hi = view[1] * panel.axis_ms;
    const x = (ms) => LEFT + ((ms - lo) / (hi - lo)) * plotW;
    const clipId = `clip${Math.random().toString(36).slice(2)}`;
    const clip = el("clipPath", { id: clipId }, el("defs", {}, svg));
    el("rect", { x: LEFT, y: 0, width: plotW, height }, clip);
    el("text", { x: LEFT, y: 15, "font-weight": 600, "font-size": 12 }, svg).textContent = panel.title;
    const axisY = height - BOTTOM;
    el("line", { x1: LEFT, x2: width - RIGHT, y1: axisY, y2: axisY, stroke: "#999" }, svg);
    const t = ticks(lo, hi, Math.max(2, Math.floor(plotW / 90)));
    for (const v of t.values) {
      el("line", { x1: x(v), x2: x(v), y1: TOP, y2: axisY, stroke: "#eee" }, svg);
      const label = el("text", { x: x(v), y: axisY + 14, "text-anchor": "middle", "font-size": 11,
                                 fill: "#555" }, svg);
      label.textContent = fmt(v, t.step);
    }
    el("text", { x: width - RIGHT, y: axisY + 27, "text-anchor": "end", "font-size": 11,
                 fill: "#555" }, svg).textContent = "time (ms)";
    const area = el("g", { "clip-path": `url(#${clipId})` }, svg);
    return { x, area, lo, hi, axisY, upto: panel.plays && cursor < 1 ? cursor * panel.axis_ms : null };
  }

  function drawGantt(panel, index, width) {
    const height = TOP + panel.lanes.length * LANE + BOTTOM;
    const svg = el("svg", { width, height, "data-panel": index });
    const { x, area, upto, axisY } = frameOf(svg, width, height, panel);
    panel.lanes.forEach((name, lane) => {
      el("text", { x: LEFT - 8, y: TOP + lane * LANE + BAR / 2 + 8, "text-anchor": "end",
                   "font-size": 11 }, svg).textContent = name;
    });
    let shown = 0;
    panel.events.forEach((e, i) => {
      const [lane, kind, label, start, end0, micro, compute] = e;
      if (upto !== null && start > upto) return;
      const end = upto === null ? end0 : Math.min(end0, upto);
      const top = TOP + lane * LANE + (compute ? 4 : BAR + 7);
      const x0 = x(start), w = Math.max(x(end) - x0, 0.75);
      const color = panel.colors[kind] || "#888";
      el("rect", { x: x0, y: top, width: w, height: compute ? BAR : STRIP, fill: color,
                   stroke: "#fff", "stroke-width": 0.6, "data-e": `${index}:${i}` }, area);
      shown += 1;
      // the whole label where it fits, else the kind and micro-batch, else the micro-batch
      const mb = micro === null || micro === undefined ? "" : String(micro);
      const text = [label || "", `${kind}${mb}`, mb].find((t) => t && w > t.length * 6.3 + 4) || "";
      if (compute && text) {
        el("text", { x: x0 + w / 2, y: top + BAR / 2 + 4, "text-anchor": "middle", "font-size": 10,
                     fill: ink(color), "pointer-events": "none" }, area).textContent = text;
      }
    });
    if (upto !== null) {
      el("line", { x1: x(upto), x2: x(upto), y1: TOP - 4, y2: axisY, stroke: "#111",
                   "stroke-width": 1.5 }, area);
    }
    svg.setAttribute("data-shown", shown);
    return svg;
  }

  function drawSteps(panel, index, width) {
    const height = 150;
    const svg = el("svg", { width, height, "data-panel": index });
    const { x, area, upto, axisY } = frameOf(svg, width, height, panel);
    const top = Math.max(1, ...panel.series.flatMap((s) => s.points.map((p) => p[1])));
    const y = (v) => axisY - (v / top) * (axisY - TOP - 4);
    const step = Math.max(1, Math.ceil(top / 4));
    for (let v = 0; v <= top; v += step) {  // whole-number ticks: these are counts
      el("line", { x1: LEFT, x2: width - RIGHT, y1: y(v), y2: y(v), stroke: "#eee" }, svg);
      el("text", { x: LEFT - 6, y: y(v) + 4, "text-anchor": "end", "font-size": 11, fill: "#555" },
         svg).textContent = String(v);
    }
    const side = el("text", { x: 12, y: (TOP + axisY) / 2, "text-anchor": "middle", "font-size": 11,
                              fill: "#555", transform: `rotate(-90 12 ${(TOP + axisY) / 2})` }, svg);
    side.textContent = panel.ylabel;
    panel.series.forEach((s, i) => {
      const color = PALETTE[i % PALETTE.length];
      let d = "", last = null;
      for (const [t, v] of s.points) {
        if (upto !== null && t > upto) break;
        d += last === null ? `M${x(t)},${y(v)}` : `H${x(t)}V${y(v)}`;
        last = t;
      }
      if (last !== null) d += `H${x(upto === null ? panel.axis_ms : upto)}`;
      el("path", { d, fill: "none", stroke: color, "stroke-width": 2 }, area);
      const key = el("text", { x: width - RIGHT - 70 * (panel.series.length - i), y: 15,
                               "font-size": 11, fill: color }, svg);
      key.textContent = s.name;
    });
    return svg;
  }

  function draw() {
    const panels = model.get("panels");
    const width = Math.max(root.clientWidth || host.clientWidth || 800, 360);
    drawLegend(panels);
    body.replaceChildren(...panels.map((p, i) => (p.kind === "steps" ? drawSteps : drawGantt)(p, i, width)));
    greyOut(root, reason, model.get("greyed"));
    const first = playing()[0];
    readout.textContent = first ? `t = ${(cursor * first.axis_ms).toFixed(1)} of ${first.axis_ms.toFixed(1)} ms` : "";
    slider.value = Math.round(cursor * 1000);
    draws += 1;
    root.dataset.draws = draws;
    root.dataset.cursor = cursor.toFixed(3);
  }

  function stop() {
    if (frame !== null) cancelAnimationFrame(frame);
    frame = null;
    play.textContent = "\u25B6 play";
  }

  play.addEventListener("click", () => {
    if (frame !== null) return stop();
    if (cursor >= 1) cursor = 0;
    play.textContent = "\u275A\u275A pause";
    let before = performance.now();
    const tick = (now) => {
      cursor = Math.min(1, cursor + (now - before) / Math.max(model.get("play_ms"), 100));
      before = now;
      draw();
      if (cursor >= 1) return stop();
      frame = requestAnimationFrame(tick);
    };
    frame = requestAnimationFrame(tick);
  });
  slider.addEventListener("input", () => { stop(); cursor = slider.value / 1000; draw(); });
  reset.addEventListener("click", () => { view = [0, 1]; draw(); });

  function fractionAt(event) {
    const box = body.getBoundingClientRect();
    const plotW = box.width - LEFT - RIGHT;
    const f = Math.min(Math.max((event.clientX - box.left - LEFT) / plotW, 0), 1);
    return view[0] + f * (view[1] - view[0]);
  }
  body.addEventListener("wheel", (event) => {
    event.preventDefault();
    const at = fractionAt(event), scale = event.deltaY > 0 ? 1.25 : 0.8;
    const span = Math.min(1, Math.max(0.002, (view[1] - view[0]) * scale));
    let lo = at - ((at - view[0]) / (view[1] - view[0])) * span;
    lo = Math.min(Math.max(lo, 0), 1 - span);
    view = [lo, lo + span];
    draw();
  }, { passive: false });
  body.addEventListener("dblclick", () => { view = [0, 1]; draw(); });
  body.addEventListener("mousedown", (event) => { dragging = { x: event.clientX, view }; });
  const release = () => { dragging = null; };
  window.addEventListener("mouseup", release);
  body.addEventListener("mousemove", (event) => {
    if (dragging) {
      const plotW = body.getBoundingClientRect().width - LEFT - RIGHT;
      const span = dragging.view[1] - dragging.view[0];
      const lo = Math.min(Math.max(dragging.view[0] - ((event.clientX - dragging.x) / plotW) * span, 0), 1 - span);
      view = [lo, lo + span];
      draw();
      return;
    }
    const id = event.target.getAttribute && event.target.getAttribute("data-e");
    if (!id) { tip.style.display = "none"; return; }
    const [p, i] = id.split(":").map(Number);
    const panel = model.get("panels")[p];
    const [lane, kind, label, start, end, micro] = panel.events[i];
    showTip(tip, root, event, `${label || kind}  (${kind})\n${panel.lanes[lane]}` +
      (micro === null || micro === undefined ? "" : `, micro-batch ${micro}`) +
      `\n${start.toFixed(2)} \u2013 ${end.toFixed(2)} ms (${(end - start).toFixed(2)} ms)`);
  });
  body.addEventListener("mouseleave", () => { tip.style.display = "none"; });

  model.on("change:panels", () => { stop(); cursor = 1; view = [0, 1]; draw(); });
  model.on("change:greyed", draw);
  const resized = new ResizeObserver(() => draw());
  resized.observe(root);
  draw();
  return () => { stop(); resized.disconnect(); window.removeEventListener("mouseup", release); };
}

export default { render };
