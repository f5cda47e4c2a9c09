"""The documentation site as built: its pages exist and show what they are for.

These tests read the HTML that Sphinx wrote to docs/_build/html (.ci/run builds it before the
tests, with warnings as errors). Without a build they skip locally, naming the command, and fail
under CI (``CI=true``), where the build must have run first.
"""

from __future__ import annotations

import html
import importlib
import inspect
import json
import os
import re
from collections import Counter
from pathlib import Path

import pytest

from tests.test_api_docstrings import PACKAGES as DOCUMENTED

ROOT = Path(__file__).resolve().parent.parent
SITE = ROOT / "docs" / "_build" / "html"
BUILD = "python3 -m sphinx -W --keep-going -n -b html docs docs/_build/html"

# The packages with an API page, and the submodules that fn.integrations' page documents (the
# fn page also documents fn.base and fn.tree).
PACKAGES = [name for name in DOCUMENTED if name not in ("fn.base", "fn.tree")]


@pytest.fixture(scope="module")
def site() -> Path:
    if not (SITE / "index.html").is_file():
        message = f"no documentation build in {SITE.relative_to(ROOT)}; build it with: {BUILD}"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return SITE


def _page(site: Path, name: str) -> str:
    path = site / name
    assert path.is_file(), f"{name} is missing from the build"
    return path.read_text(encoding="utf-8")


def _text(page: str) -> str:
    """The page's visible text, roughly: tags dropped, entities decoded, spaces collapsed."""
    page = re.sub(r"<(script|style)\b.*?</\1>", " ", page, flags=re.S)
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", page)).split())


def _entry(page: str, anchor: str) -> str:
    """The HTML of one autodoc entry: from its signature to the end of its description."""
    start = page.index(f'id="{anchor}"')
    start = page.rindex("<dl", 0, start)
    depth, position = 0, start
    for tag in re.finditer(r"<(/?)dl\b", page[start:]):
        depth += -1 if tag.group(1) else 1
        if depth == 0:
            position = start + tag.end()
            break
    return page[start:position]


def test_index_leads_to_every_part_of_the_site(site):
    page = _page(site, "index.html")
    for target in (
        "getting-started.html",
        "guides/fsdp.html",
        "guides/simulated-workers.html",
        "algorithms.html",
        "architecture.html",
        "api/fn.html",
        "api/fn.fsdp.html",
        "api/fn.integrations.html",
        "benchmarks.html",
        "notebooks/01_quickstart.html",
    ):
        assert f'href="{target}' in page, f"index.html has no link to {target}"
    assert "communication-compressed optimizers" in _text(page)


def test_search_page_and_index_exist(site):
    assert "searchindex.js" in _page(site, "search.html")
    index = _page(site, "searchindex.js")
    for word in ("onebit", "fsdp", "loco"):
        assert f'"{word}"' in index, f"the search index has no entry for {word!r}"


def test_fsdp_guide(site):
    page = _page(site, "guides/fsdp.html")
    text = _text(page)
    assert "<h1>FSDP2" in page
    assert "1-bit across nodes on HSDP" in text
    # Links to the API resolve to its entries, and code blocks are highlighted.
    assert 'href="../api/fn.fsdp.html#fn.fsdp.OnebitAdam"' in page
    assert 'class="highlight-python' in page


def test_api_page_shows_signatures_and_args(site):
    page = _page(site, "api/fn.fsdp.html")
    entry = _entry(page, "fn.fsdp.OnebitAdam")
    text = _text(entry)
    # The signature with its type hints, built from __signature__ at run time.
    assert text.startswith("class fn.fsdp. OnebitAdam ( model")
    for parameter in ("freeze_step : int | str |", "error_dtype : torch.dtype", "replicate"):
        assert parameter in text
    # napoleon's rendering of the docstring's Args: and Example: sections.
    assert "Parameters :" in text and "lr – " in text
    assert ">>>" in text


def test_every_public_name_has_one_entry(site):
    anchors = Counter(
        anchor
        for path in sorted((site / "api").glob("*.html"))
        for anchor in re.findall(r'<dt class="sig sig-object py" id="([\w.]+)"', path.read_text())
    )
    transforms = importlib.import_module("fn.transforms").__all__
    missing, repeated = [], []
    for package in PACKAGES:
        module = importlib.import_module(package)
        for name in module.__all__:
            if inspect.ismodule(getattr(module, name)):
                continue
            # fn re-exports fn.transforms' names; each is documented there, once.
            home = "fn.transforms" if package == "fn" and name in transforms else package
            count = anchors[f"{home}.{name}"]
            (missing if count == 0 else repeated if count > 1 else []).append(f"{home}.{name}")
    assert not missing, f"public names without an API entry: {missing}"
    assert not repeated, f"public names documented more than once: {repeated}"
    fn_page = _page(site, "api/fn.html")
    assert 'href="fn.transforms.html#fn.transforms.onebit_adam"' in fn_page


def test_notebook_page_shows_its_outputs_and_plots(site):
    page = _page(site, "notebooks/01_quickstart.html")
    assert re.search(r'<img [^>]*src="[^"]+\.png"', page), "no plot in the notebook's page"
    assert 'class="cell_output' in page
    assert "fn quickstart" in _text(page)


@pytest.mark.parametrize("name", ["01_quickstart", "02_error_feedback", "03_convergence"])
def test_notebook_page_offers_the_notebook_and_shows_no_set_up(site, name):
    page = _page(site, f"notebooks/{name}.html")
    link = re.search(
        rf'<a class="reference download internal" download="" href="([^"]+/{name}\.ipynb)"', page
    )
    assert link, f"notebooks/{name}.html has no download link for {name}.ipynb"
    downloaded = site / "notebooks" / html.unescape(link.group(1))
    committed = ROOT / "notebooks" / f"{name}.ipynb"
    assert json.loads(downloaded.read_text()) == json.loads(committed.read_text())
    # The kernels get fn from the build's environment: no cell sets up sys.path, and no
    # output shows a path of the machine that built the site or a warning.
    assert "sys.path" not in _text(page)
    assert str(ROOT) not in page and "site-packages" not in page
    assert not re.search(r" at 0x[0-9a-f]+>", html.unescape(page)), "an object's repr is shown"
    stderr = re.findall(r'<div class="output stderr[^"]*">(.*?)</div>\s*</div>', page, re.S)
    assert not [_text(block) for block in stderr if "Warning" in block]


def test_algorithms_page_renders_math(site):
    page = _page(site, "algorithms.html")
    # MathJax typesets the math in the browser, from the copy served with the site.
    assert re.search(r'<script [^>]*src="_static/mathjax/tex-chtml\.js', page)
    assert (site / "_static" / "mathjax" / "tex-chtml.js").is_file()
    assert page.count('<span class="math notranslate nohighlight">') > 100
    assert '<div class="math notranslate nohighlight">' in page
    assert r"\frac{\lVert v \rVert_2}{\sqrt{n}}" in html.unescape(page)
    # The headings other pages link to keep their anchors.
    for anchor in ("conventions", "01-adam", "deviations-from-deepspeed"):
        assert f'id="{anchor}"' in page
