"""The documentation site builds strictly, and works in a real browser.

``test_site_builds`` runs the README's build command, ``python3 -m mkdocs build`` (strict:
``strict: true`` in ``mkdocs.yml``; a warning, a broken internal link or an unresolved API
cross-reference fails it), into a temporary folder, then checks what the hooks must generate:
a page with at least one figure per notebook of ``notebooks/``, a page per public module of
``svflow_jax``, the home page's measured figure. The notebooks are executed through the cache
shared with ``tests/test_notebooks.py`` (``docs/_build_tools/notebook_cache.py``), so in one
test run each is executed once, by whichever of the two gets there first.

``test_site_offline`` checks that no page loads a script, stylesheet or font from the network
and that every formula was rendered at build time (``docs/_build_tools/maths.py``: TeX to
MathML, no MathJax): no raw TeX is left in any page's text.

``test_howto_code_runs`` runs the code blocks of every how-to guide and of the README as a
reader would copy them (placeholder paths mapped to the golden files), so a stale page fails;
a block it does not run is marked ``<!-- docs-test: skip (why) -->`` above its fence.

``test_site_in_browser`` opens the built home page, two notebook pages and the theory page
from disk in
headless Chromium (Debian's ``chromium`` package, driven directly: ``--dump-dom`` for the DOM
after the page's scripts ran, ``--screenshot`` for a picture; no driver library to install or
keep in step with the browser) **with the network disabled** (every host name resolves to
nothing and the proxy is a closed port), and asserts that the navigation and a figure are
there and that the notebook and theory pages show their formulas as MathML, with no raw TeX
left. The
screenshots go to ``.ci/artifacts/docs/`` (git-ignored). Without a Chromium on ``PATH`` the
test is skipped, saying so.
"""

from __future__ import annotations

import html
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from scripts_for_tests import users_env

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / ".ci" / "artifacts" / "docs"
# The test run's id, as in tests/test_notebooks.py: the docs build records it with each notebook
# it executes, so test_notebooks can reuse that execution within this run (and only this run).
RUN_ID = os.environ.get("PYTEST_XDIST_TESTRUNUID") or os.environ.setdefault(
    "SVFLOW_PYTEST_RUN_ID", uuid.uuid4().hex)
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.py"))


def _public_modules() -> list[str]:
    names = []
    for path in sorted((ROOT / "svflow_jax").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        if not any(part.startswith("_") for part in parts):
            names.append(".".join(parts))
    return names


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    # the notebook kernels run under the XLA flags a reader's Jupyter has (users_env)
    env = users_env(SVFLOW_TEST_RUN_ID=RUN_ID, NO_MKDOCS_2_WARNING="1")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1800)
    seconds = time.perf_counter() - start
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"mkdocs build failed ({proc.returncode}):\n{log[-6000:]}"
    print(f"\n[docs] site built in {seconds:.1f} s")
    return out


def test_site_builds(site: Path):
    home = (site / "index.html").read_text()
    assert 'src="figures/claim.png"' in home
    assert (site / "figures" / "claim.png").stat().st_size > 10_000
    assert (site / "theory.html").exists()
    for page in ("howto/verify.html", "howto/inspect-a-checkpoint.html",
                 "howto/layer-design.html", "howto/train-a-design.html", "reports.html"):
        assert (site / page).exists(), page
    for notebook in NOTEBOOKS:
        html = (site / "notebooks" / f"{notebook.stem}.html").read_text()
        images = re.findall(r'<img[^>]+src="([^"]+)"', html)
        assert images, f"{notebook.name}: no figure on its page"
        for src in images:
            assert (site / "notebooks" / src).stat().st_size > 1000, src
        assert "kernel-executable:" not in html  # the tests' probe cell is removed
    for module in _public_modules():
        page = site / "api" / f"{module}.html"
        assert page.exists(), f"no API page for {module}"
        assert f'id="{module}"' in page.read_text(), f"{module}: its docstring was not rendered"


# Text that would be a formula left unrendered: \( \) \[ \] delimiters, $$, or $...$ by
# arithmatex's rule (no space inside either dollar, no digit after the closing one).
RAW_TEX = re.compile(r"\\[()\[\]]|\$\$|(?<!\\)\$(?!\s)[^$<]+?(?<!\s)\$(?!\d)")
# Code and scripts keep their dollars and backslashes; only the prose must be free of raw TeX.
_NOT_PROSE = re.compile(r"<(pre|code|script|style|math|textarea)\b.*?</\1>", re.DOTALL)


def raw_tex(page_html: str) -> list[str]:
    """The unrendered formulas in a page's prose (outside code, scripts and MathML)."""
    text = re.sub(r"<[^>]+>", " ", _NOT_PROSE.sub(" ", page_html))
    return RAW_TEX.findall(html.unescape(text))


def test_raw_tex_detector():
    """The detector the offline tests rely on finds each kind of raw formula, and not code."""
    for raw in (r"<p>so \(x^2\) is</p>", r"<p>\[ a \]</p>", "<p>then $x_i$ moves</p>",
                "<p>$$\na\n$$</p>"):
        assert raw_tex(raw), raw
    for clean in ("<p>costs $5 and $6</p>", "<pre><code>label=r'$x$'</code></pre>",
                  "<p><math><mi>x</mi></math></p>", "<code>\\(</code>"):
        assert not raw_tex(clean), clean


def test_formulas_become_mathml(monkeypatch):
    """The build-time converter: arithmatex's inline and display spans become MathML with the
    TeX's structure (HTML entities decoded first), the side bar's ``\\(...\\)`` titles too, and a
    formula it cannot convert fails the build naming the page and the formula."""
    monkeypatch.syspath_prepend(str(ROOT / "docs" / "_build_tools"))
    import maths

    page = ('<p><span class="arithmatex">\\(a &lt; b_i\\)</span> and</p>\n'
            '<div class="arithmatex">\\[\\frac{x}{\\sqrt{d}}\\]</div>')
    out, count = maths.render(page, "p.md")
    assert count == 2 and not raw_tex(out)
    assert '<math xmlns="http://www.w3.org/1998/Math/MathML" display="inline">' in out
    assert re.search(r"<mi>a</mi><mo>&#x0003C;</mo><msub><mi>b</mi><mi>i</mi></msub>", out)
    assert re.search(r'display="block"><mrow><mfrac><mrow><mi>x</mi></mrow><mrow><msqrt>', out)
    assert maths.render_title(r"1. The geometry of \(S^{d-1}\)").startswith(
        '1. The geometry of <math xmlns="http://www.w3.org/1998/Math/MathML" display="inline">')
    with pytest.raises(maths.MathsError, match=r"p\.md: cannot convert the formula 'x\^'"):
        maths.render('<span class="arithmatex">\\(x^\\)</span>', "p.md")


def test_site_offline(site: Path):
    """No page fetches anything from the network, and every formula is MathML."""
    pages = sorted(site.rglob("*.html"))
    assert len(pages) > 20
    remote = re.compile(r'<(?:script|img|iframe)[^>]+src="(?:https?:)?//|'
                        r'<link[^>]+href="(?:https?:)?//[^"]+"[^>]*rel="(?:stylesheet|preload)"|'
                        r'<link[^>]+rel="(?:stylesheet|preload|preconnect)"[^>]+href="(?:https?:)?//')
    for page in pages:
        text = page.read_text()
        where = page.relative_to(site)
        assert not remote.search(text), f"{where}: loads {remote.search(text).group(0)!r}"
        assert not raw_tex(text), f"{where}: raw TeX left: {raw_tex(text)[:5]}"
    for notebook in NOTEBOOKS:
        text = (site / "notebooks" / f"{notebook.stem}.html").read_text()
        assert "<math" in text, f"{notebook.name}: no formula rendered"
    assert "mathjax" not in (site / "notebooks" / f"{NOTEBOOKS[0].stem}.html").read_text().lower()


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    return None


def _browse(browser: str, url: str, screenshot: Path) -> str:
    """The page's DOM after its scripts ran; saves a screenshot."""
    with tempfile.TemporaryDirectory() as profile:
        common = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                  f"--user-data-dir={profile}", "--window-size=1280,1600",
                  "--virtual-time-budget=5000",
                  # No network: no host name resolves, and any proxied request meets a closed port.
                  "--host-resolver-rules=MAP * ~NOTFOUND", "--proxy-server=http://127.0.0.1:9",
                  "--disable-background-networking"]
        dom = subprocess.run([*common, "--dump-dom", url], capture_output=True, text=True,
                             timeout=180)
        assert dom.returncode == 0, dom.stderr[-3000:]
        shot = subprocess.run([*common, f"--screenshot={screenshot}", url], capture_output=True,
                              text=True, timeout=180)
        assert shot.returncode == 0, shot.stderr[-3000:]
    assert screenshot.stat().st_size > 10_000, "the screenshot is (nearly) empty"
    return dom.stdout


def test_site_in_browser(site: Path):
    browser = _chromium()
    if browser is None:
        pytest.skip("no Chromium on PATH (Debian: apt-get install -y chromium; .ci/run installs "
                    "it when it runs as root): the site was built but not opened in a browser")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    first, third = NOTEBOOKS[0].stem, NOTEBOOKS[2].stem
    pages = {"home": site / "index.html", "notebook": site / "notebooks" / f"{first}.html",
             "notebook3": site / "notebooks" / f"{third}.html", "theory": site / "theory.html"}
    for label, page in pages.items():
        dom = _browse(browser, page.as_uri(), ARTIFACTS / f"{label}.png")
        # The Material navigation, with every notebook and the API reference in it.
        assert 'class="md-nav' in dom, f"{label}: no navigation"
        for notebook in NOTEBOOKS:
            assert f"{notebook.stem}.html" in dom, f"{label}: {notebook.stem} not in the nav"
        assert "svflow_jax.sphere.html" in dom, f"{label}: API reference not in the nav"
        images = re.findall(r'<img[^>]+src="([^"]+)"', dom)
        assert images or label == "theory", f"{label}: no figure in the rendered page"
        for src in images:
            assert (page.parent / src).is_file(), f"{label}: figure {src} is not in the site"
        (ARTIFACTS / f"{label}.html").write_text(dom)
        if label.startswith("notebook") or label == "theory":  # MathML, no raw TeX left
            assert len(re.findall(r"<math\b", dom)) >= 20, f"{label}: formulas not rendered"
            assert not raw_tex(dom), f"{label}: raw TeX left: {raw_tex(dom)[:5]}"


# --- The how-to guides' code runs ---------------------------------------------------------------

# The how-to guides and the README: their code is what a reader copies.
CODE_PAGES = [*sorted((ROOT / "docs" / "howto").glob("*.md")), ROOT / "README.md"]
# A block the test does not run is marked on the line before its fence, with the reason:
#   <!-- docs-test: skip (several minutes on a CPU; the block above runs it with --quick) -->
SKIP_MARKER = re.compile(r"^<!-- docs-test: skip \((?P<why>[^)]+)\) -->$")
# The guides' stand-ins for a user's files, and what the test runs them on.
PLACEHOLDERS = {
    "path/to/hf-folder": ROOT / "tests" / "golden" / "llama3_rope",
    "path/to/folder": ROOT / "tests" / "golden" / "llama3_rope",
    "path/to/model.gguf": ROOT / "tests" / "golden" / "llama_gqa_tied" / "model.gguf",
    "my.txt": ROOT / "svflow_jax" / "data" / "emma_opening.txt",
}


def code_blocks(markdown: str) -> list[tuple[str, str, str | None]]:
    """The fenced code blocks of a page: ``(language, code, reason it is skipped or None)``."""
    blocks, lines, i = [], markdown.split("\n"), 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        before = next((line for line in reversed(lines[:i]) if line.strip()), "")
        skip = SKIP_MARKER.match(before.strip())
        end = lines.index("```", i + 1)
        blocks.append((fence.group(1), "\n".join(lines[i + 1:end]),
                       skip.group("why") if skip else None))
        i = end + 1
    return blocks


def test_code_blocks_parser():
    page = ("Text\n\n```python\nx = 1\n```\n\n<!-- docs-test: skip (too long) -->\n```bash\n"
            "svflow verify\n```\n")
    assert code_blocks(page) == [("python", "x = 1", None), ("bash", "svflow verify", "too long")]


@pytest.mark.parametrize("page", CODE_PAGES, ids=[p.stem for p in CODE_PAGES])
def test_howto_code_runs(page: Path, tmp_path: Path):
    """Every code block of a how-to guide (and of the README) runs as written, from an empty
    folder: a Python block
    whose first line is ``# name.py`` is saved as that file (the guide's user module); the other
    Python blocks run in order as one script; the shell blocks run in order with ``set -e``,
    ``svflow`` being this checkout's ``python -m svflow_jax``. Placeholder paths stand for test
    files (``PLACEHOLDERS``). A block marked ``docs-test: skip (why)`` is not run."""
    text = page.read_text()
    for placeholder, path in PLACEHOLDERS.items():
        assert path.exists(), path
        text = text.replace(placeholder, str(path))
    python, shell, skipped = [], [], []
    for language, code, why in code_blocks(text):
        if why:
            skipped.append(why)
        elif language == "python" and re.match(r"# [\w.]+\.py\n", code):
            (tmp_path / code.split("\n", 1)[0][2:]).write_text(code)
        elif language == "python":
            python.append(code)
        elif language in ("bash", "sh"):
            shell.append(code)
        else:
            pytest.fail(f"{page.name}: a ```{language} block the test cannot run")
    assert python or shell, f"{page.name}: no code to run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)]),
           "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"), "MPLBACKEND": "Agg"}
    if python:
        script = tmp_path / "howto_blocks.py"
        script.write_text("\n\n".join(python))
        proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"{page.name}, Python:\n{(proc.stdout + proc.stderr)[-4000:]}"
    if shell:
        body = "\n\n".join(shell)
        script = (f'set -euo pipefail\nsvflow() {{ "{sys.executable}" -m svflow_jax "$@"; }}\n'
                  f"{body}\n")
        proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"{page.name}, shell:\n{(proc.stdout + proc.stderr)[-4000:]}"


def _hooks(monkeypatch):
    """``docs/_build_tools/hooks.py``, imported as mkdocs imports it."""
    monkeypatch.syspath_prepend(str(ROOT / "docs" / "_build_tools"))
    import hooks

    return hooks


def test_notebook_page_without_execution(monkeypatch, capsys):
    """``SVFLOW_DOCS_EXECUTE=0``: a notebook's page is its source, without outputs and with a
    note saying so, no kernel is started, and the progress line on stderr says why."""
    hooks = _hooks(monkeypatch)
    monkeypatch.setenv(hooks.EXECUTE_ENV, "0")

    def no_kernel(*args, **kwargs):
        raise AssertionError("a notebook was executed")

    monkeypatch.setattr(hooks.notebook_cache, "executed", no_kernel)
    monkeypatch.setattr(hooks.notebook_cache, "execute", no_kernel)
    body, outputs = hooks._notebook_page(NOTEBOOKS[0], f"1/{len(NOTEBOOKS)}")
    assert outputs == {}
    assert "The outputs were not executed in this build" in body
    assert "![png]" not in body and "kernel-executable:" not in body
    assert "```python" in body  # the cells are there
    err = capsys.readouterr().err
    assert f"not executing notebooks/{NOTEBOOKS[0].name} (1/{len(NOTEBOOKS)})" in err


@pytest.mark.parametrize("reused", [False, True])
def test_notebook_progress_lines(monkeypatch, capsys, reused: bool):
    """An executed notebook prints a line before and one after, to stderr: how long it took,
    or that the cache had it (the execution itself replaced by the source, for speed)."""
    import jupytext

    hooks = _hooks(monkeypatch)
    monkeypatch.delenv(hooks.EXECUTE_ENV, raising=False)
    monkeypatch.setattr(hooks.notebook_cache, "executed", lambda path, reuse: (
        jupytext.read(path), {"seconds": 42.4, "reused": reused}))
    hooks._notebook_page(NOTEBOOKS[-1], f"{len(NOTEBOOKS)}/{len(NOTEBOOKS)}")
    before, after = capsys.readouterr().err.strip().split("\n")
    name = f"notebooks/{NOTEBOOKS[-1].name}"
    assert before == f"executing {name} ({len(NOTEBOOKS)}/{len(NOTEBOOKS)})…"
    assert after == (f"… {name} reused from cache" if reused else f"… {name} done in 42 s")


def test_every_notebook_on_the_home_page():
    """The home page's reading list links every notebook (a new one cannot be left out)."""
    home = (ROOT / "docs" / "index.md").read_text()
    missing = [p.name for p in NOTEBOOKS if f"(notebooks/{p.stem}.md)" not in home]
    assert not missing, f"docs/index.md does not link {missing}"
