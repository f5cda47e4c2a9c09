"""The documentation site as built: its pages exist and show what they are for.

These tests read the HTML that Sphinx wrote to docs/_build/html (.ci/run builds it before the
tests, with warnings as errors). Without a build they skip locally, naming the command, and fail
under CI (``CI=true``), where the build must have run first.
"""

from __future__ import annotations

import html
import importlib
import inspect
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


def _code_blocks(page: str) -> list[str]:
    """The text of the page's code blocks, as a reader copies it."""
    return [
        html.unescape(re.sub(r"<[^>]+>", "", block))
        for block in re.findall(r"<pre\b[^>]*>(.*?)</pre>", page, flags=re.S)
    ]


def test_front_page_shows_an_example_the_figure_the_install_and_when_to_use_fn(site):
    page = _page(site, "index.html")
    text = _text(page)
    code = _code_blocks(page)
    # A complete example (tests/test_doc_blocks.py runs it) and the install, as code blocks.
    assert any("fn.onebit_adam(" in block and "print(" in block for block in code), code
    (install,) = [block for block in code if "pip install" in block]
    for line in (
        "python3 -m venv .venv && . .venv/bin/activate",
        'python3 -m pip install "torch==2.13.0"',
        "python3 -m pip install .",
        '".[test,notebooks,integrations,lightning,docs]"',
        "python3 -m pytest -q",
    ):
        assert line in install, install
    # The loss-against-bytes figure, served with the site, and the command that draws it.
    (image,) = re.findall(r'<img [^>]*src="([\w/]+/loss-vs-bytes\.png)"', page)
    assert (site / image).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "python3 benchmarks/loss_vs_bytes.py" in text
    # When fn helps, when it does not, and where the figures come from.
    for phrase in ("fn helps", "slow links", "does not help", "NVLink", "CPU VMs with gloo"):
        assert phrase in text, phrase
    assert "not yet measured on hardware" in text
    assert 'href="troubleshooting.html"' in page


def test_troubleshooting_page_is_in_the_site(site):
    page = _page(site, "troubleshooting.html")
    text = _text(page)
    for phrase in ("CollectiveTimeoutError", "FN_TIMEOUT", "the variance froze", "FAQ"):
        assert phrase in text, phrase
    # It is in the table of contents, so every page's navigation links it.
    assert 'href="troubleshooting.html"' in _page(site, "getting-started.html")
    assert 'href="../troubleshooting.html"' in _page(site, "guides/fsdp.html")


def test_code_blocks_have_a_copy_button(site):
    page = _page(site, "getting-started.html")
    assert re.search(r'<script [^>]*src="_static/copybutton\.js', page)
    # It copies commands without their prompts ("$ ", ">>> ", "... ").
    script = (site / "_static" / "copybutton.js").read_text(encoding="utf-8")
    assert r"formatCopyText(text, '\\$ |>>> |\\.\\.\\. (?!\\s*#)', true" in script
