// Helpers every browser-drawn view shares. `esm.py` puts this file in front of each view's
// own module (gantt.js, collective.js, figure.js), so there is no build step and no import.

const SVG = "http://www.w3.org/2000/svg";
const PALETTE = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860",
                 "#DA8BC3", "#8C8C8C"];
// Controls, the greyed state with its reason, and the hover box, for every view's root.
const BASE_STYLE = `
.mp-view { font: 12px system-ui, sans-serif; color: #222; position: relative; }
.mp-view .bar { display: flex; gap: 10px; align-items: center; flex-wrap: wrap; margin: 2px 0 6px; }
.mp-view button { font: inherit; padding: 2px 10px; cursor: pointer; }
.mp-view input[type=range] { width: 220px; }
.mp-view .hint { color: #777; }
.mp-view svg { display: block; user-select: none; }
.mp-view.greyed svg { opacity: 0.3; filter: grayscale(1); }
.mp-view .reason { display: none; background: #fff4d6; border: 1px solid #e0b84c;
                   padding: 6px 10px; margin: 4px 0; border-radius: 3px; }
.mp-view.greyed .reason { display: block; }
.mp-view .tip { position: absolute; pointer-events: none; background: rgba(30,30,30,.92);
                color: #fff; padding: 5px 8px; border-radius: 3px; white-space: pre;
                font-size: 11px; display: none; z-index: 10; }
`;

function el(tag, attrs = {}, parent = null) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (parent) parent.appendChild(node);
  return node;
}

function html(tag, cls, parent, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  if (parent) parent.appendChild(node);
  return node;
}

// White text on dark fills, dark text on light ones.
function ink(color) {
  const c = color.replace("#", "");
  const [r, g, b] = [0, 2, 4].map((i) => parseInt(c.slice(i, i + 2), 16) / 255);
  return 0.299 * r + 0.587 * g + 0.114 * b > 0.62 ? "#222" : "#fff";
}

// A view's root: its style, the base classes, a reason box (shown when greyed) and a tip.
function viewRoot(host, cls, style) {
  const root = html("div", `mp-view ${cls}`, host);
  html("style", "", root).textContent = BASE_STYLE + style;
  return root;
}

function greyOut(root, reasonBox, reason) {
  root.classList.toggle("greyed", !!reason);
  reasonBox.textContent = reason;
}

function showTip(tip, root, event, text) {
  const box = root.getBoundingClientRect();
  tip.textContent = text;
  tip.style.left = `${event.clientX - box.left + 12}px`;
  tip.style.top = `${event.clientY - box.top + 12}px`;
  tip.style.display = "block";
}

// Play / pause and a slider over frames 0..count()-1, run by the browser alone: a static
// page with no kernel still steps through. `show(i)` draws frame i. The model's `frame`
// follows the slider (when a kernel listens) and the slider follows `frame` set from
// Python; `frame_ms` is how long Play shows each frame.
function stepper(bar, model, count, show) {
  const play = html("button", "play", bar, "\u25B6 play");
  const slider = html("input", "frame", bar);
  Object.assign(slider, { type: "range", min: 0, step: 1, value: 0 });
  let timer = null;
  const stop = () => {
    if (timer !== null) clearInterval(timer);
    timer = null;
    play.textContent = "\u25B6 play";
  };
  const go = (i) => {
    slider.value = i;
    try { model.set("frame", i); model.save_changes(); } catch (e) { /* no kernel */ }
    show(i);
  };
  play.addEventListener("click", () => {
    if (timer !== null) return stop();
    if (Number(slider.value) >= count() - 1) go(0);
    play.textContent = "\u275A\u275A pause";
    timer = setInterval(() => {
      const next = Number(slider.value) + 1;
      if (next >= count()) return stop();
      go(next);
    }, Math.max(model.get("frame_ms"), 100));
  });
  slider.addEventListener("input", () => { stop(); go(Number(slider.value)); });
  model.on("change:frame", () => {
    if (model.get("frame") !== Number(slider.value)) go(model.get("frame"));
  });
  return {
    stop, go,
    // a new set of `n` frames: stay on the frame shown, if it still exists
    reset(n) {
      stop();
      slider.max = Math.max(n - 1, 0);
      play.disabled = slider.disabled = n < 2;
      go(Math.min(model.get("frame"), Math.max(n - 1, 0)));
    },
    value: () => Number(slider.value),
  };
}
