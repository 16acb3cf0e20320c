"""The LaTeX atom grammar, and the normalizer and pre-tokenizer built on it from ``tokenizers`` parts.

An *atom* is the smallest unit a formula tokenizer may never cut:

* a control word, ``\\`` followed by letters (``\\frac``, ``\\alpha``, ``\\left``);
* a control symbol, ``\\`` followed by one non-letter (``\\,``, ``\\{``, ``\\\\``, ``\\ ``);
* any other single character (braces, ``^``, ``_``, digits, letters, operators, one space).

Both regexes below are written once and used twice: by Python's ``re`` (to count atoms and check
integrity) and by the Oniguruma engine inside ``tokenizers`` (serialized into ``tokenizer.json``);
they use only syntax both engines read the same way.

Normalization (the ``normalizer`` of ``tokenizer.json``, so it runs in Rust at serving time):

1. every whitespace run becomes one space (``\\n``, tabs, double spaces);
2. one display-math wrapper around the whole formula is removed: ``$ $``, ``$$ $$``, ``\\[ \\]``,
   ``\\( \\)``, ``\\begin{equation|align|gather|displaymath|math|multline|eqnarray}[*]`` ... ``\\end{..}``;
3. a leading space and a trailing space are removed (a trailing control space ``\\ `` is kept).

Nothing else changes: ``\\left``, ``\\,`` and braces stay, because the model must emit them. "The
normalized x" in the round-trip criterion is exactly this function's output,
:func:`normalize_formula`, i.e. ``tokenizer.normalizer.normalize_str(x)``.
"""
from __future__ import annotations

import re
from functools import lru_cache

from tokenizers import Regex, normalizers, pre_tokenizers

from pipeline.metrics import DISPLAY_ENVIRONMENTS

# One atom. Order matters: a control word before a control symbol before a lone character; a lone
# backslash (only possible at the very end of a string) is an atom of its own.
ATOM_PATTERN = r"\\[a-zA-Z]+|\\[^a-zA-Z]|\\|[^\\]"
# A LaTeX command: the atoms that start with a backslash and are longer than one character.
COMMAND_PATTERN = r"\\[a-zA-Z]+|\\[^a-zA-Z]"
# A pre-tokenizer word: an optional leading space, then a run of whole non-space atoms. BPE merges
# happen inside a word, so words are made of atoms and a word boundary never falls inside one.
WORD_PATTERN = r" ?(?:\\[a-zA-Z]+|\\[^a-zA-Z]|[^\\ ])+"

# the wrapper environments are metrics' list (one list; metrics also strips inner alignment ones)
_ENVS = r"(?:" + "|".join(DISPLAY_ENVIRONMENTS) + r")\*?"
_OPEN = r"\A ?(?:\$\$?|\\\[|\\\(|\\begin\{" + _ENVS + r"\}) ?"
_CLOSE = r"(?<!\\) ?(?:\$\$?|\\\]|\\\)|\\end\{" + _ENVS + r"\}) ?\z"
_EDGE_SPACE = r"\A |(?<!\\) \z"

_ATOM_RE = re.compile(ATOM_PATTERN)
_COMMAND_RE = re.compile(COMMAND_PATTERN)


def build_normalizer() -> normalizers.Normalizer:
    return normalizers.Sequence([
        normalizers.Replace(Regex(r"\s+"), " "),
        normalizers.Replace(Regex(_OPEN), ""),
        normalizers.Replace(Regex(_CLOSE), ""),
        normalizers.Replace(Regex(_EDGE_SPACE), ""),
    ])


def build_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    # "isolated": every match is a word, and so is any stretch the regex does not match (a lone
    # trailing backslash), so no character is ever dropped.
    return pre_tokenizers.Split(Regex(WORD_PATTERN), behavior="isolated", invert=False)


@lru_cache(maxsize=1)
def _normalizer() -> normalizers.Normalizer:
    return build_normalizer()


def normalize_formula(latex: str) -> str:
    """The tokenizer's normalized form of ``latex`` (the same Rust code ``tokenizer.json`` runs)."""
    return _normalizer().normalize_str(latex)


@lru_cache(maxsize=1)
def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return build_pre_tokenizer()


def words(normalized: str) -> list[str]:
    """Pre-tokenizer words of a normalized formula, as ``tokenizer.json`` cuts them."""
    return [w for w, _ in _pre_tokenizer().pre_tokenize_str(normalized)]


def atoms(text: str) -> list[str]:
    return _ATOM_RE.findall(text)


def is_command(atom: str) -> bool:
    return len(atom) > 1 and atom.startswith("\\")


def renderer_commands() -> list[str]:
    """The commands the project's renderer (matplotlib mathtext) knows: its symbol table and the
    parser's accent, function, font, operator, delimiter and spacing tables. The corpus keeps only
    formulas mathtext renders, so these are the commands a formula image can show. The tables are
    private to matplotlib; one that moves is skipped (the manifest records matplotlib's version)."""
    import matplotlib._mathtext as mathtext
    import matplotlib._mathtext_data as mathtext_data

    parser = mathtext.Parser
    names = {"\\" + n for n in getattr(mathtext_data, "tex2uni", {})}
    for table in ("_accent_map", "_wide_accents", "_function_names", "_overunder_functions", "_fontnames"):
        names |= {"\\" + n for n in getattr(parser, table, ())}
    names |= {"\\math" + n for n in getattr(parser, "_fontnames", ())}
    for table in ("_space_widths", "_delims", "_ambi_delims", "_spaced_symbols", "_overunder_symbols",
                  "_dropsub_symbols", "_punctuation_symbols"):
        names |= {n for n in getattr(parser, table, ()) if isinstance(n, str)}
    return sorted(n for n in names if is_command(n) and atoms(n) == [n])


def command_spans(normalized: str) -> list[tuple[int, int]]:
    """Character spans of the LaTeX commands in a normalized formula."""
    return [m.span() for m in _COMMAND_RE.finditer(normalized)]
