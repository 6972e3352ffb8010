"""The lessons as an offline site: one HTML page per executed lesson and an index.

Each page embeds its widgets' state, so the widgets render without a kernel, and the
browser-drawn ones (schedules, collectives, animated figures) still Play. Every script
and font a page loads is in the site's `static/` folder: the widget manager and
require.js come from the npm registry once (`npm pack`, cached), anywidget's front end
from the installed Python package, and MathJax for the formulas. Nothing is fetched when
a page is viewed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

# npm package -> (version, the files the site needs from its tarball)
NPM_ASSETS = {
    "@jupyter-widgets/html-manager": ("1.0.15", ("package/dist/embed-amd.js",
                                                 "package/dist/*.woff2", "package/dist/*.woff",
                                                 "package/dist/*.ttf", "package/dist/*.eot",
                                                 "package/dist/*.svg")),
    "requirejs": ("2.3.7", ("package/require.js",)),
    "mathjax": ("3.2.2", ("package/es5/tex-svg.js",)),
}
SETUP_HINT = ("the lesson site needs npm once, to fetch the widget manager, require.js and "
              "MathJax from the npm registry: install Node.js (apt-get install -y npm, or "
              "brew install node) and run the command again")


def _cache_dir() -> Path:
    base = os.environ.get("MINIPAR_CACHE") or Path.home() / ".cache" / "minipar"
    tag = "-".join(version for version, _ in NPM_ASSETS.values())
    return Path(base) / f"site-assets-{tag}"


def site_assets() -> Path:
    """A folder with every script and font a lesson page loads, fetched with `npm pack`
    the first time and cached (in $MINIPAR_CACHE or ~/.cache/minipar) after that."""
    cache = _cache_dir()
    if (cache / "complete").exists():
        return cache
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError(SETUP_HINT)
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        specs = [f"{name}@{version}" for name, (version, _) in NPM_ASSETS.items()]
        done = subprocess.run([npm, "pack", "--silent", *specs], cwd=tmp, capture_output=True,
                              text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"npm pack {' '.join(specs)} failed: "
                               f"{done.stderr.strip().splitlines()[-1:]}; {SETUP_HINT}")
        for (_name, (_version, wanted)), tarball in zip(NPM_ASSETS.items(),
                                                        done.stdout.split(), strict=True):
            with tarfile.open(Path(tmp) / tarball) as tar:
                for member in tar.getmembers():
                    if member.isfile() and any(Path(member.name).match(w) for w in wanted):
                        source = tar.extractfile(member)
                        (cache / Path(member.name).name).write_bytes(source.read())
    (cache / "complete").write_text("\n".join(specs))
    return cache


def _anywidget_front_end() -> Path:
    """anywidget's front end as an AMD module, shipped inside the Python package."""
    import anywidget

    return Path(anywidget.__file__).parent / "nbextension" / "index.js"


# Before the widget manager asks for "anywidget", tell require.js where it is (the
# manager would otherwise fetch it from a CDN), and configure MathJax 3 for $...$ (and
# ask for no favicon: nothing is requested that the site does not hold). The
# widget manager typesets labels through MathJax 2's Hub.Queue; the shim hands that to 3.
HEAD = """<link rel="icon" href="data:,">
<script>
require.config({paths: {anywidget: "static/anywidget",  // fonts load beside these:
  "@jupyter-widgets/base": "static/base", "@jupyter-widgets/base7": "static/base7",
  "@jupyter-widgets/controls": "static/controls",
  "@jupyter-widgets/controls7": "static/controls7",
  "@jupyter-widgets/html-manager": "static/html-manager"}});
(function () {
  var hub = {Queue: function (task) {
    var node = task && task[2];
    if (node && window.MathJax.typesetPromise) window.MathJax.typesetPromise([node]);
  }};
  window.MathJax = {tex: {inlineMath: [["$", "$"], ["\\\\(", "\\\\)"]]},
                    svg: {fontCache: "global"}, Hub: hub,
                    startup: {ready: function () {
                      window.MathJax.startup.defaultReady();
                      window.MathJax.Hub = hub;
                    }}};
}());
</script>
<script src="static/tex-svg.js" async></script>
"""


def lesson_page(notebook) -> str:
    """One executed lesson (a NotebookNode) as HTML whose scripts all come from `static/`
    beside it."""
    from nbconvert import HTMLExporter

    from .lessons import without_test_markers

    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.source = without_test_markers(cell.source)
    exporter = HTMLExporter(require_js_url="static/require.js",
                            widget_renderer_url="static/embed-amd.js", mathjax_url="")
    body, _ = exporter.from_notebook_node(
        notebook, {"metadata": {"name": f"minipar: {_title(notebook, 'lesson')}"}})
    start = body.index("<!-- Load mathjax -->")
    end = body.index("<!-- End of mathjax configuration -->")
    body = body[:start] + body[end:]  # nbconvert's MathJax 2 set-up; ours is in HEAD
    anchor = '<script src="static/require.js"></script>'
    if anchor not in body:
        raise RuntimeError("nbconvert's page no longer loads require.js as expected; "
                           "minipar.lesson_site needs updating for this nbconvert")
    return body.replace(anchor, anchor + "\n" + HEAD, 1)


# a link to another notebook of the course, as a lesson or deep dive writes it (beside it,
# in deep_dives/, or one folder up); the site keeps every page in one folder
NOTEBOOK_LINK = re.compile(r'href="(?:deep_dives/|\.\./)?([0-9]{2}[a-z]?_[\w-]+)\.ipynb(#[^"]*)?"')


def site_links(page: str) -> str:
    """Point the page's links to other lessons and deep dives at their pages in the site."""
    return NOTEBOOK_LINK.sub(lambda m: f'href="{m.group(1)}.html{m.group(2) or ""}"', page)


def _title(notebook, fallback: str) -> str:
    for cell in notebook["cells"]:
        if cell["cell_type"] == "markdown":
            first = "".join(cell["source"]).strip().splitlines()[0]
            return first.lstrip("# ").strip() or fallback
    return fallback


def _execute(path: Path, workdir: Path, timeout: int):
    import nbformat
    from nbconvert.preprocessors import ExecutePreprocessor

    notebook = nbformat.read(path, as_version=4)
    ExecutePreprocessor(timeout=timeout, store_widget_state=True).preprocess(
        notebook, {"metadata": {"path": str(workdir)}})
    return notebook


def build_site(source_dir: str | Path, dest_dir: str | Path, execute: bool = True,
               timeout: int = 900, progress: Callable[[str], None] = print) -> list[Path]:
    """Write one page per lesson and deep dive in `source_dir` (executed first unless
    `execute` is False, when the saved outputs are used) plus index.html into `dest_dir`,
    with the scripts in `dest_dir/static`. Lessons run in a scratch folder, so nothing they
    write lands in `source_dir`. Returns the pages written."""
    import nbformat

    from .lessons import deep_dive_notebooks, folder_to_write, lesson_notebooks

    dest = Path(dest_dir)
    lessons = lesson_notebooks(source_dir)
    deep_dives = deep_dive_notebooks(source_dir)
    folder_to_write(dest, "--html")
    static = dest / "static"
    static.mkdir(parents=True, exist_ok=True)
    for item in site_assets().iterdir():
        if item.name != "complete":
            shutil.copyfile(item, static / item.name)
    shutil.copyfile(_anywidget_front_end(), static / "anywidget.js")
    pages, entries = [], []
    with tempfile.TemporaryDirectory() as scratch:
        titles = {}
        for path in lessons + deep_dives:
            progress(f"{'running' if execute else 'rendering'} {path.name}")
            notebook = _execute(path, Path(scratch), timeout) if execute else \
                nbformat.read(path, as_version=4)
            page = dest / f"{path.stem}.html"
            page.write_text(site_links(lesson_page(notebook)))
            pages.append(page)
            titles[path.stem] = _title(notebook, path.stem)
    for path in lessons:  # each lesson, then the deep dives that go with it
        dives = "".join(f'<li><a href="{d.stem}.html">{titles[d.stem]}</a></li>'
                        for d in deep_dives if d.name[:2] == path.name[:2])
        entries.append(f'<li><a href="{path.stem}.html">{titles[path.stem]}</a>'
                       + (f"<ul>{dives}</ul>" if dives else "") + "</li>")
    (dest / "index.html").write_text(
        "<!doctype html>\n<meta charset='utf-8'><title>minipar lessons</title>\n"
        "<link rel='icon' href='data:,'>\n"
        "<style>body{font:16px system-ui,sans-serif;max-width:46em;margin:3em auto;"
        "line-height:1.5}</style>\n<h1>minipar: the lessons</h1>\n"
        "<p>Each page is a lesson as it ran, widgets included: they draw and Play here "
        "without Python. To change their inputs, open the notebook in JupyterLab. Under a "
        "lesson, its deep dives: the research systems and extra measurements that go "
        "further than a 90-minute class.</p>\n"
        f"<ol>\n{chr(10).join(entries)}\n</ol>\n")
    return pages
