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
from html.parser import HTMLParser
from pathlib import Path

import pytest

from tests._imports import missing_for_module
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
    for package in [p for p in PACKAGES if not missing_for_module(p)]:
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


def _api_pages(site: Path) -> list[Path]:
    pages = sorted((site / "api").glob("*.html"))
    assert pages, "no API pages in the build"
    return pages


def _summary_rows(page: str) -> list[tuple[str, str, str]]:
    """``(group, href, summary)`` of each row of a page's summary tables, in order."""
    rows = []
    tables = re.findall(
        r'<p class="[^"]*\bfn-summary-group\b[^"]*">(.*?)</p>\s*<div[^>]*>\s*'
        r'<table class="fn-summary[^"]*">(.*?)</table>',
        page,
        flags=re.S,
    )
    for group, table in tables:
        for name, summary in re.findall(
            r"<tr[^>]*>\s*<td>(.*?)</td>\s*<td>(.*?)</td>", table, re.S
        ):
            href = re.search(r'<a class="reference internal" href="([^"]+)"', name)
            assert href, f"a row of {_text(group)!r} links nowhere: {_text(name)}"
            rows.append((_text(group), href.group(1), _text(summary)))
    return rows


def test_api_pages_open_with_the_summary_table(site):
    for path in _api_pages(site):
        page = path.read_text(encoding="utf-8")
        title_end = page.index("</h1>")
        first_group = re.search(r'<p class="[^"]*\bfn-summary-group\b', page)
        assert first_group, f"{path.name} has no summary table"
        # Nothing between the page's title and its first group: the table opens the page.
        assert _text(page[title_end + len("</h1>") : first_group.start()]) == "", path.name
        assert first_group.start() < page.index('<dl class="py'), path.name
        rows = _summary_rows(page)
        empty = [href for _, href, summary in rows if not summary]
        assert rows and not empty, f"{path.name}: rows without a summary: {empty}"


def test_api_tables_list_every_name_and_the_entries_follow_them(site):
    transforms = importlib.import_module("fn.transforms").__all__
    rows_by_page = {path.name: _summary_rows(path.read_text()) for path in _api_pages(site)}
    for package in [p for p in PACKAGES if not missing_for_module(p)]:
        page_name = "fn.integrations.html" if ".integrations." in package else f"{package}.html"
        if package in ("fn.base", "fn.tree"):
            page_name = "fn.html"
        targets = {href.rsplit("#", 1)[-1] for _, href, _ in rows_by_page[page_name]}
        module = importlib.import_module(package)
        for name in module.__all__:
            # fn's re-exports of fn.transforms have their rows there (the optimizers on both).
            if inspect.ismodule(getattr(module, name)) or (package == "fn" and name in transforms):
                continue
            assert f"{package}.{name}" in targets, f"{page_name}'s table has no row for {name}"
    for path in _api_pages(site):
        page = path.read_text(encoding="utf-8")
        rows = [href[1:] for _, href, _ in _summary_rows(page) if href.startswith("#")]
        entries = [
            anchor
            for anchor in re.findall(r'<dt class="sig sig-object py" id="([\w.]+)"', page)
            if anchor in rows
        ]
        assert entries == rows, f"{path.name}: the entries are not in the table's order"


def test_api_pages_put_the_building_blocks_last(site):
    fsdp = _summary_rows(_page(site, "api/fn.fsdp.html"))
    names = [href.rsplit(".", 1)[-1] for _, href, _ in fsdp]
    assert names[:2] == ["OnebitAdam", "OnebitLamb"]
    assert fsdp[0][2].startswith("1-bit Adam")
    last_user_facing = max(
        names.index(n) for n in ("OnebitAdam", "OnebitLamb", "TrainingCheckpoint")
    )
    first_plumbing = min(
        names.index(n) for n in ("CommCache", "QuantizedReduceScatter", "reduce_scale")
    )
    assert last_user_facing < first_plumbing
    for page_name in ("fn.fsdp", "fn.optim", "fn.transforms", "fn.collectives"):
        groups = list(
            dict.fromkeys(g for g, _, _ in _summary_rows(_page(site, f"api/{page_name}.html")))
        )
        assert groups[-1] == "Building blocks" and groups.count("Building blocks") == 1, groups
    # The fn page starts with the optimizers, documented under fn.transforms.
    first = _summary_rows(_page(site, "api/fn.html"))[0]
    assert first[:2] == ("Optimizers", "fn.transforms.html#fn.transforms.onebit_adam")


class _PlainMentions(HTMLParser):
    """The literals and the text inside the entries' descriptions (``<dd>``) and the summary
    tables of an API page."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0  # how many <dd> or summary tables the parser is in
        self.stack: list[bool] = []  # per open dd/table/code: whether it counts
        self.literal: list[str] | None = None
        self.literals: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        classes = (dict(attrs).get("class") or "").split()
        if tag in ("dd", "table"):
            counts = tag == "dd" or "fn-summary" in classes
            self.stack.append(counts)
            self.depth += counts
        elif tag == "code" and self.depth and "literal" in classes and "xref" not in classes:
            self.literal = []

    def handle_endtag(self, tag):
        if tag in ("dd", "table") and self.stack:
            self.depth -= self.stack.pop()
        elif tag == "code" and self.literal is not None:
            self.literals.append("".join(self.literal))
            self.literal = None

    def handle_data(self, data):
        if self.literal is not None:
            self.literal.append(data)
        elif self.depth:
            self.text.append(data)


def _links(page: str) -> set[tuple[str, str]]:
    """``(href, text)`` of every link in ``page``."""
    return {
        (href, _text(inner))
        for href, inner in re.findall(r'<a [^>]*href="([^"]*)"[^>]*>(.*?)</a>', page, re.S)
    }


def test_docstring_mentions_are_links(site):
    # A sample: fn names on the same page and others (re-exports resolved), pages and sections.
    samples = {
        ("api/fn.fsdp.html", "fn.fsdp.OnebitAdam"): [
            (
                "fn.transforms.html#fn.transforms.onebit_adam_sharded",
                "fn.transforms.onebit_adam_sharded",
            ),
            ("fn.transforms.html#fn.transforms.onebit_adam", "fn.onebit_adam"),
            ("#fn.fsdp.TrainingCheckpoint", "TrainingCheckpoint"),
            ("../algorithms.html", "Algorithms"),
            ("../algorithms.html#", "1-bit Adam and 1-bit LAMB on FSDP2"),
        ],
        ("api/fn.transforms.html", "fn.transforms.onebit_adam"): [
            ("../algorithms.html#", "1-bit Adam"),
            ("../algorithms.html#", "Automatic freeze and momentum mask"),
        ],
        ("api/fn.ddp.html", "fn.ddp.loco_hook"): [
            ("fn.collectives.html#fn.collectives.loco_allreduce", "fn.collectives.loco_allreduce")
        ],
        ("api/fn.integrations.html", "fn.integrations.transformers.FnTrainerCallback"): [
            ("../guides/hf-trainer.html", "Hugging Face Trainer")
        ],
        ("api/fn.kernels.html", "fn.kernels.sqrt_rn"): [("../algorithms.html#", "Conventions")],
    }
    algorithms = _page(site, "algorithms.html")
    for (page_name, anchor), expected in samples.items():
        links = _links(_entry(_page(site, page_name), anchor))
        for href, text in expected:
            found = [
                h
                for h, t in links
                if t == text and (h == href or h.startswith(href) and href.endswith("#"))
            ]
            assert found, f"{anchor}'s entry has no link {text!r} to {href}: {sorted(links)}"
            if href.endswith("#"):  # a section: its anchor is on the page
                assert f'id="{found[0].split("#")[1]}"' in algorithms, found
    # No fn name or page mention is left as plain text in an entry or a summary table.
    name = re.compile(r"fn(\.\w+)+(\(.*\))?")
    for path in _api_pages(site):
        parser = _PlainMentions()
        parser.feed(path.read_text(encoding="utf-8"))
        plain = [literal for literal in parser.literals if name.fullmatch(literal.strip())]
        assert not plain, f"{path.name}: fn names not linked: {plain}"
        pages = re.findall(r"docs/[\w/.-]+\.md", "".join(parser.text + parser.literals))
        assert not pages, f"{path.name}: page mentions not linked: {pages}"


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
    # the extras of README.md's development install: the line of its own after "pip install -e"
    readme = (ROOT / "README.md").read_text()
    (develop,) = re.findall(r'^\s*("\.\[[\w,]+\]")$', readme, re.MULTILINE)
    for line in (
        "python3 -m venv .venv && . .venv/bin/activate",
        'python3 -m pip install "torch==2.13.0"',
        "python3 -m pip install .",
        develop,  # the extras of README.md's development install
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
    assert "On GPUs only the kernels are measured" in text
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
