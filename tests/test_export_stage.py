"""The export stage on the real model: ORT CPU package and its parity, a Metax package from a QDQ
encoder, the rule-breaking and parity-failure paths (no package folder written)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from export_session import FORMULAS, MAX_LENGTH, artifacts_root, ort_package, run_export, session_ops
from pipeline.errors import PipelineError

pytestmark = pytest.mark.slow  # every test here exports or decodes with the real model


@pytest.fixture(scope="module")
def ort_pkg() -> Path:
    return ort_package()


def test_ort_cpu_package_is_complete_and_matches_torch(ort_pkg):
    meta = json.loads((ort_pkg / "package.json").read_text())
    for name in ("encoder.onnx", "decoder_first.onnx", "decoder_step.onnx", "tokenizer.json", "preprocess.json",
                 "provider_options.json", "report.md", "op_histogram.png", "manifest.json", "parity.json"):
        assert (ort_pkg / name).is_file(), name
    assert meta["max_length"] == MAX_LENGTH and meta["num_layers"] == 4
    parity = json.loads((ort_pkg / "parity.json").read_text())
    assert parity["tokens"]["n"] == 2
    assert parity["tokens"]["identical"] == 1.0
    for name in ("encoder.memory", "decoder_first.logits", "decoder_step.logits"):
        assert parity["tensors"][name]["cosine"] > 0.9999, name
    encoder = onnx.load(str(ort_pkg / "encoder.onnx"))
    ops = {n.op_type for n in encoder.graph.node}
    # LayerNorm one op, not decomposed; attention and GELU fused; the residual Add left to the
    # session (the offline-fused SkipLayerNormalization ran 4x slower on ORT's CPU kernel)
    assert "LayerNormalization" in ops and "MultiHeadAttention" in ops and "Gelu" in ops
    assert "SkipLayerNormalization" not in ops and "ReduceMean" not in ops
    # the last block's residual is a Sum: the session does not fuse it into SkipLayerNormalization either
    assert "Sum" in ops and "SkipLayerNormalization" not in session_ops(ort_pkg / "encoder.onnx")
    report = (ort_pkg / "report.md").read_text()
    assert "com.microsoft.MultiHeadAttention" in report and "| op | exported | simplified | fused |" in report
    manifest = json.loads((ort_pkg / "manifest.json").read_text())
    assert "encoder.onnx" in manifest["outputs"]


def test_the_package_holds_each_weight_once(ort_pkg):
    """The decoder's three graphs read one shared file: the package's graphs are the size of the
    model's parameters in float (62.9 MB with a copy per graph; 31.9 MB against 31.5 MB of parameters)."""
    import hashlib

    from pipeline.adapters.latex_ocr_junia import LatexOcrJuniaAdapter
    from pipeline.benchmarking.variants import package_files

    meta = json.loads((ort_pkg / "package.json").read_text())
    assert meta["weights"]["graphs"] == ["decoder_first", "decoder_step", "decoder_verify"]
    seen = {}
    for g in meta["weights"]["graphs"]:
        for t in onnx.load(str(ort_pkg / f"{g}.onnx")).graph.initializer:
            if t.data_location == onnx.TensorProto.EXTERNAL:
                where = {e.key: e.value for e in t.external_data}
                assert where["location"] == meta["weights"]["file"]
                assert seen.setdefault(hashlib.sha256(t.raw_data).hexdigest(), where["offset"]) == where["offset"]
    model = LatexOcrJuniaAdapter.load("package").model
    params = sum(p.numel() * p.element_size() for p in {p.data_ptr(): p for p in model.parameters()}.values())
    graphs = sum(p.stat().st_size for p in package_files(ort_pkg) if p.suffix in (".onnx", ".data"))
    assert abs(graphs / params - 1) < 0.10, (graphs, params)


def test_the_package_decodes_speculatively_as_it_decodes_greedily(ort_pkg):
    """The real model's package: a verify graph whose logits are the steps', an ngram drafter from its
    own readings of train formulas, and speculative readings token for token its greedy ones."""
    from pipeline.data.render import render_formula
    from pipeline.export.runtime import OnnxPackage

    meta = json.loads((ort_pkg / "package.json").read_text())
    assert meta["graphs"]["decoder_verify"] == "decoder_verify.onnx" and meta["drafter"] == "drafter.json"
    verify_ops = {n.op_type for n in onnx.load(str(ort_pkg / "decoder_verify.onnx")).graph.node}
    assert "MultiHeadAttention" in verify_ops  # self-attention fused with unidirectional=1, cross as in the step
    parity = json.loads((ort_pkg / "parity.json").read_text())
    assert parity["tensors"]["decoder_verify.logits"]["cosine"] > 0.9999
    s = parity["speculative"]
    assert s["drafter"] == "ngram" and s["identical"] == 1.0 and s["n"] == 2
    drafter = json.loads((ort_pkg / "drafter.json").read_text())
    assert drafter["kind"] == "ngram" and "8 train formulas" in drafter["source"]["readings"]
    assert drafter["source"]["readings"].endswith("by package export-ort_cpu")  # its name, not the temporary folder's
    fast, plain = OnnxPackage(ort_pkg, threads=1), OnnxPackage(ort_pkg, threads=1, speculative=False)
    assert fast.speculative and not plain.speculative
    # formulas of another package than the drafter's, the layout cap on (the model config's default)
    formulas = [r"\frac{a+b}{c}", r"\sum_{i=1}^{n} i^2", r"\sqrt{x^2+y^2}", r"\alpha\beta\gamma"]
    images = np.stack([fast.preprocess(render_formula(f)) for f in formulas]).astype(np.float32)
    assert fast.layout_run_cap > 0
    got, want = fast.generate(images, MAX_LENGTH, batch_size=1), plain.generate(images, MAX_LENGTH, batch_size=1)
    assert got.token_ids == want.token_ids
    assert sum(got.calls) < sum(want.calls) == sum(len(t) for t in want.token_ids)
    assert s["max_tie_margin"] == 0.0 and s["tie_margins"] == []
    # greedy decoding on the verify graph (a lone token padded to two rows): what the loop writes, token
    # for token, whatever the drafter proposes: its own drafts, or always a wrong (banned) token
    assert s["identical_verify_greedy"] == 1.0 and s["verify_greedy_differing"] == []
    exact = plain.verify_greedy(images, MAX_LENGTH)
    assert exact.token_ids == got.token_ids and exact.calls == [len(t) for t in exact.token_ids]
    fast.drafter.propose = lambda ids, k, at_least=0: [fast.bos] * k
    wrong = fast.generate(images, MAX_LENGTH, batch_size=1)
    assert wrong.token_ids == exact.token_ids and wrong.calls == exact.calls


def test_a_cpu_package_reads_a_batch_image_by_image_speculatively(ort_pkg, tmp_path):
    """ort_cpu (TargetConfig.speculative_batches): a batch of several images is encoded at once, then each
    image decoded speculatively on its own, as a batch of one is; a package without the setting (a GPU
    target's, or one from before it) decodes the batch in greedy steps."""
    import shutil

    from pipeline.data.render import render_formula
    from pipeline.export.runtime import OnnxPackage

    assert json.loads((ort_pkg / "package.json").read_text())["speculative_batches"] is True
    fast = OnnxPackage(ort_pkg, threads=1)
    assert fast.speculative_batches and not OnnxPackage(ort_pkg, threads=1, speculative=False).speculative_batches
    formulas = [r"\frac{a+b}{c}", r"\sum_{i=1}^{n} i^2", r"\sqrt{x^2+y^2}", r"\alpha\beta\gamma", r"a_{n+1}"]
    images = np.stack([fast.preprocess(render_formula(f)) for f in formulas]).astype(np.float32)
    one = fast.generate(images, MAX_LENGTH, batch_size=1)
    batched = fast.generate(images, MAX_LENGTH, batch_size=3)  # a batch of 3, then one of 2
    assert batched.token_ids == one.token_ids and batched.calls == one.calls
    assert sum(batched.calls) < sum(len(t) for t in batched.token_ids)  # fewer decoder calls than tokens
    greedy_pkg = tmp_path / "greedy-batches"
    shutil.copytree(ort_pkg, greedy_pkg)
    meta = json.loads((greedy_pkg / "package.json").read_text())
    del meta["speculative_batches"]
    (greedy_pkg / "package.json").write_text(json.dumps(meta))
    other = OnnxPackage(greedy_pkg, threads=1)
    assert other.speculative and not other.speculative_batches
    steps = other.generate(images, MAX_LENGTH, batch_size=3)
    assert steps.calls == [len(t) for t in steps.token_ids]  # one decoder call a token: greedy steps
    assert steps.token_ids == OnnxPackage(greedy_pkg, threads=1, speculative=False).generate(
        images, MAX_LENGTH, batch_size=3).token_ids


def test_a_packages_sessions_do_not_spin_between_calls_and_read_the_same(ort_pkg):
    """A package runs its sessions in turn, each with its own thread pool: none spins after its call (a
    spinning pool took the cores the next session needed: 2.1x slower at batch 1 with ONNX Runtime's
    default threads), and the readings are those of one thread."""
    from pipeline.data.render import render_formula
    from pipeline.export.runtime import OnnxPackage

    pooled = OnnxPackage(ort_pkg, threads=2)
    pooled.verify(np.zeros((1, 2), np.int64), *pooled.first(np.zeros((1, 1), np.int64),
                                                              pooled.encode(np.zeros((1, *pooled.meta["input_shape"]),
                                                                                     np.float32)))[1:])
    for graph, session in pooled.sessions.items():
        options = session.get_session_options()
        assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0", graph
        assert options.intra_op_num_threads == 2, graph
    images = np.stack([pooled.preprocess(render_formula(f)) for f in (r"\frac{a}{b}", r"x^{2}+y")]).astype(np.float32)
    assert pooled.generate(images, MAX_LENGTH, 2).token_ids == OnnxPackage(ort_pkg, threads=1).generate(
        images, MAX_LENGTH, 2).token_ids


def test_the_drafters_readings_in_side_by_side_sessions_are_one_sessions_in_order(ort_pkg):
    """export.drafter=ngram reads the train formulas in one single-thread session a core, each every n-th
    image: the readings come back in the images' order, as one session reads them."""
    from pipeline.data.render import render_formula
    from pipeline.export.drafter import read
    from pipeline.export.runtime import OnnxPackage

    package = OnnxPackage(ort_pkg, threads=1, speculative=False)
    formulas = [r"\frac{a+b}{c}", r"x^2", r"\sqrt{y}", r"\alpha+\beta", r"a_{n+1}"]
    images = np.stack([package.preprocess(render_formula(f)) for f in formulas]).astype(np.float32)
    want = package.generate(images, MAX_LENGTH, batch_size=2).token_ids
    assert len({tuple(w) for w in want}) == len(formulas)  # five different readings: the order is checked
    assert read(ort_pkg, images, MAX_LENGTH, 2, workers=2) == [list(w) for w in want]
    assert read(ort_pkg, images[:1], MAX_LENGTH, 2, workers=3) == [list(want[0])]


def test_a_reading_that_leaves_greedy_at_a_confident_token_is_told_from_a_near_tie(ort_pkg):
    """export's check of speculative readings: where a reading first differs from the package's greedy
    one, the step logits' margin between the two tokens (a near-tie flip: small; a broken loop: wide)."""
    from pipeline.data.render import render_formula
    from pipeline.export.drafter import tie_margin
    from pipeline.export.runtime import OnnxPackage

    package = OnnxPackage(ort_pkg, threads=1, speculative=False)
    image = package.preprocess(render_formula(r"\frac{a+b}{c}")).astype(np.float32)
    greedy = package.generate(image[None], MAX_LENGTH, batch_size=1).token_ids[0]
    assert tie_margin(package, image, greedy, greedy) == 0.0
    # the logits after BOS + greedy[:2]: the runner-up and the least likely token instead of greedy's third
    logits, past, cross = package.first(np.full((1, 1), package.bos, np.int64), package.encode(image[None]))
    for tok in greedy[:2]:
        logits, past = package.step(np.full((1, 1), tok, np.int64), past, cross)
    row = logits[0].copy()
    row[package.banned] = np.nan
    order = [int(i) for i in np.argsort(-np.nan_to_num(row, nan=-np.inf)) if not np.isnan(row[i])]
    assert order[0] == greedy[2]
    near = tie_margin(package, image, greedy, [*greedy[:2], order[1], *greedy[3:]])
    wide = tie_margin(package, image, greedy, [*greedy[:2], order[-1]])
    assert near == pytest.approx(float(row[order[0]] - row[order[1]]), abs=1e-5)
    assert wide == pytest.approx(float(row[order[0]] - row[order[-1]]), abs=1e-5) and wide > near and wide > 1.0
    # a reading that stops early (EOS where greedy went on): measured at that position too
    assert tie_margin(package, image, greedy, greedy[:2]) > 0.0


def test_verify_deviation_reads_a_float_verify_graph_as_its_step_and_a_stale_cache_as_whole_logits(ort_pkg):
    """benchmarks/verify_deviation.py: the float package's verify graph keeps the step's top-2 gaps; fed a
    cache one position short (a stale key), it moves them by whole logits, far beyond
    export.speculative_tie_margin's 1.0."""
    import importlib.util

    from conftest import REPO
    from pipeline.data.render import render_formula
    from pipeline.export.runtime import OnnxPackage
    from pipeline.stages.export import ExportConfig

    spec = importlib.util.spec_from_file_location("verify_deviation", REPO / "benchmarks" / "verify_deviation.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    package = OnnxPackage(ort_pkg, threads=1)
    images = [package.preprocess(render_formula(f)).astype(np.float32) for f in FORMULAS[:2]]
    sound = [c for image in images for c in mod.gap_changes(package, image, MAX_LENGTH)]
    assert sum(len(ids) for ids in package.generate(np.stack(images), MAX_LENGTH, batch_size=1).token_ids) \
        == len(sound) > 0
    assert max(sound) < 1e-3
    verify = package.verify

    def stale(ids, past, cross):
        logits, present = verify(ids, [p[:, :, :-1] if p.shape[2] > 1 else p for p in past], cross)
        return logits, [np.concatenate([p[:, :, :1], p], 2) for p in present]

    package.verify = stale
    broken = [c for image in images for c in mod.gap_changes(package, image, MAX_LENGTH)]
    assert max(broken) > 2 * ExportConfig().speculative_tie_margin


def test_same_config_reuses_the_package(ort_pkg):
    before = (ort_pkg / "manifest.json").read_text()
    run_export("target=ort_cpu")
    assert (ort_pkg / "manifest.json").read_text() == before


def test_parity_beyond_tolerance_names_the_output_and_writes_nothing():
    with pytest.raises(PipelineError, match=r"parity beyond tolerance for ort_cpu: encoder\.memory: SNR .* < 1000"):
        run_export("target=ort_cpu", "export.name=too-strict", "export.min_snr_db=1000", "export.simplify=false")
    assert not (artifacts_root() / "too-strict").exists()
    assert not list(artifacts_root().glob(".tmp-too-strict-*"))
    kept = json.loads((artifacts_root() / "failed" / "too-strict" / "parity.json").read_text())  # readable after
    assert kept["failures"] and kept["tensors"]["encoder.memory"]["snr_db"] < 1000


def _qdq_encoder(float_encoder: Path, out: Path, symmetric: bool) -> Path:
    """A QDQ encoder made the way a quantize stage would: ONNX Runtime's quantize_static."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    from pipeline.adapters import load_adapter
    from pipeline.data.render import render_formula

    adapter = load_adapter("latex_ocr_junia", "package")
    images = [adapter.preprocess(render_formula(f))[None].numpy() for f in FORMULAS[:2]]

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter({"images": im} for im in images)

        def get_next(self):
            return next(self.it, None)

    model = onnx.load(str(float_encoder))
    weights = {t.name for t in model.graph.initializer}
    # the q/k/v projections only: q.k / probs.v stay float, and the MLPs too (their INT8
    # activations drop the memory's cosine to about 0.72 even on the calibration image)
    exclude = [n.name for n in model.graph.node if n.op_type in ("MatMul", "Conv")
               and not (any(f"/attn/{p}_proj/" in n.name for p in "qkv") and set(n.input) & weights)]
    quantize_static(str(float_encoder), str(out), Reader(), quant_format=QuantFormat.QDQ, nodes_to_exclude=exclude,
                    activation_type=QuantType.QInt8 if symmetric else QuantType.QUInt8,
                    weight_type=QuantType.QInt8, per_channel=True, op_types_to_quantize=["MatMul", "Conv"],
                    extra_options={"ActivationSymmetric": symmetric, "WeightSymmetric": True})
    return out


@pytest.fixture(scope="module")
def float_encoder(tmp_path_factory) -> Path:
    """The exported float encoder before fusions (plain ONNX ops, what a quantizer starts from)."""
    import torch

    from pipeline.adapters import load_adapter
    from pipeline.export.onnx_graphs import _to_model
    from pipeline.export.graphs import EncoderGraph

    adapter = load_adapter("latex_ocr_junia", "package")
    m = _to_model(EncoderGraph(adapter), (torch.rand(1, *adapter.input_shape),),
                  {"inputs": ["images"], "outputs": ["memory"]}, {"images": {0: "batch"}, "memory": {0: "batch"}}, 17)
    path = tmp_path_factory.mktemp("qdq") / "encoder.float.onnx"
    onnx.save(m, str(path))
    return path


def test_metax_refuses_an_asymmetric_qdq_encoder_naming_the_node(float_encoder):
    qdq = _qdq_encoder(float_encoder, float_encoder.with_name("encoder.asym.onnx"), symmetric=False)
    with pytest.raises(PipelineError, match=r"metax package breaks its runtime's rules: encoder: node '.*' "
                                            r"\((QuantizeLinear|DequantizeLinear)\): uint8 quantization"):
        run_export("target=metax", f"export.qdq_encoder={qdq}", "export.name=metax-asym")
    assert not (artifacts_root() / "metax-asym").exists()


def test_metax_package_from_symmetric_qdq_passes_validator_and_parity(float_encoder):
    from pipeline.export.targets import resolve_target
    from pipeline.export.validator import validate
    from conftest import compose_cfg

    qdq = _qdq_encoder(float_encoder, float_encoder.with_name("encoder.sym.onnx"), symmetric=True)
    run_export("target=metax", f"export.qdq_encoder={qdq}", "export.parity_limit=1")
    pkg = artifacts_root() / "export-metax"
    rules = resolve_target(compose_cfg(["target=metax"]).target).rules
    for g in ("encoder", "decoder_first", "decoder_step"):
        m = onnx.load(str(pkg / f"{g}.onnx"))
        assert validate(m, rules, g) == []
        assert m.ir_version <= 8 and all(o.version <= 17 for o in m.opset_import if o.domain in ("", "ai.onnx"))
        assert not any(n.domain == "com.microsoft" for n in m.graph.node)
        assert any(t.data_type == onnx.TensorProto.FLOAT16 for t in m.graph.initializer), g
        assert sum(n.op_type == "LayerNormalization" for n in m.graph.node) >= 2, g
    enc = onnx.load(str(pkg / "encoder.onnx"))
    assert any(n.op_type == "DequantizeLinear" for n in enc.graph.node)
    opts = json.loads((pkg / "provider_options.json").read_text())
    assert opts["provider"] == "MACAExecutionProvider"
    assert set(opts["options"]) >= {"device_id", "gpu_mem_limit", "enable_cuda_graph"}
    parity = json.loads((pkg / "parity.json").read_text())
    assert parity["precision"]["encoder"] == "int8 qdq + fp16"
    assert np.isfinite(parity["tensors"]["encoder.memory"]["snr_db"])
    assert "PASS" in (pkg / "report.md").read_text()
    # a GPU target: a batch of several images decodes in greedy steps, not image by image
    meta = json.loads((pkg / "package.json").read_text())
    assert meta["drafter"] == "drafter.json" and meta["speculative_batches"] is False


def test_tensorrt_commands_are_written_beside_the_onnx(ort_pkg, tmp_path):
    from pipeline.export.tensorrt import engines, tensorrt_available
    from pipeline.stages.export import ExportConfig

    meta = json.loads((ort_pkg / "package.json").read_text())
    models = {g: onnx.load(str(ort_pkg / f"{g}.onnx"), load_external_data=False) for g in meta["graphs"]}
    cfg = ExportConfig(trt_max_batch=4)
    info = engines(tmp_path, meta, models, cfg.trt_max_batch, cfg.trt_opt_length, cfg.trt_build)
    script = (tmp_path / "build_engines.sh").read_text().splitlines()
    cmds = [ln for ln in script if ln.startswith("trtexec ")]
    assert [c.split()[1] for c in cmds] == ["--onnx=encoder.onnx", "--onnx=decoder_first.onnx", "--onnx=decoder_step.onnx",
                                            "--onnx=decoder_verify.onnx"]
    assert all("--fp16" in c and "--int8" not in c for c in cmds)  # float graphs: no Q/DQ, no INT8
    assert "--maxShapes=images:4x1x128x512" in cmds[0]
    assert f"past_key_0:4x8x{MAX_LENGTH - 1}x32" in cmds[2]
    assert "--maxShapes=input_ids:1x9," in cmds[3]  # the verify graph: batch 1, the last token + 8 drafts
    if not tensorrt_available():
        assert info == {"built": False, "reason": "tensorrt not installed", "commands": "build_engines.sh"}


def test_a_quantization_aware_finetuned_package_is_held_to_reading_as_well_not_to_identical_tokens(tmp_path):
    """Its encoder's weights are no longer torch's: fewer identical readings pass when it reads no
    worse (the int8-original package of a make run: 9 of 16 identical, 13 right against torch's 12)."""
    import json

    from pipeline.export.parity import FINETUNED_MAX_EXACT_LOSS, TokenParity, check_tolerances
    from pipeline.export.steps import finetuned as _finetuned

    tensors = {"encoder.memory": {"cosine": 0.997, "snr_db": 22.6}}
    tol = {"min_cosine": 0.98, "min_snr_db": 12.0, "min_identical": 0.6}

    def tokens(identical: float, torch_em: float, onnx_em: float) -> TokenParity:
        return TokenParity(n=16, identical=identical, token_agreement=0.6, exact_match_torch=torch_em,
                           exact_match_onnx=onnx_em, rows=[])

    reads_better = tokens(0.5625, 0.75, 0.8125)
    assert check_tolerances(tensors, reads_better, **tol)[0].startswith("greedy tokens: identical on 0.562")
    assert check_tolerances(tensors, reads_better, **tol, finetuned=True) == []
    assert check_tolerances(tensors, tokens(0.5625, 0.75, 0.75 - FINETUNED_MAX_EXACT_LOSS), **tol, finetuned=True) == []
    worse = check_tolerances(tensors, tokens(0.5625, 0.75, 0.625), **tol, finetuned=True)
    assert len(worse) == 1 and "reads 0.125 fewer right than torch" in worse[0]
    bad_tensor = {"encoder.memory": {"cosine": 0.9, "snr_db": 22.6}}  # the tensor checks stay
    assert check_tolerances(bad_tensor, reads_better, **tol, finetuned=True) == ["encoder.memory: cosine 0.900000 < 0.98"]
    # which packages: the quantize artifact holding the encoder says how many QAT steps it ran
    folder = tmp_path / "quantize"
    folder.mkdir()
    encoder = folder / "encoder.ort_cpu.qdq.onnx"
    assert _finetuned(None) is False and _finetuned(encoder) is False  # no manifest there: a QDQ file from elsewhere
    for qat, expected in (({"steps": 200, "planned_steps": 200}, True), ({}, False), ({"steps": 0}, False)):
        (folder / "manifest.json").write_text(json.dumps({"metrics": {"qat": qat}}))
        assert _finetuned(encoder) is expected, qat


def test_the_package_holds_a_triton_repository_the_validator_passes(ort_pkg):
    """ort_cpu: triton/ with config.pbtxt (Triton's own schema), model.py and the runtime beside it
    (tests/test_triton.py: the writer and the validator alone; test_infer.py: served by tritonserver)."""
    from pipeline.export import triton
    from pipeline.export.validator import check_triton_repository

    meta = json.loads((ort_pkg / "package.json").read_text())
    assert meta["triton"]["instance_kind"] == "KIND_CPU" and meta["triton"]["model"] == triton.MODEL
    assert check_triton_repository(ort_pkg, meta, "KIND_CPU") == []
    manifest = json.loads((ort_pkg / "manifest.json").read_text())
    assert f"triton/{triton.MODEL}/config.pbtxt" in manifest["outputs"]
    assert f"triton/{triton.MODEL}/1/model.py" in manifest["outputs"]
