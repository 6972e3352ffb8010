// FigureView's drawing, in the browser: matplotlib figures sent as SVG, one or a sequence
// of frames. Frames are stacked in one grid cell so the cell keeps the tallest frame's
// height (the page never jumps during Play); Play and the slider run here, no kernel.

const STYLE = `
.mp-figure .frames { display: grid; }
.mp-figure .frames > div { grid-area: 1 / 1; visibility: hidden; }
.mp-figure .frames > div.on { visibility: visible; }
.mp-figure .frames svg { width: 100%; height: auto; }
.mp-figure .caption { font-weight: 600; }
`;

function render({ model, el: host }) {
  const root = viewRoot(host, "mp-figure", STYLE);
  const bar = html("div", "bar", root);
  const frames = () => model.get("frames");
  const steps = stepper(bar, model, () => frames().length, (i) => show(i));
  const caption = html("span", "caption", bar);
  const reason = html("div", "reason", root);
  const stack = html("div", "frames", root);
  let draws = 0;

  function show(i) {
    [...stack.children].forEach((div, j) => div.classList.toggle("on", j === i));
    caption.textContent = model.get("captions")[i] || "";
    greyOut(root, reason, model.get("greyed"));
    draws += 1;
    Object.assign(root.dataset, { frame: i, frames: frames().length, draws });
  }

  function load() {
    stack.replaceChildren(...frames().map((svg) => {
      const div = html("div", "");
      div.innerHTML = svg;
      const drawn = div.querySelector("svg");
      if (drawn) {  // as wide as the cell allows, never wider than drawn (pt -> px)
        const natural = parseFloat(drawn.getAttribute("width")) * (4 / 3);
        drawn.removeAttribute("height");
        drawn.setAttribute("width", "100%");
        if (natural) drawn.style.maxWidth = `${natural}px`;
      }
      return div;
    }));
    bar.style.display = frames().length > 1 ? "" : "none";
    steps.reset(frames().length);
  }

  model.on("change:frames", load);
  model.on("change:greyed", () => greyOut(root, reason, model.get("greyed")));
  load();
  return () => steps.stop();
}

export default { render };
