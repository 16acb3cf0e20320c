"""Simple templated formulas (x^{2}+y, \\frac{a}{b} ...): a sanity check of the rendering recipe.

The model reads ~80 % of these exactly when they are rendered the way it was trained; a recipe
that drifts (font set, scale, canvas) drops that to almost nothing. Never used as the eval split.
"""
from __future__ import annotations

import random
import re

_VARS = list("abcxyzmnkt")
_GREEK = [r"\alpha", r"\beta", r"\gamma", r"\theta", r"\lambda", r"\sigma", r"\pi", r"\mu"]


def templated_formulas(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)

    def atom() -> str:
        return rng.choice([rng.choice(_VARS), rng.choice(_GREEK), str(rng.randint(0, 9))])

    templates = [
        lambda: f"{atom()}^{{{atom()}}}+{atom()}",
        lambda: f"\\frac{{{atom()}}}{{{atom()}}}",
        lambda: f"{atom()}_{{{atom()}}}={atom()}",
        lambda: f"\\sqrt{{{atom()}+{atom()}}}",
        lambda: f"{atom()}+{atom()}-{atom()}",
        lambda: f"({atom()}+{atom()})^{{2}}",
    ]
    return [rng.choice(templates)() for _ in range(n)]


# ---- varied formulas: a small grammar over the notation docstring formulas use ---------------------
_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
_GREEK_ALL = [r"\alpha", r"\beta", r"\gamma", r"\delta", r"\epsilon", r"\zeta", r"\eta", r"\theta", r"\kappa",
              r"\lambda", r"\mu", r"\nu", r"\xi", r"\pi", r"\rho", r"\sigma", r"\tau", r"\phi", r"\chi", r"\psi",
              r"\omega", r"\Gamma", r"\Delta", r"\Theta", r"\Lambda", r"\Sigma", r"\Phi", r"\Psi", r"\Omega"]
_RELATIONS = ["=", "=", "=", r"\leq", r"\geq", "<", ">", r"\neq", r"\approx", r"\sim", r"\in", r"\to"]
_BINARY = ["+", "+", "-", "-", r"\cdot", r"\times", r"\pm", "/"]
_FUNCTIONS = [r"\sin", r"\cos", r"\tan", r"\log", r"\exp", r"\ln", r"\max", r"\min", r"\det", "f", "g", "h", "p", "P",
              "E", r"\operatorname{Var}", r"\mathrm{erf}"]
_STYLES = [r"\mathbf", r"\mathrm", r"\mathcal", r"\hat", r"\bar", r"\tilde", r"\vec", r"\dot"]
_INDEX = list("ijknmt") + ["0", "1", "2", "i+1", "n-1", "k-1", "i,j", "2k"]
_POWERS = ["2", "2", "3", "n", "k", "-1", "T", r"\prime"]
_UPPER, _FROM, _TO = ["n", "N", "n-1", r"\infty"], ["0", "a", r"-\infty"], ["1", "b", "x", r"\infty"]


def varied_formulas(n: int, seed: int = 0, max_chars: int = 64) -> list[str]:
    """``n`` random formulas from a small grammar: sums of products of symbols, scripts, fractions,
    roots, functions, big operators, brackets, accents and fonts, in at most one relation
    (``\\sqrt{Z} > \\mathbf{u}q``, ``\\exp(8w) > \\frac{z_{n}}{44a_{0} \\pm 7q_{2k}} \\times \\Gamma_{2k}``),
    at most ``max_chars`` characters. Formulas the model reads are made of these pieces; drawn at
    random they cannot be guessed from the formulas around them, so a decoder trained on them must read
    the image (the training split's formulas alone teach a decoder what docstring formulas say)."""
    rng = random.Random(seed)

    def symbol() -> str:
        r = rng.random()
        if r < 0.55:
            return rng.choice(_LETTERS[:26]) if rng.random() < 0.75 else rng.choice(_LETTERS[26:])
        if r < 0.8:
            return rng.choice(_GREEK_ALL)
        if r < 0.95:
            return str(rng.choice([rng.randint(0, 9), rng.randint(10, 99), rng.randint(2, 9)]))
        return rng.choice(["0.5", "1.0", "2.5", "0.1", "10", "100", r"\infty", r"\pi"])

    def script(base: str) -> str:
        r = rng.random()
        if r < 0.25:
            return f"{base}_{{{rng.choice(_INDEX)}}}"
        if r < 0.45:
            return f"{base}^{{{rng.choice(_POWERS + [symbol()])}}}"
        if r < 0.55:
            return f"{base}_{{{rng.choice(_INDEX)}}}^{{{rng.choice(['2', 'n', 'k', '-1', 'T'])}}}"
        return base

    def factor(depth: int) -> str:
        r = rng.random()
        if depth <= 0 or r < 0.5:
            s = symbol()
            if rng.random() < 0.12 and s.isalpha() and len(s) == 1:
                s = f"{rng.choice(_STYLES)}{{{s}}}"
            return script(s)
        if r < 0.62:
            return f"\\frac{{{expr(depth - 1, 2)}}}{{{expr(depth - 1, 2)}}}"
        if r < 0.68:
            return f"\\sqrt{{{expr(depth - 1, 2)}}}"
        if r < 0.8:
            return f"{rng.choice(_FUNCTIONS)}({expr(depth - 1, 2)})"
        if r < 0.89:
            i = rng.choice("ijkn")
            op = rng.choice([r"\sum", r"\sum", r"\prod", r"\int"])
            lims = (f"_{{{i}=0}}^{{{rng.choice(_UPPER)}}}" if op != r"\int"
                    else f"_{{{rng.choice(_FROM)}}}^{{{rng.choice(_TO)}}}")
            body = expr(depth - 1, 2)
            return f"{op}{lims} {body}" + (f" d{rng.choice('xtu')}" if op == r"\int" else "")
        left, right = rng.choice([("(", ")"), ("[", "]"), (r"\left(", r"\right)"), (r"\|", r"\|"), ("|", "|")])
        return script(f"{left}{expr(depth - 1, 3)}{right}")

    def term(depth: int) -> str:
        out = ""
        for _ in range(rng.choice([1, 1, 1, 2])):
            nxt = factor(depth)
            # a command then a letter needs a space (\alpha x, not \alphax)
            out += (" " if re.search(r"\\[A-Za-z]+$", out) and nxt[:1].isalpha() else "") + nxt
        return out

    def expr(depth: int, most: int) -> str:
        out = term(depth)
        for _ in range(rng.randint(0, most - 1)):
            out += f" {rng.choice(_BINARY)} {term(depth)}"
        return out

    formulas: list[str] = []
    while len(formulas) < n:
        f = expr(rng.choice([1, 1, 2]), 2)
        if rng.random() < 0.5:
            f += f" {rng.choice(_RELATIONS)} {expr(1, 2)}"
        if rng.random() < 0.1:
            f += rng.choice([",", ".", r", \quad " + script(symbol()) + " > 0"])
        if len(f) <= max_chars:  # longer ones would not fit the canvas at the scale the model reads
            formulas.append(f)
    return formulas
