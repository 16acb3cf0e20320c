"""Metax packages decode on ONNX Runtime 1.12.1 (what MacaRT forks) as they do on the pinned ORT.

The real model's Metax package, float and with a symmetric per-channel INT8 QDQ encoder, reads the
first eval formulas of the corpus greedily twice: with ``OnnxPackage`` on the pinned onnxruntime,
and with ``macart_decode.py`` (numpy + onnxruntime only) in the Python 3.10 / ORT 1.12.1 venv of
``macart_env.py``. The float package's greedy sequences must be the same token for token (29 of 30);
the INT8 package's may differ where a last-bit difference crosses a quantization step, but on fewer
formulas than INT8 itself changes against float.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from export_session import artifacts_root, run_export
from macart_env import MacaRTEnvError, macart_python
import macart_env

N_EVAL = 30            # eval formulas decoded by both runtimes (batch 1, one thread each)
N_SPECULATIVE = 10     # the first of them also read speculatively on ORT 1.12.1
N_CALIB = 8            # calib formulas the INT8 encoder's ranges come from
MIN_IDENTICAL = 29 / 30  # greedy sequences identical across ORT versions (float package: 30/30 measured)
METHOD = "minmax"
FLOAT_GROUP_SUFFIX = ".mlp.3"  # the MLPs' output projections stay float


@pytest.fixture(scope="session")
def ort112() -> Path:
    """The ORT 1.12.1 interpreter; made first so a machine without Python 3.10 fails in seconds."""
    try:
        return macart_python()
    except MacaRTEnvError as exc:
        pytest.fail(f"MacaRT stand-in unavailable: {exc}")


def _images(pkg: Path, formulas: list[str]) -> np.ndarray:
    """Rendered formulas preprocessed by the package's own preprocess.json, float32 [N, C, H, W]."""
    from pipeline.data.render import render_formula
    from pipeline.export.runtime import OnnxPackage

    package = OnnxPackage(pkg, threads=1)
    return np.stack([package.preprocess(render_formula(f)) for f in formulas]).astype(np.float32)


@pytest.fixture(scope="module")
def float_package(ort112) -> Path:
    run_export("target=metax", "export.quantized=none", "export.name=macart-float")
    return artifacts_root() / "macart-float"


@pytest.fixture(scope="module")
def int8_package(float_package, corpus, tmp_path_factory) -> Path:
    """A Metax package whose encoder is INT8 in 12 of 16 projections: ``qdq.calibrate`` + ``qdq.quantize``
    (symmetric, weights per channel) on the plain float encoder, ranges from rendered calib formulas."""
    import onnx
    from onnxruntime.quantization import CalibrationDataReader

    from conftest import make_ctx
    from pipeline.adapters import load_adapter
    from pipeline.export.build import exported_graphs
    from pipeline.export.transforms import simplify
    from pipeline.quantization import qdq
    from pipeline.quantization.groups import find_groups

    work = tmp_path_factory.mktemp("macart-qdq")
    ctx = make_ctx(artifacts_root())
    adapter = load_adapter("latex_ocr_junia", "package")
    float_encoder = work / "encoder.std.onnx"
    onnx.save(simplify(exported_graphs(adapter, 17, ctx.model_hash("original"))["encoder"], "encoder"),
              str(float_encoder))
    calib = _images(float_package, [f.latex for f in corpus if f.split == "calib"][:N_CALIB])

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.rows = iter({"images": im[None]} for im in calib)

        def get_next(self):
            return next(self.rows, None)

    cache = work / f"ranges.{METHOD}.json"
    qdq.calibrate(float_encoder, Reader(), METHOD, cache)
    weights = [g for g in find_groups(onnx.load(str(float_encoder))) if g.kind == "weights"]
    # every projection INT8 but the MLPs' second one, whose input (after GELU) per-tensor MinMax
    # quantizes worst: memory cosine 0.976 with it INT8, 0.999 without (export's INT8 floor: 0.98)
    int8 = [g.node for g in weights if not g.name.endswith(FLOAT_GROUP_SUFFIX)]
    assert 0 < len(int8) < len(weights)
    qdq_encoder = work / "encoder.qdq.onnx"
    assert qdq.quantize(float_encoder, qdq_encoder, cache, METHOD, int8)
    run_export("target=metax", f"export.qdq_encoder={qdq_encoder}", "export.name=macart-int8")
    return artifacts_root() / "macart-int8"


@pytest.fixture(scope="module")
def eval_images(ort112, float_package, corpus, tmp_path_factory) -> Path:
    formulas = [f.latex for f in corpus if f.split == "eval"][:N_EVAL]
    path = tmp_path_factory.mktemp("macart-eval") / "images.npy"
    np.save(path, _images(float_package, formulas))
    return path


@pytest.fixture(scope="module")
def readings(eval_images):
    """``readings(pkg)`` -> greedy token ids of the eval images on the pinned ORT and on ORT 1.12.1
    (each package decoded once per module, batch 1, one thread)."""
    from pipeline.export.runtime import OnnxPackage

    done: dict[str, dict] = {}

    def read(pkg: Path) -> dict:
        if pkg.name not in done:
            meta = json.loads((pkg / "package.json").read_text())
            max_length, eos = int(meta["max_length"]), int(meta["eos_id"])
            pinned = OnnxPackage(pkg, threads=1).generate(np.load(eval_images), max_length, batch_size=1).token_ids
            old = macart_env.decode(pkg, eval_images, eval_images.with_name(f"{pkg.name}.ort112.json"), threads=1)
            same = [a == b for a, b in zip(pinned, old["sequences"])]
            # the package's verify graph and drafter on ORT 1.12.1: speculative readings are its greedy ones
            few = eval_images.with_name("speculative.npy")
            if not few.is_file():
                np.save(few, np.load(eval_images)[:N_SPECULATIVE])
            spec = macart_env.decode(pkg, few, eval_images.with_name(f"{pkg.name}.ort112.spec.json"),
                                     threads=1, speculative=True)
            summary = {"package": pkg.name, "onnxruntime_1_12": old["onnxruntime"], "n": len(same),
                       "identical": sum(same), "differ_at": [i for i, x in enumerate(same) if not x],
                       "speculative_identical": sum(a == b for a, b in zip(spec["sequences"], old["sequences"])),
                       "speculative_calls": spec["speculative"]["decoder_calls"],
                       "speculative_tokens": sum(len(x) for x in old["sequences"][:N_SPECULATIVE]),
                       "hit_cap": sum(len(x) >= max_length - 1 and x[-1:] != [eos] for x in pinned)}
            print(f"[macart] {json.dumps(summary)}")
            done[pkg.name] = {**summary, "pinned": pinned, "ort112": old["sequences"]}
        return done[pkg.name]

    return read


@pytest.mark.slow
def test_decode_script_is_onnx_package_greedy_on_the_pinned_runtime(float_package, eval_images):
    """The script alone, on the pinned ORT: a difference below is then the runtime's, not the script's."""
    import subprocess
    import sys

    from pipeline.export.runtime import OnnxPackage

    few = eval_images.with_name("few.npy")
    np.save(few, np.load(eval_images)[:4])
    out = few.with_name("few.pinned.json")
    subprocess.run([sys.executable, str(macart_env.DECODER), str(float_package), str(few), str(out), "--threads", "1",
                    "--batch-size", "2"], check=True, timeout=600)
    got = json.loads(out.read_text())
    want = OnnxPackage(float_package, threads=1).generate(np.load(few), got["max_length"], batch_size=2).token_ids
    assert got["sequences"] == want


def _check(r: dict) -> None:
    assert r["onnxruntime_1_12"] == "1.12.1"
    assert r["n"] == N_EVAL
    # speculative decoding on ORT 1.12.1 (verify graph + drafter) writes its plain greedy readings there
    assert r["speculative_identical"] == N_SPECULATIVE
    assert r["speculative_calls"] < r["speculative_tokens"]


@pytest.mark.slow
def test_float_metax_package_decodes_alike_on_onnxruntime_1_12(float_package, readings):
    r = readings(float_package)
    _check(r)
    assert r["identical"] >= math.ceil(MIN_IDENTICAL * r["n"]), {k: v for k, v in r.items() if k not in ("pinned", "ort112")}


@pytest.mark.slow
def test_int8_metax_package_differs_across_runtimes_less_than_int8_from_float(float_package, int8_package, readings):
    """The two runtimes disagree on fewer INT8 readings than INT8 and float disagree on the pinned one:
    MacaRT's differences stay inside the noise the quantization itself brings."""
    q, f = readings(int8_package), readings(float_package)
    _check(q)
    int8_vs_float = sum(a == b for a, b in zip(q["pinned"], f["pinned"]))
    print(f"[macart] int8 vs float on the pinned ORT: {int8_vs_float}/{q['n']} identical")
    assert q["identical"] >= int8_vs_float, (q["identical"], int8_vs_float)


def test_decode_script_imports_numpy_and_onnxruntime_only():
    """It runs where torch and this repository's dependencies are not installed (the ORT 1.12.1 venv);
    so does ``pipeline/decoding.py``, which it loads by file path (the layout-run cap)."""
    import ast

    def roots(path):
        tree = ast.parse(path.read_text())
        found = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        return found | {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}

    stdlib = {"__future__", "argparse", "collections", "dataclasses", "importlib", "json", "re", "sys", "pathlib",
              "threading", "typing"}
    assert roots(macart_env.DECODER) - stdlib == {"numpy", "onnxruntime"}
    decoding = macart_env.DECODER.parent.parent / "pipeline" / "decoding.py"
    assert decoding.is_file() and roots(decoding) - stdlib == {"numpy"}
    drafting = macart_env.DECODER.parent.parent / "pipeline" / "drafting.py"  # speculative decoding's drafters
    assert drafting.is_file() and roots(drafting) - stdlib == {"numpy"}  # numpy: the student's graphs' inputs


def test_no_python_3_10_fails_with_what_was_tried(monkeypatch, tmp_path):
    monkeypatch.setenv("MACART_PYTHON", str(tmp_path / "python3.10"))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(macart_env.glob, "glob", lambda pattern: [])
    with pytest.raises(MacaRTEnvError, match=r"no Python 3\.10 interpreter .* set MACART_PYTHON"):
        macart_env.find_python310()
