"""The house's rules that a reader can check by reading the source: stages orchestrate (short functions),
code and config carry no journal marks."""
from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import REPO

STAGES = REPO / "pipeline" / "stages"
RUN_LINES = 40        # a stage's run reads like its docstring
FUNCTION_LINES = 60   # any function in a stage module


def function_lengths(path: Path) -> dict[str, int]:
    """Every function's lines in ``path``, from its ``def`` to its last line (a method as Class.name)."""
    out = {}
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                owner = f"{node.name}." if isinstance(node, ast.ClassDef) else ""
                out[f"{owner}{child.name}"] = child.end_lineno - child.lineno + 1
    return out


def test_stage_functions_are_short_and_run_reads_like_its_docstring():
    long_runs, long_functions = [], []
    for path in sorted(STAGES.glob("*.py")):
        for name, lines in function_lengths(path).items():
            if name == "run" and lines > RUN_LINES:
                long_runs.append(f"{path.name}::{name} {lines}")
            if lines > FUNCTION_LINES:
                long_functions.append(f"{path.name}::{name} {lines}")
    assert not long_runs, f"stage run over {RUN_LINES} lines: {long_runs}"
    assert not long_functions, f"stage functions over {FUNCTION_LINES} lines: {long_functions}"


def test_the_length_count_sees_nested_functions_and_methods(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def run():\n    def inner():\n        pass\n    return 1\n\n\nclass A:\n    def f(self):\n        pass\n")
    assert function_lengths(src) == {"run": 4, "inner": 2, "A.f": 2}


# a journal mark: "run 16", a date; a link to a dated record in docs/results/ is a file's name, not a mark
RUN_MARK = re.compile(r"\brun \d+\b", re.IGNORECASE)
DATE_MARK = re.compile(r"(?<!docs/results/)\b20\d\d-\d\d-\d\d")


def journal_marks(text: str) -> list[str]:
    return [m.group(0) for rx in (RUN_MARK, DATE_MARK) for m in rx.finditer(text)]


def test_code_and_config_carry_no_run_numbers_or_dates():
    files = [*(REPO / "pipeline").rglob("*.py"), *(REPO / "conf").rglob("*.yaml")]
    found = {str(p.relative_to(REPO)): marks for p in files if (marks := journal_marks(p.read_text(encoding="utf-8")))}
    assert not found, found


def test_the_journal_scan_finds_marks_and_lets_record_links_be():
    assert journal_marks("# chosen in run 16 (2026-12-05)") == ["run 16", "2026-12-05"]
    assert journal_marks("# docs/results/2026-12-03-prune-pooled-keys.md: the recovery") == []


# ---- contracts once: the names stages and packages meet by are declared in one place -------------------
NAMES = REPO / "pipeline" / "names.py"
CODE = [*(REPO / "pipeline").rglob("*.py"), *(REPO / "benchmarks").rglob("*.py")]
DECLARED_ONCE = ("manifest.json", "formulas.jsonl", "package.json", "decoder_first", "decoder_step", "decoder_verify")
# where "encoder" is the model's part (finetune scope, parameter and config keys), not the package's graph
ENCODER_MEANS_THE_MODEL_PART = {"pipeline/stages/prune.py", "pipeline/pruning/recover.py", "pipeline/quantization/groups.py",
                                "pipeline/quantization/qat.py", "pipeline/adapters/hf_vision_encoder_decoder.py",
                                "pipeline/adapters/latex_ocr_junia.py", "pipeline/adapters/junia_to_hf.py"}


def quoted(text: str, literal: str) -> int:
    return text.count(f'"{literal}"') + text.count(f"'{literal}'")


def test_artifact_and_graph_names_are_spelled_once_in_pipeline_names():
    texts = {str(p.relative_to(REPO)): p.read_text(encoding="utf-8") for p in CODE}
    for literal in DECLARED_ONCE:
        where = {f: n for f, text in texts.items() if (n := quoted(text, literal))}
        assert where == {"pipeline/names.py": 1}, (literal, where)
    where = {f for f, text in texts.items() if quoted(text, "encoder") and f not in ENCODER_MEANS_THE_MODEL_PART}
    assert where == {"pipeline/names.py"}, where


def _attribute_reads(path: Path, attr: str, owners: tuple[str, ...]) -> int:
    """Reads of ``<owner>.attr`` where the owner is a name or attribute in ``owners`` (``cfg.model.max_length``)."""
    count = 0
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Attribute) and node.attr == attr:
            owner = node.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", None)
            count += name in owners
    return count


def test_the_model_limits_are_read_from_the_config_once():
    for attr in ("max_length", "batch_size", "threads"):
        where = {str(p.relative_to(REPO)): n for p in CODE if (n := _attribute_reads(p, attr, ("model", "mcfg")))}
        # the CLI sets torch's threads before any stage, from the config itself
        where.pop("pipeline/__main__.py", None)
        assert where == {"pipeline/context.py": 1}, (attr, where)


def test_a_packages_decode_cap_is_read_from_its_metadata_once():
    texts = {str(p.relative_to(REPO)): p.read_text(encoding="utf-8") for p in CODE}
    where = {f: n for f, text in texts.items() if (n := len(re.findall(r"""\.meta\[["']max_length["']\]""", text)))}
    assert where == {"pipeline/export/runtime.py": 1}, where
