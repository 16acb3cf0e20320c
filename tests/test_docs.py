"""Every config key the README and docs/ name exists: a user who copies `quantize.search_images=...`
from a page gets the key, not Hydra's "Key not in" error."""
from __future__ import annotations

import re

import pytest
from omegaconf import OmegaConf

from conftest import REPO, compose_cfg

ROOTS = ("eval", "prune", "tokenizer", "distill", "calibrate", "quantize", "export", "benchmark", "infer", "serve",
         "model", "data", "target", "artifacts")
# `export.md`, `quantize.py`, `benchmark.json` ...: files, not keys
FILE_SUFFIXES = {"md", "py", "json", "jsonl", "yaml", "png", "onnx", "safetensors", "txt", "sh", "tsv", "log", "pt"}
KEY = re.compile(r"(?<![\w./'-])\+?(" + "|".join(ROOTS) + r")\.([a-z_][a-z0-9_]*)(?:\.([a-z_][a-z0-9_]*))?")
# named on a page, but not config keys: what each is
NOT_KEYS = {("tokenizer", "normalizer"): "the HF tokenizer object's attribute (docs/tokenizer.md's round trip)"}
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def named_keys(text: str) -> set[tuple[str, str]]:
    return {(root, key) for root, key, _ in KEY.findall(text) if key not in FILE_SUFFIXES and (root, key) not in NOT_KEYS}


@pytest.fixture(scope="module")
def known() -> dict[str, set[str]]:
    keys: dict[str, set[str]] = {}
    for overrides in ([], ["data=image_folder", "data.path=x"], ["target=metax"], ["target=tensorrt"]):
        cfg = OmegaConf.to_container(compose_cfg(overrides), resolve=False)
        for root in ROOTS:
            keys.setdefault(root, set()).update(cfg.get(root) or {})
    return keys


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_config_key_a_page_names_exists(page, known):
    missing = sorted(f"{root}.{key}" for root, key in named_keys(page.read_text(encoding="utf-8"))
                     if key not in known[root])
    assert not missing, f"{page.name} names keys the config does not have: {missing}"


def test_the_scan_sees_keys_and_skips_file_names(known):
    assert named_keys("`quantize.search_images=256`, docs/export.md, +benchmark.packages.x=y, prune.py") == {
        ("quantize", "search_images"), ("benchmark", "packages")}
    assert "search_images" in known["quantize"] and "no_such" not in known["quantize"]
    assert len(named_keys((REPO / "README.md").read_text(encoding="utf-8"))) > 30  # the README's keys are seen


def _relative_links(page) -> list[str]:
    """The page's links to files of this repository (web addresses, anchors and generated artifacts aside)."""
    links = re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8"))
    return [t for t in links if not t.startswith(("http:", "https:", "mailto:")) and "artifacts/" not in t]


@pytest.mark.parametrize("page", [*PAGES, *sorted((REPO / "docs" / "results").glob("*.md"))],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_to_a_repository_file_resolves(page):
    missing = [t for t in _relative_links(page) if not (page.parent / t).exists()]
    assert not missing, f"{page.relative_to(REPO)} links to files that do not exist: {missing}"


def test_each_stage_page_links_its_dated_records_and_each_record_its_page():
    """docs/results/ holds the history, one dated file per experiment; a record names the page it supports."""
    records = sorted((REPO / "docs" / "results").glob("*.md"))
    assert records and all(re.fullmatch(r"\d{4}-\d{2}-\d{2}-[a-z0-9-]+\.md", p.name) for p in records)
    linked = {t.removeprefix("results/") for page in PAGES for t in _relative_links(page) if t.startswith("results/")}
    assert {p.name for p in records} <= linked, sorted({p.name for p in records} - linked)
    for p in records:
        assert any(t.startswith("../") and t.endswith(".md") for t in _relative_links(p)), p.name


def test_the_readmes_results_table_is_the_one_its_run_summary_gives():
    """README's table is generated (benchmarks/readme_table.py) from the run summary its comment names."""
    import json

    from pipeline.benchmarking.summary import readme_table

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    source = re.search(r"<!-- results table: benchmarks/readme_table.py (\S+) -->", readme)
    assert source, "README names the summary its results table comes from"
    assert readme_table(json.loads((REPO / source.group(1)).read_text(encoding="utf-8"))) in readme


# ---- pages for readers: short, the current recipe; the history is in docs/results/ --------------------------

README_MAX_LINES = 120
PAGE_MAX_LINES = 250
STAGE_PAGES = sorted((REPO / "docs").glob("*.md"))  # docs/results/ (the dated records) aside
# a lab journal's mark: "run 16", "Run 8:", "runs 14-16", "runs 15 and 16" (not "runs 200 bf16 steps")
JOURNAL_MARK = re.compile(r"\brun \d+\b|\bruns \d+\s*(?:-|–|and|to)\s*\d+\b", re.IGNORECASE)


def test_the_readme_is_at_most_120_lines():
    n = len((REPO / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}: move narrative to docs/results/)"


@pytest.mark.parametrize("page", STAGE_PAGES, ids=lambda p: p.name)
def test_each_docs_page_is_at_most_250_lines(page):
    n = len(page.read_text(encoding="utf-8").splitlines())
    assert n <= PAGE_MAX_LINES, f"docs/{page.name} has {n} lines (at most {PAGE_MAX_LINES}: history to docs/results/)"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_page_carries_run_n_journal_marks(page):
    """A page gives the current recipe; "run 16" belongs to the dated record that measured it."""
    marks = sorted({m.group(0) for m in JOURNAL_MARK.finditer(page.read_text(encoding="utf-8"))})
    assert not marks, f"{page.relative_to(REPO)} carries journal marks {marks}: name the record instead"


def test_the_journal_mark_scan_sees_marks_and_skips_prose():
    assert [m.group(0) for m in JOURNAL_MARK.finditer(
        "in run 16, Run 8: ok, runs 14-16 and runs 15 and 16; `stage=all` runs 200 bf16 steps, make run 2x")] == [
        "run 16", "Run 8", "runs 14-16", "runs 15 and 16"]
    assert any(JOURNAL_MARK.search(p.read_text(encoding="utf-8")) for p in (REPO / "docs" / "results").glob("*.md"))
