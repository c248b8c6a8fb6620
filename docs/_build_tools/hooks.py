"""MkDocs hooks: the pages generated at build time (``hooks:`` in ``mkdocs.yml``).

* **Navigation** is computed here, not listed in ``mkdocs.yml``: every ``notebooks/*.py`` becomes
  a page under "Notebooks" and every public module of ``svflow_jax`` (found by walking the
  package directory: no path component starting with ``_``) a page under "API reference", so a
  new notebook or module appears without editing the configuration.
* **Notebooks** are executed (or taken from the shared execution cache, see
  ``notebook_cache.py``) and converted to Markdown with nbconvert; their figures become PNG files
  of the site. A notebook that fails to execute fails the build. Each prints a line to stderr
  before (``executing notebooks/NAME.py (k/7)...``) and one after (``... done in 42 s`` or
  ``... reused from cache``). With ``SVFLOW_DOCS_EXECUTE=0`` in the environment (mkdocs hooks
  take no command-line options) nothing is executed: a notebook's page shows its cells without
  outputs, under a note saying so.
* **API pages** are one ``::: module`` directive each, rendered by mkdocstrings from the
  docstrings.
* **The home page figure** (``figures/claim.png``) is measured by ``claim_figure.py``.
* **Formulas** become MathML when each page is rendered (``maths.py``), on the Markdown and the
  notebook pages alike: the built site shows its maths without fetching anything.
* **Results** pages (``docs/results/*.md``, one per study) are listed under "Results", in the
  order of ``RESULTS``; a results page missing from it fails the build.
* **``docs/theory.md``** indents list continuations by 2 spaces (a display formula inside a
  bullet too), as GitHub renders them; Python-Markdown needs 4, so the hook adds 2 spaces to the
  indented lines of its lists before rendering (the file itself is left as it is). Its formulas
  are TeX (``$...$``, ``$$...$$``), rendered to MathML like every page's.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from pathlib import Path

from mkdocs.structure.files import File, Files

sys.path.insert(0, str(Path(__file__).resolve().parent))
import claim_figure  # noqa: E402
import maths  # noqa: E402
import notebook_cache  # noqa: E402

ROOT = notebook_cache.ROOT
PACKAGE = "svflow_jax"
log = logging.getLogger("mkdocs.plugins.svflow_docs")
EXECUTE_ENV = "SVFLOW_DOCS_EXECUTE"

HOWTO = [
    {"Verify the claim": "howto/verify.md"},
    {"Load a checkpoint and inspect it": "howto/inspect-a-checkpoint.md"},
    {"Write your own layer design": "howto/layer-design.md"},
    {"Train a layer design": "howto/train-a-design.md"},
]

RESULTS = [
    {"Overview": "results/index.md"},
    {"Verify: run times and compilations": "results/verify-times.md"},
    {"Real checkpoints": "results/real-checkpoints.md"},
    {"The baseline recipe": "results/baseline.md"},
    {"Layer designs, trained": "results/layer-designs.md"},
    {"Layer designs: pre-registration": "results/layer-designs-preregistration.md"},
    {"Diagnostics under prefix shuffling": "results/diagnostics.md"},
    {"Objective and MoE balancing": "results/objective-moe.md"},
    {"Benchmark": "results/benchmark.md"},
    {"Against PyTorch": "results/peer-benchmark.md"},
    {"Mutation testing of the verdict code": "results/mutation-testing.md"},
]


def _check_results_listed() -> None:
    listed = {path for entry in RESULTS for path in entry.values()}
    present = {f"results/{p.name}" for p in (ROOT / "docs" / "results").glob("*.md")}
    if listed != present:
        raise ValueError(f"docs/results/ and hooks.RESULTS differ: only listed "
                         f"{sorted(listed - present)}, only present {sorted(present - listed)}")


def public_modules() -> list[str]:
    """Dotted names of every public module and package of ``svflow_jax``, sorted."""
    names = []
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if any(part.startswith("_") for part in parts):
            continue
        names.append(".".join(parts))
    return sorted(names)


def notebook_title(path: Path) -> str:
    """The notebook's first Markdown heading (``# # Title`` in percent format)."""
    for line in path.read_text().splitlines():
        if line.startswith("# # "):
            return line[4:].replace("$", "").strip()  # no MathJax in the navigation
    return path.stem


def _api_nav(modules: list[str]) -> list:
    nav: list = []
    sections: dict[str, list] = {}
    for name in modules:
        parts = name.split(".")
        page = {name: f"api/{name}.md"}
        if len(parts) == 1:
            nav.append(page)
        elif (ROOT / Path(*parts) / "__init__.py").exists() or len(parts) > 2:
            sections.setdefault(".".join(parts[:2]), []).append(page)
        else:
            nav.append(page)
    for package, pages in sorted(sections.items()):
        nav.append({package: pages})
    return nav


def on_config(config):
    _check_results_listed()
    nav = [
        {"Home": "index.md"},
        {"Theory": "theory.md"},
        {"Notebooks": [{notebook_title(p): f"notebooks/{p.stem}.md"}
                       for p in notebook_cache.notebooks()]},
        {"How-to guides": HOWTO},
        {"Report formats": "reports.md"},
        {"Results": RESULTS},
        {"API reference": _api_nav(public_modules())},
    ]
    config["nav"] = nav
    return config


def execute_notebooks() -> bool:
    """Whether this build executes the notebooks: yes unless ``$SVFLOW_DOCS_EXECUTE`` is ``0``."""
    return os.environ.get(EXECUTE_ENV, "1").strip() != "0"


def progress(message: str) -> None:
    """Prints one line of the build's progress to stderr, flushed (mkdocs' log shows nothing
    while a notebook runs for minutes)."""
    print(message, file=sys.stderr, flush=True)


def _notebook(path: Path, position: str):
    """The notebook to show and the note to put under its title: executed (or reused from the
    cache), or, with ``$SVFLOW_DOCS_EXECUTE=0``, its source without outputs. ``position`` is
    ``k/total``, for the progress lines."""
    name = f"notebooks/{path.name}"
    source = f"Source: `{name}` (jupytext percent format)."
    if not execute_notebooks():
        import jupytext

        progress(f"not executing {name} ({position}): {EXECUTE_ENV}=0")
        note = (f"{source} **The outputs were not executed in this build** "
                f"({EXECUTE_ENV}=0): the cells are shown without their outputs and figures.")
        nb = jupytext.read(path)
        nb.metadata["language_info"] = {"name": "python"}  # code fences marked as Python
        return nb, note
    progress(f"executing {name} ({position})…")
    nb, info = notebook_cache.executed(path, reuse="key")
    progress(f"… {name} reused from cache" if info["reused"]
             else f"… {name} done in {info['seconds']:.0f} s")
    how = "reused from this build's cache" if info["reused"] else "executed by this build"
    note = (f"{source} Outputs and figures below come from running it at build time "
            f"({info['seconds']:.0f} s, {how}).")
    return nb, note


def _notebook_page(path: Path, position: str = "1/1") -> tuple[str, dict[str, bytes]]:
    """The Markdown page of a notebook and its figures (file name -> PNG bytes)."""
    from nbconvert import MarkdownExporter
    from traitlets.config import Config

    nb, note = _notebook(path, position)
    c = Config()
    c.TagRemovePreprocessor.enabled = True
    c.TagRemovePreprocessor.remove_cell_tags = {notebook_cache.PROBE_CELL_TAG}
    exporter = MarkdownExporter(config=c)
    body, resources = exporter.from_notebook_node(
        nb, resources={"unique_key": path.stem, "output_files_dir": f"{path.stem}_files"})
    title = "Executed notebook" if execute_notebooks() else "Notebook not executed"
    note = f"\n\n!!! note \"{title}\"\n    {note}\n\n"
    lines = body.lstrip().split("\n", 1)
    if lines[0].startswith("# "):  # the note goes under the title
        body = lines[0] + note + (lines[1] if len(lines) > 1 else "")
    else:
        body = note + body
    return body, resources.get("outputs", {})


_LIST_ITEM = re.compile(r"(?:[*+-]|\d+\.) ")


def two_space_lists(markdown: str) -> str:
    """Adds 2 spaces to every indented line that continues a list (outside fenced code), and a
    blank line before an item that follows such a line."""
    out, in_list, fenced = [], False, False
    for line in markdown.split("\n"):
        if line.startswith("```"):
            fenced = not fenced
            in_list = False
        elif not fenced and _LIST_ITEM.match(line):
            if in_list and out and out[-1].startswith(" ") and out[-1].strip():
                out.append("")  # else Python-Markdown reads the item as the paragraph's text
            in_list = True
        elif not fenced and in_list and line.strip():
            if line.startswith(" "):
                line = "  " + line
            else:
                in_list = False
        out.append(line)
    return "\n".join(out)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri == "theory.md":
        return two_space_lists(markdown)
    return markdown


def _toc_maths(items, where: str) -> None:
    for item in items:
        item.title = maths.render_title(item.title, where)
        _toc_maths(item.children, where)


def on_page_content(html: str, page, config, files) -> str:
    rendered, count = maths.render(html, page.file.src_uri)
    _toc_maths(page.toc, page.file.src_uri)  # the headings' formulas, in the side bar
    if count:
        log.debug("svflow docs: %d formulas of %s rendered as MathML", count, page.file.src_uri)
    return rendered


def on_files(files: Files, config) -> Files:
    start = time.perf_counter()
    for name in public_modules():
        content = f"::: {name}\n"
        files.append(File.generated(config, f"api/{name}.md", content=content))
    paths = notebook_cache.notebooks()
    for k, path in enumerate(paths, 1):
        body, outputs = _notebook_page(path, f"{k}/{len(paths)}")
        files.append(File.generated(config, f"notebooks/{path.stem}.md", content=body))
        for name, data in outputs.items():
            files.append(File.generated(config, f"notebooks/{name}", content=data))
    log.info("svflow docs: notebooks ready in %.1f s", time.perf_counter() - start)
    start = time.perf_counter()
    progress("measuring the home page's figure (three claims of svflow verify --quick)…")
    figure = claim_figure.png(claim_figure.measure())
    files.append(File.generated(config, "figures/claim.png", content=figure))
    progress(f"… home page's figure done in {time.perf_counter() - start:.0f} s")
    return files
