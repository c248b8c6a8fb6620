"""The documentation site builds strictly, and works in a real browser.

``test_site_builds`` runs the README's build command, ``python3 -m mkdocs build`` (strict:
``strict: true`` in ``mkdocs.yml``; a warning, a broken internal link or an unresolved API
cross-reference fails it), into a temporary folder, then checks what the hooks must generate:
a page with at least one figure per notebook of ``notebooks/``, a page per public module of
``svflow_jax``, the home page's measured figure. The notebooks are executed through the cache
shared with ``tests/test_notebooks.py`` (``docs/_build_tools/notebook_cache.py``), so in one
test run each is executed once, by whichever of the two gets there first.

``test_site_in_browser`` opens the built home page and the first notebook page from disk in
headless Chromium (Debian's ``chromium`` package, driven directly: ``--dump-dom`` for the DOM
after the page's scripts ran, ``--screenshot`` for a picture; no driver library to install or
keep in step with the browser) and asserts that the navigation and a figure are there. The
screenshots go to ``.ci/artifacts/docs/`` (git-ignored). Without a Chromium on ``PATH`` the
test is skipped, saying so.
"""

from __future__ import annotations

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
    env = {**os.environ, "SVFLOW_TEST_RUN_ID": RUN_ID, "NO_MKDOCS_2_WARNING": "1"}
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
                  "--virtual-time-budget=5000"]
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
    first = NOTEBOOKS[0].stem
    pages = {"home": site / "index.html", "notebook": site / "notebooks" / f"{first}.html"}
    for label, page in pages.items():
        dom = _browse(browser, page.as_uri(), ARTIFACTS / f"{label}.png")
        # The Material navigation, with every notebook and the API reference in it.
        assert 'class="md-nav' in dom, f"{label}: no navigation"
        for notebook in NOTEBOOKS:
            assert f"{notebook.stem}.html" in dom, f"{label}: {notebook.stem} not in the nav"
        assert "svflow_jax.sphere.html" in dom, f"{label}: API reference not in the nav"
        images = re.findall(r'<img[^>]+src="([^"]+)"', dom)
        assert images, f"{label}: no figure in the rendered page"
        for src in images:
            assert (page.parent / src).is_file(), f"{label}: figure {src} is not in the site"
        (ARTIFACTS / f"{label}.html").write_text(dom)
