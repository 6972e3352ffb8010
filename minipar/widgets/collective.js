// CollectiveView's drawing, in the browser: a metered collective, step by step, as SVG.
// Python sends the recording (what every rank held after every step and who sent what to
// whom, see collective_view.recording_data); Play and the step slider run here.

const CELL_H = 26, GAP = 6, LABELS = 58, GUTTER = 48, TITLE = 44, MCELL = 30;
const STYLE = `
.mp-collective .step { font-weight: 600; min-width: 16em; }
.mp-collective .key { color: #555; margin: 0 0 4px; }
`;

function render({ model, el: host }) {
  const root = viewRoot(host, "mp-collective", STYLE);
  const bar = html("div", "bar", root);
  const recording = () => model.get("recording");
  const frames = () => (recording().steps || []).length + 1;
  const steps = stepper(bar, model, frames, (i) => draw(i));
  const label = html("span", "step", bar);
  const reason = html("div", "reason", root);
  html("div", "key", root, "cells: each rank's buffer, coloured by chunk, darker = more of " +
       "the sum; outlined = being sent; arrows: this step's messages (down the ranks on the " +
       "left, up on the right); right: bytes per link so far. Hover for details.");
  const stage = html("div", "stage", root);
  const tip = html("div", "tip", root);
  let draws = 0;

  function draw(frame) {
    const rec = recording();
    if (!rec.steps) return;
    frame = Math.min(Math.max(frame, 0), frames() - 1);
    const k = rec.world_size, numel = rec.initial[0].length;
    const step = frame ? rec.steps[frame - 1] : null;
    const buffers = frame ? step.buffers : rec.initial;
    const cellW = Math.max(22, Math.min(42, 520 / Math.max(numel, 1)));
    const gridX = LABELS + GUTTER, gridW = numel * cellW;
    const matrixX = gridX + gridW + 70;
    const width = Math.max(matrixX + k * MCELL + 20, matrixX + 240);  // room for the heading
    const rowY = (r) => TITLE + r * (CELL_H + GAP);
    const height = Math.max(rowY(k), TITLE + k * MCELL + 20) + 40;
    const svg = el("svg", { viewBox: `0 0 ${width} ${height}`, width: "100%",
                            style: `max-width:${width * 1.25}px` });
    el("text", { x: 0, y: 16, "font-size": 14, "font-weight": 600 }, svg).textContent = rec.title;
    const chunkOf = (i) => rec.bounds.findIndex((b, c) => b <= i && i < rec.bounds[c + 1]);
    const sent = new Set((step ? step.sends : []).map(([src, , chunk]) => `${src}:${chunk}`));
    for (let r = 0; r < k; r++) {
      el("text", { x: LABELS - 8, y: rowY(r) + CELL_H / 2 + 4, "text-anchor": "end",
                   "font-size": 12 }, svg).textContent = `rank ${r}`;
      buffers[r].forEach((value, i) => {
        const c = chunkOf(i);
        const fill = PALETTE[Math.max(c, 0) % PALETTE.length];
        const outlined = sent.has(`${r}:${c}`) || sent.has(`${r}:null`);
        // rank q contributes 2^q: the set bits of a value are the ranks summed into it
        const summed = [...Array(k).keys()].filter((q) => (value >> q) & 1);
        el("rect", { x: gridX + i * cellW + 1, y: rowY(r), width: cellW - 2, height: CELL_H,
                     fill, "fill-opacity": 0.25 + 0.75 * summed.length / k,
                     stroke: outlined ? "#111" : "none", "stroke-width": 2, rx: 2,
                     "data-tip": `rank ${r}, element ${i} (chunk ${c})\nholds ${value}: ranks ` +
                       `${summed.join(", ")} summed (the finished sum is ${rec.total})` }, svg);
        const dark = summed.length / k > 0.6;
        el("text", { x: gridX + (i + 0.5) * cellW, y: rowY(r) + CELL_H / 2 + 4,
                     "text-anchor": "middle", "font-size": 11, "pointer-events": "none",
                     fill: dark ? ink(fill) : "#222" }, svg).textContent = `${value}`;
      });
    }
    // Messages down the ranks curve on the left, up the ranks on the right, longer ones
    // further out; each leaves its row's lower half towards where it goes and lands in the
    // upper half of the next, so arrows meeting at one row never share a point.
    (step ? step.sends : []).forEach(([src, dst, chunk, bytes]) => {
      const down = dst > src, side = down ? gridX - 4 : gridX + gridW + 4;
      const nudge = down ? 5 : -5;
      const y0 = rowY(src) + CELL_H / 2 + nudge, y1 = rowY(dst) + CELL_H / 2 - nudge;
      const depth = Math.min(GUTTER - 8, 10 + 9 * Math.abs(dst - src));
      const bend = down ? side - 2 * depth : side + 2 * depth;  // a quadratic reaches half-way
      const color = chunk === null ? "#111" : PALETTE[chunk % PALETTE.length];
      el("path", { d: `M${side},${y0} Q${bend},${(y0 + y1) / 2} ${side},${y1}`,
                   fill: "none", stroke: color, "stroke-width": 2, "marker-end": "url(#arrow)",
                   "data-tip": `rank ${src} \u2192 rank ${dst}: ` +
                     `${chunk === null ? "the whole buffer" : `chunk ${chunk}`}, ${bytes} bytes` },
         svg);
    });
    const marker = el("marker", { id: "arrow", viewBox: "0 0 10 10", refX: 9, refY: 5,
                                  markerWidth: 7, markerHeight: 7, orient: "auto-start-reverse" },
                      el("defs", {}, svg));
    el("path", { d: "M0,0 L10,5 L0,10 z", fill: "#333" }, marker);
    const links = linkBytes(rec, frame);
    const most = Math.max(1, ...linkBytes(rec, rec.steps.length).flat());  // the busiest, at the end
    const all = links.flat().reduce((a, b) => a + b, 0);
    el("text", { x: matrixX, y: TITLE - 10, "font-size": 12 }, svg).textContent =
      `bytes per link so far: ${all}`;
    for (let a = 0; a < k; a++) {
      el("text", { x: matrixX - 6, y: TITLE + a * MCELL + MCELL / 2 + 4, "text-anchor": "end",
                   "font-size": 11, fill: "#555" }, svg).textContent = `${a}`;
      el("text", { x: matrixX + a * MCELL + MCELL / 2, y: TITLE + k * MCELL + 14,
                   "text-anchor": "middle", "font-size": 11, fill: "#555" }, svg).textContent = `${a}`;
      for (let b = 0; b < k; b++) {
        const n = links[a][b], shade = n / most;
        el("rect", { x: matrixX + b * MCELL, y: TITLE + a * MCELL, width: MCELL - 1,
                     height: MCELL - 1, fill: n ? `rgba(33, 102, 172, ${0.15 + 0.85 * shade})` : "#f4f4f4",
                     "data-tip": `rank ${a} \u2192 rank ${b}: ${n} bytes so far` }, svg);
        if (n) {
          el("text", { x: matrixX + b * MCELL + MCELL / 2, y: TITLE + a * MCELL + MCELL / 2 + 4,
                       "text-anchor": "middle", "font-size": 10, "pointer-events": "none",
                       fill: shade > 0.55 ? "#fff" : "#222" }, svg).textContent = `${n}`;
        }
      }
    }
    el("text", { x: matrixX + (k * MCELL) / 2, y: TITLE + k * MCELL + 30, "text-anchor": "middle",
                 "font-size": 11, fill: "#555" }, svg).textContent = "to rank \u2192  (rows: from rank)";
    stage.replaceChildren(svg);
    label.textContent = frame ? `step ${frame} of ${frames() - 1}: ${step.phase}` :
      `start (${frames() - 1} steps)`;
    greyOut(root, reason, model.get("greyed"));
    draws += 1;
    Object.assign(root.dataset, { frame, frames: frames(), draws });
  }

  // bytes[src][dst] sent in the steps before `frame`
  function linkBytes(rec, frame) {
    const k = rec.world_size, links = Array.from({ length: k }, () => new Array(k).fill(0));
    rec.steps.slice(0, frame).forEach((s) => s.sends.forEach(([a, b, , n]) => { links[a][b] += n; }));
    return links;
  }

  stage.addEventListener("mousemove", (event) => {
    const text = event.target.getAttribute && event.target.getAttribute("data-tip");
    if (!text) { tip.style.display = "none"; return; }
    showTip(tip, root, event, text);
  });
  stage.addEventListener("mouseleave", () => { tip.style.display = "none"; });

  model.on("change:recording", () => steps.reset(frames()));
  model.on("change:greyed", () => draw(steps.value()));
  steps.reset(frames());
  return () => steps.stop();
}

export default { render };
