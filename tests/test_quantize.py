"""Stage quantize on the tiny model (real graphs, real ORT quantizer), its building blocks, the plan
round trip, and its bad inputs through the CLI."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from omegaconf import OmegaConf

from conftest import run_cli
from tiny_model import FORMULAS, build_tiny, fake_ctx
from pipeline.errors import PipelineError

SMALL = ["quantize.calib_images=8", "quantize.search_images=8", "quantize.sensitivity_images=2",
         "quantize.eval_limit=4", "quantize.latency_images=1", "quantize.anchors=false", "quantize.decoder_search_images=8",
         "quantize.methods=[minmax,percentile]", "model.max_length=8", "model.batch_size=4"]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """An artifacts root with the tiny model saved as a folder and a calibration set of its inputs."""
    import datasets

    from pipeline.data.render import render_formula

    root = tmp_path_factory.mktemp("quantize")
    adapter = build_tiny()
    adapter.save(root / "tiny-model")
    images = np.stack([adapter.preprocess(render_formula(f)).numpy() for f in FORMULAS]).astype(np.float32)
    datasets.Dataset.from_dict({"pixel_values": images, "text": FORMULAS}).save_to_disk(
        str(root / "calibrate" / "calib_set"))
    return root


def _run(root: Path, *overrides: str) -> dict:
    from pipeline.stages import quantize

    ctx = fake_ctx(root, [f"quantize.model={root / 'tiny-model'}", *SMALL, *overrides])
    return quantize.run(OmegaConf.to_object(ctx.cfg.quantize), ctx)


@pytest.fixture(scope="module")
def searched(root) -> Path:
    _run(root)
    return root / "quantize"


def _dq_inputs(model: onnx.ModelProto) -> dict[str, list[onnx.NodeProto]]:
    producer = {o: n for n in model.graph.node for o in n.output}
    return {n.name: [producer[i] for i in n.input if i in producer and producer[i].op_type == "DequantizeLinear"]
            for n in model.graph.node}


def test_stage_writes_plan_report_and_runnable_qdq_encoders(searched):
    for name in ("plan.json", "report.md", "sensitivity.png", "sensitivity_heatmap.png", "quantize.json",
                 "encoder.qdq.onnx", "encoder.ort_cpu.qdq.onnx", "manifest.json"):
        assert (searched / name).is_file(), name
    assert not (searched / ".work").exists()
    metrics = json.loads((searched / "quantize.json").read_text())
    assert [m["method"] for m in metrics["methods"]] == ["minmax", "percentile"]
    assert len(metrics["sensitivity"]) == metrics["groups"] > 0
    # every group appears once in the ranking, with both views
    assert {r["group"] for r in metrics["sensitivity"]} == set(json.loads((searched / "plan.json").read_text())["groups"])
    x = np.random.default_rng(0).random((2, 1, 32, 64)).astype(np.float32)
    for name in ("encoder.qdq.onnx", "encoder.ort_cpu.qdq.onnx"):
        model = onnx.load(str(searched / name))
        onnx.checker.check_model(model)
        out = ort.InferenceSession(str(searched / name), providers=["CPUExecutionProvider"]).run(None, {"images": x})[0]
        assert out.shape[0] == 2 and np.isfinite(out).all()
    report = (searched / "report.md").read_text()
    assert "## Sensitivity" in report and "## Calibration methods" in report and "sensitivity.png" in report
    # the check reads both eval splits, the shift split (sources training never saw) beside the eval split
    for row in (r for r in metrics["anchors"] if "total_ms" in r):
        assert set(row["splits"]) == {"eval", "shift"} and row["splits"]["shift"]["n"] == 4
        assert row["exact_match"] == row["splits"]["eval"]["exact_match"]
    assert "exact match (shift)" in report and "CER (shift)" in report


def test_qdq_is_symmetric_int8_per_channel_and_passes_the_metax_rules(searched):
    from pipeline.export.targets import resolve_target
    from pipeline.export.validator import validate
    from conftest import compose_cfg

    model = onnx.load(str(searched / "encoder.qdq.onnx"))
    rules = resolve_target(compose_cfg(["target=metax"]).target).rules
    assert validate(model, rules, "encoder") == []
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    weight_dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits
                 and inits[n.input[0]].dtype == np.int8]
    assert weight_dq
    for n in weight_dq:
        assert inits[n.input[1]].size > 1  # one scale per output channel
        assert not inits[n.input[2]].any()  # zero point 0


def _activation_quant_types(model: onnx.ModelProto) -> set[int]:
    """The element types of the zero points of the activation QuantizeLinear nodes."""
    inits = {t.name: t for t in model.graph.initializer}
    return {inits[n.input[2]].data_type for n in model.graph.node
            if n.op_type == "QuantizeLinear" and n.input[0] not in inits and len(n.input) > 2}


@pytest.mark.slow
def test_ort_cpu_activations_are_asymmetric_uint8_by_default_and_symmetric_on_request(root, searched):
    """The ort_cpu graph quantizes its activations to uint8 with a fitted zero point (ORT CPU's U8S8);
    its weights stay symmetric int8 per channel, and the plain graph stays symmetric int8 throughout.
    quantize.ort_cpu_activations=int8 gives the ort_cpu graph zero points 0 too; the plan carries it."""
    ort_model = onnx.load(str(searched / "encoder.ort_cpu.qdq.onnx"))
    assert _activation_quant_types(ort_model) == {onnx.TensorProto.UINT8}
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in ort_model.graph.initializer}
    zero_points = [inits[n.input[2]] for n in ort_model.graph.node
                   if n.op_type == "QuantizeLinear" and n.input[0] not in inits]
    assert any(zp.item() != 128 for zp in zero_points)  # fitted to the range, not the symmetric midpoint
    assert _int8_weight_dqs(ort_model) > 0
    assert _activation_quant_types(onnx.load(str(searched / "encoder.qdq.onnx"))) == {onnx.TensorProto.INT8}
    assert json.loads((searched / "plan.json").read_text())["ort_cpu_activations"] == "uint8"
    _run(root, "quantize.ort_cpu_activations=int8", "quantize.methods=[minmax]", "quantize.name=quantize-s8")
    out = root / "quantize-s8"
    model = onnx.load(str(out / "encoder.ort_cpu.qdq.onnx"))
    assert _activation_quant_types(model) == {onnx.TensorProto.INT8}
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    assert not any(inits[n.input[2]].any() for n in model.graph.node if n.op_type == "QuantizeLinear")
    assert json.loads((out / "plan.json").read_text())["ort_cpu_activations"] == "int8"
    # applying that plan under the uint8 default keeps the plan's scheme
    _run(root, f"quantize.plan={out / 'plan.json'}", "quantize.name=quantize-s8-applied")
    again = root / "quantize-s8-applied"
    assert _activation_quant_types(onnx.load(str(again / "encoder.ort_cpu.qdq.onnx"))) == {onnx.TensorProto.INT8}


def test_a_group_marked_float_has_no_qdq_on_its_weights(root, searched, tmp_path):
    plan = json.loads((searched / "plan.json").read_text())
    names = list(plan["groups"])
    for g in plan["groups"].values():
        g["precision"] = "int8"
    floated = next(n for n in names if plan["groups"][n]["kind"] == "weights")
    plan["groups"][floated]["precision"] = "float"
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(plan))
    _run(root, f"quantize.plan={path}", "quantize.name=quantize-edited")
    out = root / "quantize-edited"
    applied = json.loads((out / "plan.json").read_text())
    assert applied["groups"][floated]["precision"] == "float"
    assert sum(g["precision"] == "int8" for g in applied["groups"].values()) == len(names) - 1
    dq = _dq_inputs(onnx.load(str(out / "encoder.qdq.onnx")))
    assert dq[plan["groups"][floated]["node"]] == []
    for n in names:
        if n != floated:
            assert dq[plan["groups"][n]["node"]], n


def _int8_weight_dqs(model: onnx.ModelProto) -> int:
    inits = {t.name: t for t in model.graph.initializer}
    return sum(1 for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits
               and inits[n.input[0]].data_type == onnx.TensorProto.INT8)


def test_the_ort_cpu_graph_has_its_own_plan_over_its_projections(root, searched, tmp_path):
    """The ort_cpu encoder (attention fused) is searched on its own graph: its plan names every
    projection (weights group) and no attention product; a projection set to float there loses its
    weight Q/DQ in encoder.ort_cpu.qdq.onnx, whatever the plain graph's plan says."""
    plan = json.loads((searched / "plan.json").read_text())
    weights = {n for n, g in plan["groups"].items() if g["kind"] == "weights"}
    assert set(plan["ort_cpu_groups"]) == weights
    metrics = json.loads((searched / "quantize.json").read_text())
    assert metrics["ort_cpu_search_trace"] and metrics["ort_cpu_groups"] == len(weights)
    assert _int8_weight_dqs(onnx.load(str(searched / "encoder.ort_cpu.qdq.onnx"))) == metrics["ort_cpu_int8_groups"]
    floated = sorted(weights)[0]
    plan["ort_cpu_groups"] = {n: ("float" if n == floated else "int8") for n in weights}
    for g in plan["groups"].values():
        g["precision"] = "float"  # the plain graph's plan does not decide the ort_cpu graph's
    path = tmp_path / "ort.json"
    path.write_text(json.dumps(plan))
    _run(root, f"quantize.plan={path}", "quantize.name=quantize-ort-edited")
    out = root / "quantize-ort-edited"
    assert _int8_weight_dqs(onnx.load(str(out / "encoder.ort_cpu.qdq.onnx"))) == len(weights) - 1
    assert _int8_weight_dqs(onnx.load(str(out / "encoder.qdq.onnx"))) == 0
    assert json.loads((out / "plan.json").read_text())["ort_cpu_groups"][floated] == "float"


@pytest.mark.slow
def test_smoothquant_is_folded_into_the_graphs_and_the_plan_carries_it(root, searched):
    """quantize.smoothquant: the graphs are made from the smoothed copy (LayerNorm scales differ from
    those of the default, off), the plan records alpha, and applying that plan folds the
    same alpha in again: the same QDQ graphs."""
    assert json.loads((searched / "plan.json").read_text())["smoothquant"] is None  # the default: off
    _run(root, "quantize.smoothquant=0.5", "quantize.methods=[minmax]", "quantize.name=quantize-sq")
    out = root / "quantize-sq"
    plan = json.loads((out / "plan.json").read_text())
    assert plan["smoothquant"] == 0.5
    metrics = json.loads((out / "quantize.json").read_text())
    assert metrics["smoothquant"] == 0.5 and "encoder_blocks.0.attn.qkv_proj" in metrics["smoothing"]
    assert "SmoothQuant: alpha 0.5 folded" in (out / "report.md").read_text()
    _run(root, f"quantize.plan={out / 'plan.json'}", "quantize.smoothquant=null", "quantize.name=quantize-sq-applied")
    again = root / "quantize-sq-applied"
    assert json.loads((again / "plan.json").read_text())["smoothquant"] == 0.5
    for name in ("encoder.qdq.onnx", "encoder.ort_cpu.qdq.onnx"):
        assert (again / name).read_bytes() == (out / name).read_bytes(), name
    plain = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(searched / "encoder.qdq.onnx")).graph.initializer}
    smooth = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(out / "encoder.qdq.onnx")).graph.initializer}
    ln = [n for n in plain if "norm1" in n and n in smooth]
    assert ln and any(not np.allclose(plain[n], smooth[n]) for n in ln)


@pytest.mark.slow
def test_qat_finetunes_the_encoder_before_its_graphs_and_the_plan_carries_it(root, searched, caplog, monkeypatch):
    """quantize.qat_steps: the graphs are made from encoder weights finetuned with INT8 fake
    quantizers (its projections' weights differ from the default run's), every loss is still against
    the float model handed over (the same float reading as the default run), the plan records the
    finetune, and applying that plan finetunes again to the same graphs (deterministic). More
    images asked than the calibration set holds: it trains on all of them and says so. The
    finetune's targets are the float ONNX Runtime package's readings, not a torch reading."""
    from pipeline.quantization import qat

    def no_torch_reading(*_, **__):
        raise AssertionError("the QAT targets were read with torch")

    monkeypatch.setattr(qat, "own_predictions", no_torch_reading)
    quick = ("quantize.check=false", "quantize.decoder=false")
    _run(root, "quantize.qat_steps=2", "quantize.qat_images=32", "quantize.qat_lr=1e-3", "quantize.methods=[minmax]",
         *quick, "quantize.name=quantize-qat")
    out = root / "quantize-qat"
    assert json.loads((out / "plan.json").read_text())["qat"] == {"steps": 2, "lr": 1e-3, "images": 32}
    metrics, base = (json.loads((f / "quantize.json").read_text()) for f in (out, searched))
    assert metrics["qat"]["steps"] == 2 and metrics["qat"]["quantized_modules"] > 0
    assert metrics["qat"]["teacher_readings"] == "float ONNX Runtime package"
    assert metrics["search"]["float_exact_match"] == base["search"]["float_exact_match"]
    assert metrics["search"]["float_cer"] == base["search"]["float_cer"]
    assert "Quantization-aware finetune: 2 of 2 steps" in (out / "report.md").read_text()
    assert "targets: the float model's greedy readings by its float ONNX Runtime package" in (out / "report.md").read_text()
    assert f"{len(FORMULAS)} calibration images" in (out / "report.md").read_text()
    assert f"qat_images=32: the calibration set holds {len(FORMULAS)} rows" in caplog.text
    assert "Quantization-aware finetune: off" in (searched / "report.md").read_text()
    # off, the artifact's key is what it was before the option (earlier artifacts stay valid)
    assert json.loads((out / "manifest.json").read_text())["config"]["qat_steps"] == 2
    assert not any(k.startswith("qat_") for k in json.loads((searched / "manifest.json").read_text())["config"])

    def weights(folder: Path) -> dict[str, np.ndarray]:
        model = onnx.load(str(folder / "encoder.ort_cpu.qdq.onnx"))
        return {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer if t.name.endswith("_quantized")}

    mine, default = weights(out), weights(searched)
    shared = set(mine) & set(default)
    assert shared and any(not np.array_equal(mine[n], default[n]) for n in shared)
    _run(root, f"quantize.plan={out / 'plan.json'}", *quick, "quantize.name=quantize-qat-applied")
    again = root / "quantize-qat-applied"
    assert json.loads((again / "plan.json").read_text())["qat"] == {"steps": 2, "lr": 1e-3, "images": 32}
    for name in ("encoder.qdq.onnx", "encoder.ort_cpu.qdq.onnx"):
        assert (again / name).read_bytes() == (out / name).read_bytes(), name


def test_fake_quantizers_sit_on_the_encoder_projections_only_and_come_off():
    """ModelOpt's INT8 quantizers go on the encoder's nn.Linear modules (not its LayerNorms, not the
    decoder's); the finetuned copy is a plain model again, the decoder's weights untouched."""
    import torch
    from modelopt.torch.quantization.nn import TensorQuantizer

    from pipeline.data.render import render_formula
    from pipeline.quantization import qat

    adapter = build_tiny()
    linear = qat.encoder_linears(adapter)
    decoder = {id(p) for p in adapter.decoder_parameters()}
    modules = dict(adapter.model.named_modules())
    assert linear and all(id(modules[n].weight) not in decoder for n in linear)
    assert any(isinstance(m, torch.nn.Linear) and id(m.weight) in decoder for m in modules.values())
    images = torch.stack([adapter.preprocess(render_formula(f)) for f in FORMULAS[:4]])
    twin = build_tiny()
    assert qat.fake_quantize(twin.model, linear, images, twin.encode, 99.99) == sorted(linear)
    on = {n.rsplit(".", 1)[0] for n, m in twin.model.named_modules() if isinstance(m, TensorQuantizer) and m.is_enabled}
    assert on == linear
    with torch.no_grad():
        assert not torch.equal(twin.encode(images), adapter.encode(images))  # INT8 noise
    targets = [[adapter.bos_id, 5, 6, adapter.eos_id]] * 4
    tuned, report = qat.finetuned_copy(adapter, images, images, steps=2, lr=1e-2, targets=targets)
    assert report["steps"] == 2 and report["quantized_modules"] == len(linear)
    assert not any(isinstance(m, TensorQuantizer) for m in tuned.model.modules())
    before, after = dict(adapter.model.named_parameters()), dict(tuned.model.named_parameters())
    assert before.keys() == after.keys()
    assert all(torch.equal(p, after[n]) for n, p in before.items() if id(p) in decoder)
    assert any(not torch.equal(before[f"{n}.weight"], after[f"{n}.weight"]) for n in linear)


_DEEP_IMPORT = """
import gc, importlib, sys, weakref
from pipeline.quantization import qat

class Payload:  # stands for a stage's arrays and sessions
    pass

def stage():
    payload = Payload()
    {importer}("modelopt.torch.quantization")
    return weakref.ref(payload)

alive = stage()
gc.collect()
print("kept" if alive() is not None else "freed")
"""


@pytest.mark.slow
def test_modelopt_is_imported_without_keeping_its_callers_locals_alive():
    """The first import of ModelOpt's torch quantization, made plainly inside a function, keeps
    that function's locals alive for the rest of the process (PuLP keeps an import error, its
    traceback, and through the frames' ``f_back`` the whole stack); ``qat.import_detached`` does
    not. Fresh interpreters: the import is what is measured."""
    import subprocess
    import sys

    procs = {importer: subprocess.Popen([sys.executable, "-c", _DEEP_IMPORT.format(importer=importer)],
                                        cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL, text=True)
             for importer in ("importlib.import_module", "qat.import_detached")}
    said = {importer: proc.communicate(timeout=300)[0].strip() for importer, proc in procs.items()}
    assert said == {"importlib.import_module": "kept", "qat.import_detached": "freed"}


def test_a_plan_carried_to_another_graph_maps_a_layers_qkv_by_what_it_is(tmp_path):
    """A pooled layer has separate q/k/v projection groups where the unpooled model has one merged
    qkv_proj (quantize.original applies the pooled chain's plan to the original model)."""
    from pipeline.quantization.plan import GroupPlan, Plan, carry, load

    split = {"b.0.attn.q_proj": "int8", "b.0.attn.k_proj": "int8", "b.0.attn.v_proj": "int8", "b.0.mlp.0": "float"}
    fused = ["b.0.attn.qkv_proj", "b.0.mlp.0"]
    assert carry(split, fused) == ({"b.0.attn.qkv_proj": "int8", "b.0.mlp.0": "float"},
                                   {"b.0.attn.qkv_proj": ["b.0.attn.k_proj", "b.0.attn.q_proj", "b.0.attn.v_proj"]}, [])
    # the merged group is INT8 only when every part is
    assert carry({**split, "b.0.attn.k_proj": "float"}, fused)[0]["b.0.attn.qkv_proj"] == "float"
    # and the other way: each part takes the merged group's precision
    back, carried, unknown = carry({"b.0.attn.qkv_proj": "float", "b.0.mlp.0": "int8"}, list(split))
    assert back == {"b.0.attn.q_proj": "float", "b.0.attn.k_proj": "float", "b.0.attn.v_proj": "float",
                    "b.0.mlp.0": "int8"} and carried["b.0.attn.v_proj"] == ["b.0.attn.qkv_proj"] and not unknown
    assert carry({"b.1.mlp.0": "int8"}, fused)[2] == ["b.1.mlp.0"]  # nothing it could be: named
    plan = Plan(method="minmax", budget=0.005, ort_cpu_groups=dict(split), groups={
        n: GroupPlan(p, f"node{i}", "weights", 10) for i, (n, p) in enumerate(split.items())})
    plan.save(tmp_path / "p.json")
    applied = load(tmp_path / "p.json", fused, ["minmax"])
    assert {n: g.precision for n, g in applied.groups.items()} == {"b.0.attn.qkv_proj": "int8", "b.0.mlp.0": "float"}
    assert applied.ort_cpu_groups == {"b.0.attn.qkv_proj": "int8", "b.0.mlp.0": "float"}
    assert list(applied.carried) == ["b.0.attn.qkv_proj"]


def test_plan_round_trip_and_validation(tmp_path):
    from pipeline.quantization.plan import GroupPlan, Plan, load

    plan = Plan(method="minmax", budget=0.005, groups={
        "blocks.0.attn.qkv_proj": GroupPlan("int8", "MatMul_0", "weights", 100, {"only": 40.0}),
        "blocks.0.attn.context": GroupPlan("float", "/blocks.0/attn/MatMul_1", "activations", 50)})
    plan.save(tmp_path / "p.json")
    again = load(tmp_path / "p.json", list(plan.groups), ["minmax"])
    assert again == plan and again.int8_groups() == ["blocks.0.attn.qkv_proj"]
    assert again.int8_mac_share() == pytest.approx(100 / 150)
    # no ort_cpu plan: the ort_cpu graph takes the plain plan's projections; with one, its own
    assert again.ort_cpu_int8_groups() == ["blocks.0.attn.qkv_proj"]
    plan.ort_cpu_groups = {"blocks.0.attn.qkv_proj": "float"}
    plan.save(tmp_path / "p.json")
    again = load(tmp_path / "p.json", list(plan.groups), ["minmax"])
    assert again == plan and again.ort_cpu_int8_groups() == []
    raw = json.loads((tmp_path / "p.json").read_text())
    raw["ort_cpu_groups"] = {"blocks.9.mlp": "int8"}
    (tmp_path / "ort.json").write_text(json.dumps(raw))
    with pytest.raises(PipelineError, match="ort_cpu group.*blocks.9.mlp"):
        load(tmp_path / "ort.json", list(plan.groups), ["minmax"])
    with pytest.raises(PipelineError, match="not in this model's graph: blocks.0.attn.qkv_proj"):
        load(tmp_path / "p.json", ["blocks.0.attn.context"], ["minmax"])
    plan.decoder_cross_kv = "int8"
    plan.save(tmp_path / "p.json")
    assert load(tmp_path / "p.json", list(plan.groups), ["minmax"]).decoder_cross_kv == "int8"
    raw = json.loads((tmp_path / "p.json").read_text())
    del raw["decoder_cross_kv"]  # a plan from before the key: its cross-attention K/V projections were float
    (tmp_path / "old.json").write_text(json.dumps(raw))
    assert load(tmp_path / "old.json", list(plan.groups), ["minmax"]).decoder_cross_kv == "float"
    (tmp_path / "cross.json").write_text(json.dumps(dict(raw, decoder_cross_kv="int4")))
    with pytest.raises(PipelineError, match="'decoder_cross_kv' must be one of"):
        load(tmp_path / "cross.json", list(plan.groups), ["minmax"])
    raw = json.loads((tmp_path / "p.json").read_text())
    raw["groups"]["blocks.0.attn.context"]["precision"] = "int4"
    (tmp_path / "bad.json").write_text(json.dumps(raw))
    with pytest.raises(PipelineError, match="precision must be one of"):
        load(tmp_path / "bad.json", list(plan.groups), ["minmax"])
    (tmp_path / "junk.json").write_bytes(b"\xff\xfe not json")
    with pytest.raises(PipelineError, match="not a JSON plan"):
        load(tmp_path / "junk.json", list(plan.groups), ["minmax"])
    # SmoothQuant's alpha travels with the plan; a bad one is named (read before the groups, too)
    from pipeline.quantization.plan import smoothquant_of

    plan.smoothquant = 0.8
    plan.save(tmp_path / "p.json")
    assert load(tmp_path / "p.json", list(plan.groups), ["minmax"]).smoothquant == 0.8
    assert smoothquant_of(tmp_path / "p.json") == 0.8 and smoothquant_of(tmp_path / "junk.json") is None
    raw = json.loads((tmp_path / "p.json").read_text())
    raw["smoothquant"] = 2
    (tmp_path / "alpha.json").write_text(json.dumps(raw))
    for read_it in (lambda f: load(f, list(plan.groups), ["minmax"]), smoothquant_of):
        with pytest.raises(PipelineError, match="'smoothquant' must be null or a number in \\(0, 1\\], got 2"):
            read_it(tmp_path / "alpha.json")
    # so does the ort_cpu activation scheme; a file without it was made with symmetric int8
    plan.ort_cpu_activations = "uint8"
    plan.save(tmp_path / "p.json")
    assert load(tmp_path / "p.json", list(plan.groups), ["minmax"]).ort_cpu_activations == "uint8"
    raw = json.loads((tmp_path / "p.json").read_text())
    del raw["ort_cpu_activations"]
    (tmp_path / "old.json").write_text(json.dumps(raw))
    assert load(tmp_path / "old.json", list(plan.groups), ["minmax"]).ort_cpu_activations == "int8"
    raw["ort_cpu_activations"] = "int4"
    (tmp_path / "acts.json").write_text(json.dumps(raw))
    with pytest.raises(PipelineError, match="'ort_cpu_activations' must be one of \\('int8', 'uint8'\\), got 'int4'"):
        load(tmp_path / "acts.json", list(plan.groups), ["minmax"])
    # and the quantization-aware finetune the graphs were made after; a bad one is named
    from pipeline.quantization.plan import qat_of

    plan.qat = {"steps": 200, "lr": 2e-5, "images": 512}
    plan.save(tmp_path / "p.json")
    assert load(tmp_path / "p.json", list(plan.groups), ["minmax"]).qat == plan.qat == qat_of(tmp_path / "p.json")
    assert qat_of(tmp_path / "old.json") is None and qat_of(tmp_path / "junk.json") is None
    raw = json.loads((tmp_path / "p.json").read_text())
    raw["qat"] = {"steps": 0, "lr": 1e-5, "images": 8}
    (tmp_path / "qat.json").write_text(json.dumps(raw))
    for read_it in (lambda f: load(f, list(plan.groups), ["minmax"]), qat_of):
        with pytest.raises(PipelineError, match="'qat' needs steps >= 1"):
            read_it(tmp_path / "qat.json")


def test_attention_fusion_keeps_the_encoder_output(tmp_path):
    from pipeline.export.onnx_graphs import export_graphs
    from pipeline.export.transforms import simplify
    from pipeline.export.fusion import fuse_attention
    from pipeline.quantization.groups import find_groups

    adapter = build_tiny()
    encoder = simplify(export_graphs(adapter, 17)["encoder"], "encoder")
    fused = onnx.ModelProto.FromString(encoder.SerializeToString())
    assert fuse_attention(fused) == 2  # two encoder layers
    assert sum(n.op_type == "MultiHeadAttention" for n in fused.graph.node) == 2
    assert not any(n.op_type == "Softmax" for n in fused.graph.node)
    x = np.random.default_rng(1).random((2, 1, 32, 64)).astype(np.float32)
    ref = ort.InferenceSession(encoder.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"images": x})[0]
    got = ort.InferenceSession(fused.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"images": x})[0]
    np.testing.assert_allclose(got, ref, atol=1e-4)
    # groups: per layer q/k/v merged by onnxsim, out_proj, two MLP projections, and the two attention products
    groups = find_groups(encoder, tokens=32, hidden=32)
    roles = {g.role for g in groups}
    assert {"attn.qkv_proj", "attn.out_proj", "attn.scores", "attn.context"} <= roles
    assert {g.kind for g in groups if g.role in ("attn.scores", "attn.context")} == {"activations"}
    assert len({g.name for g in groups}) == len(groups)


def test_attention_fusion_with_pooled_keys_keeps_the_encoder_output():
    """A layer whose keys are pooled (its q/k/v run as 2-D Gemms after onnxsim) still fuses, and the
    fused graph computes the torch model's encoder."""
    import torch

    from pipeline.export.onnx_graphs import export_graphs
    from pipeline.export.transforms import simplify
    from pipeline.export.fusion import fuse_attention

    adapter = build_tiny()
    adapter.pool_encoder_keys({0: [1, 2]})
    encoder = simplify(export_graphs(adapter, 17)["encoder"], "encoder")
    assert any(n.op_type == "ReduceMean" for n in encoder.graph.node)
    fused = onnx.ModelProto.FromString(encoder.SerializeToString())
    assert fuse_attention(fused) == 2
    onnx.checker.check_model(fused)
    x = np.random.default_rng(1).random((2, 1, 32, 64)).astype(np.float32)
    with torch.no_grad():
        ref = adapter.encode(torch.from_numpy(x)).numpy()
    got = ort.InferenceSession(fused.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"images": x})[0]
    np.testing.assert_allclose(got, ref, atol=1e-4)
    # groups: the pooled layer's projections are named after their modules in both graphs, and its
    # MACs come from the graph's shapes: keys and values over 16 of 32 tokens (width 32, 4 heads of 8)
    from pipeline.quantization.groups import find_groups

    plain = {g.name: g for g in find_groups(encoder, tokens=32, hidden=32)}
    assert {"encoder_blocks.0.attn.q_proj", "encoder_blocks.0.attn.k_proj", "encoder_blocks.0.attn.v_proj",
            "encoder_blocks.1.attn.qkv_proj"} <= set(plain)
    assert {g.name for g in find_groups(fused) if g.kind == "weights"} == \
        {n for n, g in plain.items() if g.kind == "weights"}
    assert plain["encoder_blocks.0.attn.q_proj"].macs == 32 * 32 * 32
    assert plain["encoder_blocks.0.attn.k_proj"].macs == 16 * 32 * 32
    assert plain["encoder_blocks.0.attn.scores"].macs == 4 * 32 * 8 * 16
    assert plain["encoder_blocks.1.attn.scores"].macs == 4 * 32 * 8 * 32


def test_attention_fusion_on_a_policy_encoder_leaves_no_unfused_attention_behind():
    """With a token policy the token count is dynamic, and the head merge reads its shape off the
    attention's context: the fusion reads it off the query's split instead, so no Softmax (the unfused
    attention, computed a second time for its shape) is left, and the encoder still reads as torch."""
    import torch

    from pipeline.export.onnx_graphs import export_graphs
    from pipeline.export.transforms import simplify
    from pipeline.export.fusion import fuse_attention

    adapter = build_tiny()
    h, w, _ = adapter.token_grid()
    adapter.set_token_policy({"buckets": [8, 16, h * w], "frame_stride": 2})
    encoder = simplify(export_graphs(adapter, 17)["encoder"], "encoder")
    assert any(n.op_type == "Shape" for n in encoder.graph.node)  # the token count is not folded away
    fused = onnx.ModelProto.FromString(encoder.SerializeToString())
    assert fuse_attention(fused) == 2
    onnx.checker.check_model(fused)
    assert not any(n.op_type in ("Softmax", "MatMul") and "attn" in n.name and "proj" not in n.name
                   for n in fused.graph.node), [n.op_type for n in fused.graph.node]
    x = np.random.default_rng(1).random((2, 1, 32, 64)).astype(np.float32)
    for k in (8, 16):
        keep = np.sort(np.random.default_rng(k).permutation(h * w)[:k].reshape(1, k).repeat(2, 0), axis=1)
        with torch.no_grad():
            ref = adapter.encode_kept(torch.from_numpy(x), torch.from_numpy(keep)).numpy()
        got = ort.InferenceSession(fused.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, {"images": x, "keep": keep})[0]
        np.testing.assert_allclose(got, ref, atol=1e-4)


def test_sensitivity_ranks_the_ruinous_group_first():
    from calibration.sensitivity import SNR, measure, ranking

    ref = np.ones((2, 4))

    def run_with(int8):  # "bad" alone ruins the output; "mild" costs a little
        out = ref.copy()
        if "bad" in int8:
            out = out * 0.1
        if "mild" in int8:
            out = out + 0.01
        return out

    everything, rows = measure(["mild", "bad", "clean"], run_with, ref, SNR(), progress=False)
    assert [r.group for r in ranking(rows)] == ["bad", "mild", "clean"]
    assert rows[2].only == float("inf") and everything < rows[0].only


@pytest.mark.slow
def test_no_calibration_set_is_one_error_line_and_no_artifact(tmp_path):
    proc = run_cli("stage=quantize", f"artifacts.dir={tmp_path}", "progress=false")
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines == ["error: quantize.calibration=calibrate: no calibration set there; run stage=calibrate first"]
    assert not (tmp_path / "quantize").exists() and not list(tmp_path.glob(".tmp-quantize-*"))


@pytest.mark.parametrize("override, message", [
    ("quantize.budget=-0.1", "quantize.budget must be in [0, 1)"),
    ("quantize.budget=1.5", "quantize.budget must be in [0, 1)"),
    ("quantize.methods=[minmax,histogram]", "config: Error merging override quantize.methods=[minmax,histogram]: "
                                            "Invalid value 'histogram', expected one of [minmax, minmax_ema, entropy, "
                                            "percentile, percentile_99.99]"),
    ("quantize.calib_images=0", "quantize.calib_images must be >= 1"),
    ("quantize.smoothquant=1.5", "quantize.smoothquant must be in (0, 1]"),
    ("quantize.ort_cpu_activations=int4", "config: Error merging override quantize.ort_cpu_activations=int4: "
                                          "Invalid value 'int4', expected one of [int8, uint8]"),
    ("quantize.qat_precision=fp16", "config: Error merging override quantize.qat_precision=fp16: "
                                    "Invalid value 'fp16', expected one of [auto, fp32, bf16]"),
    ("quantize.search_chunk=-1", "quantize.search_chunk must be >= 0"),
    ("quantize.search_split=shift", "quantize.search_split=shift is one of quantize.eval_splits"),
    ("quantize.qat_steps=-1", "quantize.qat_steps must be >= 0"),
])
@pytest.mark.slow
def test_impossible_settings_are_one_error_line(tmp_path, override, message):
    proc = run_cli("stage=quantize", f"artifacts.dir={tmp_path}", "progress=false", override)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"error: {message}" + proc.stderr.strip().split(message, 1)[1]]
    assert not (tmp_path / "quantize").exists()


@pytest.mark.slow
def test_plan_naming_unknown_nodes_is_one_error_line_and_no_artifact(root, tmp_path):
    bad = tmp_path / "plan.json"
    bad.write_text(json.dumps({"format": "formula-compress quantize plan v1", "method": "minmax",
                               "groups": {"encoder_blocks.9.attn.qkv_proj": {"precision": "int8", "node": "X"}}}))
    proc = run_cli("stage=quantize", f"artifacts.dir={root}", "progress=false", f"quantize.model={root / 'tiny-model'}",
                   *SMALL, f"quantize.plan={bad}", "quantize.name=quantize-bad-plan")
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: quantize.plan: 1 group(s) not in this model's graph: "
                                                   "encoder_blocks.9.attn.qkv_proj")
    assert not (root / "quantize-bad-plan").exists() and not list(root.glob(".tmp-quantize-bad-plan-*"))


def _export(root: Path, *overrides: str) -> dict:
    from pipeline.stages import export

    (root / "formulas.txt").write_text("\n".join(FORMULAS[:3]) + "\n")
    ctx = fake_ctx(root, [f"export.formulas={root / 'formulas.txt'}", "model.max_length=8", "export.parity_images=1",
                          "export.parity_limit=2", "export.min_cosine=0", "export.min_snr_db=-100",
                          "export.min_identical=0", *overrides])
    return export.run(OmegaConf.to_object(ctx.cfg.export), ctx)


def test_export_takes_quantize_model_and_int8_encoder_per_target(root, searched, monkeypatch):
    from pipeline.export import parity

    references = []  # the torch reading each target's token parity was handed
    real = parity.token_parity

    def counting(*args, reference=None, **kwargs):
        references.append(reference)
        return real(*args, reference=reference, **kwargs)

    monkeypatch.setattr("pipeline.export.steps.token_parity", counting)
    manifests = _export(root, "export.targets=[ort_cpu,metax]")
    assert set(manifests) == {"ort_cpu", "metax"}
    # one torch decode for both targets of the same model: the second is handed the first's reading
    assert references[0] is None and references[1] is not None
    rows = [[json.loads(ln) for ln in (root / f"export-{t}" / "parity_rows.jsonl").read_text().splitlines()]
            for t in ("ort_cpu", "metax")]
    assert [r["torch"] for r in rows[0]] == [r["torch"] for r in rows[1]]
    qmanifest = json.loads((searched / "manifest.json").read_text())
    for target, encoder in (("ort_cpu", "encoder.ort_cpu.qdq.onnx"), ("metax", "encoder.qdq.onnx")):
        pkg = root / f"export-{target}"
        meta = json.loads((pkg / "package.json").read_text())
        assert meta["precision"]["encoder"].startswith("int8 qdq"), target
        manifest = json.loads((pkg / "manifest.json").read_text())
        assert manifest["config"]["model_ref"] == str(root / "tiny-model")  # the model quantize used
        assert manifest["inputs"]["model"] == qmanifest["inputs"]["model"]
        assert manifest["inputs"]["qdq_encoder"] == qmanifest["outputs"][encoder]
    # the float package on request, from the same model
    _export(root, "export.quantized=none", "export.name=float-pkg", "export.model=" + str(root / "tiny-model"))
    assert json.loads((root / "float-pkg" / "package.json").read_text())["precision"]["encoder"] == "fp32"


def test_export_quantized_names_an_artifact_like_export_model(root, searched):
    """``export.quantized=<name>`` is a quantize artifact under the artifacts root, as a model is."""
    _export(root, f"export.quantized={searched.name}", "export.targets=[ort_cpu]", "export.name=by-name")
    meta = json.loads((root / "by-name-ort_cpu" / "package.json").read_text())  # export.name + each target
    assert meta["precision"]["encoder"].startswith("int8 qdq")


def test_export_quantized_from_a_missing_folder_is_an_error(root):
    with pytest.raises(PipelineError, match="export.quantized=.*no quantize artifact there"):
        _export(root, f"export.quantized={root / 'nowhere'}", "export.name=never")
    assert not (root / "never").exists()


def test_cached_attention_fusion_keeps_the_decoder_step_outputs():
    from pipeline.export.onnx_graphs import export_graphs
    from pipeline.export.transforms import simplify
    from pipeline.export.build import decoder_shapes
    from pipeline.export.fusion import fuse_cached_attention

    adapter = build_tiny()
    shapes = decoder_shapes(adapter)
    step = simplify(export_graphs(adapter, 17)["decoder_step"], "decoder_step")
    fused = onnx.ModelProto.FromString(step.SerializeToString())
    assert fuse_cached_attention(fused) == 2  # one decoder layer: self (over the cache) + cross
    assert not any(n.op_type in ("Softmax", "Concat") for n in fused.graph.node)
    rng = np.random.default_rng(2)
    h, d, n = shapes["num_heads"], shapes["head_dim"], shapes["memory_length"]
    feed = {"input_ids": np.array([[5], [7]], dtype=np.int64)}
    for i in step.graph.input:
        if i.name.startswith("past"):
            feed[i.name] = rng.standard_normal((2, h, 3, d)).astype(np.float32)
        elif i.name.startswith("cross"):
            feed[i.name] = rng.standard_normal((2, h, n, d)).astype(np.float32)
    ref = ort.InferenceSession(step.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)
    got = ort.InferenceSession(fused.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)
    assert [o.name for o in fused.graph.output] == [o.name for o in step.graph.output]
    for a, b in zip(ref, got):
        np.testing.assert_allclose(b, a, atol=1e-5)


def test_ort_cpu_int8_decoders_are_handed_to_the_ort_cpu_package_only(root, searched):
    plan = json.loads((searched / "plan.json").read_text())
    assert plan["decoder"] == "int8"  # the tiny model's readings hold the budget with 8-bit decoder weights (seeded)
    for g in ("decoder_first", "decoder_step"):
        model = onnx.load(str(searched / f"{g}.ort_cpu.int8.onnx"))
        assert any(n.op_type == "MatMulNBits"
                   for n in model.graph.node), g
    _export(root, "export.targets=[ort_cpu,tensorrt]", "export.name=dec")
    ort_meta = json.loads((root / "dec-ort_cpu" / "package.json").read_text())
    assert ort_meta["precision"]["decoder_step"] == "int8 weights"
    trt_meta = json.loads((root / "dec-tensorrt" / "package.json").read_text())
    assert trt_meta["precision"]["decoder_step"] == "fp32"
    # the cross-attention K/V projections were tried in dynamic INT8 and the plan says what held the budget
    measured = json.loads((searched / "quantize.json").read_text())["search"]
    check = measured["decoder_cross_kv_check"]
    assert check["n"] >= 1 and measured["decoder_cross_kv_nodes"] == 2  # K and V of the tiny decoder's one layer
    assert plan["decoder_cross_kv"] == ("int8" if check["loss"] <= plan["budget"] + 1e-9 else "float")
    first = onnx.load(str(searched / "decoder_first.ort_cpu.int8.onnx"))
    dynamic = sum(n.op_type in ("MatMulInteger", "DynamicQuantizeMatMul") for n in first.graph.node)
    assert dynamic == (2 if plan["decoder_cross_kv"] == "int8" else 0)


def test_the_chain_hands_prune_model_to_quantize(tmp_path):
    ctx = fake_ctx(tmp_path)
    assert ctx.chain_model("auto") == "original"  # nothing upstream yet
    build_tiny().save(tmp_path / "prune" / "model")
    assert ctx.chain_model("auto") == "prune"
    assert ctx.chain_model("original") == "original"  # an explicit reference wins
    assert ctx.model_folder(ctx.chain_model("auto")) == tmp_path / "prune" / "model"


def test_a_pruned_model_with_uneven_heads_exports_fused_for_ort_cpu():
    """Layers with different head counts: the optimizer reads heads from the graph (it asserted before)."""
    from pipeline.export.build import build_graphs
    from pipeline.quantization.graphs import ort_cpu_target

    adapter = build_tiny()
    adapter.remove_encoder_heads({0: [1, 2]})
    assert adapter.encoder_head_counts() == [2, 4]
    built = build_graphs(adapter, ort_cpu_target(), True, None, lambda _: None)
    assert built.violations == []
    ops = [n.op_type for n in built.models["encoder"].graph.node]
    assert ops.count("MultiHeadAttention") == 2  # both layers fused, each with its own head count
    heads = sorted(next(a.i for a in n.attribute if a.name == "num_heads")
                   for n in built.models["encoder"].graph.node if n.op_type == "MultiHeadAttention")
    assert heads == [2, 4]


def test_gemm_to_matmul_keeps_outputs(tmp_path):
    from onnx import TensorProto, helper, numpy_helper

    from pipeline.quantization.decoder import to_matmul

    rng = np.random.default_rng(0)
    w1, b1, w2 = (rng.standard_normal(s).astype(np.float32) for s in ((6, 4), (6,), (6, 3)))
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], name="g1", transB=1),
         helper.make_node("Gemm", ["h", "w2"], ["y"], name="g2")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [numpy_helper.from_array(a, n) for a, n in ((w1, "w1"), (b1, "b1"), (w2, "w2"))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = rng.standard_normal((2, 4)).astype(np.float32)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    converted = to_matmul(onnx.ModelProto.FromString(model.SerializeToString()))
    assert [n.op_type for n in converted.graph.node] == ["MatMul", "Add", "MatMul"]
    got = ort.InferenceSession(converted.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_to_matmul_drops_the_flatten_and_unflatten_around_a_projection():
    """Reshape [B, S, K] -> [B·S, K], Gemm, Reshape back (and a head split merged straight back): MatMul
    reads [B, S, K] itself and writes the unflattened name; a flatten of another shape stays."""
    from onnx import TensorProto, helper, numpy_helper

    from pipeline.quantization.decoder import to_matmul

    rng = np.random.default_rng(1)
    w1, b1, w2 = (rng.standard_normal(s).astype(np.float32) for s in ((8, 4), (8,), (4, 6)))
    consts = {"flat": [-1, 4], "back": [-1, 3, 8], "split": [-1, 3, 2, 4], "merge": [0, 0, -1],
              "flat4": [-1, 4], "back4": [2, 2, 3, 6]}
    nodes = [helper.make_node("Reshape", ["x", "flat"], ["x2"], name="flatten"),
             helper.make_node("Gemm", ["x2", "w1", "b1"], ["h2"], name="proj", transB=1),
             helper.make_node("Reshape", ["h2", "back"], ["h"], name="unflatten"),
             helper.make_node("Gemm", ["x2", "w1"], ["q2"], name="q_proj", transB=1),  # reads the same flatten
             helper.make_node("Reshape", ["q2", "split"], ["q4"], name="split_heads"),
             helper.make_node("Reshape", ["q4", "merge"], ["q"], name="merge_heads"),
             # [2, 2, 3, 4] flattened: rank 4, the same last dim: MatMul reads it as well
             helper.make_node("Reshape", ["y", "flat4"], ["y2"], name="flatten4"),
             helper.make_node("Gemm", ["y2", "w2"], ["z2"], name="proj4"),
             helper.make_node("Reshape", ["z2", "back4"], ["z"], name="unflatten4"),
             # a flatten of [2, 3, 2, 2] to rows of 4 mixes two dimensions: it stays
             helper.make_node("Reshape", ["v", "flat4"], ["v2"], name="flatten_mixed"),
             helper.make_node("Gemm", ["v2", "w2"], ["u"], name="proj_mixed")]
    inits = [numpy_helper.from_array(a, n) for a, n in ((w1, "w1"), (b1, "b1"), (w2, "w2"))]
    inits += [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in consts.items()]
    f = TensorProto.FLOAT
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", f, ["batch", 3, 4]),
                                           helper.make_tensor_value_info("y", f, [2, 2, 3, 4]),
                                           helper.make_tensor_value_info("v", f, [2, 3, 2, 2])],
                              [helper.make_tensor_value_info(o, f, None) for o in ("h", "q", "z", "u")], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    feed = {name: rng.standard_normal(shape).astype(np.float32)
            for name, shape in (("x", (2, 3, 4)), ("y", (2, 2, 3, 4)), ("v", (2, 3, 2, 2)))}
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)
    converted = to_matmul(onnx.ModelProto.FromString(model.SerializeToString()))
    kept = [n.name for n in converted.graph.node if n.op_type == "Reshape"]
    assert kept == ["flatten_mixed"]
    matmuls = {n.name: list(n.input) for n in converted.graph.node if n.op_type == "MatMul"}
    assert matmuls["proj/matmul"][0] == "x" and matmuls["q_proj/matmul"][0] == "x" and matmuls["proj4/matmul"][0] == "y"
    got = ort.InferenceSession(converted.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)
    for a, b in zip(got, ref):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_cross_kv_quantization_touches_only_the_named_nodes_and_keeps_their_outputs_close(tmp_path):
    from onnx import TensorProto, helper, numpy_helper

    from pipeline.export.runtime import session_options
    from pipeline.quantization.decoder import cross_kv_nodes, quantize_cross_kv, weight_parts

    rng = np.random.default_rng(0)
    wq, wk, wv = (rng.standard_normal((16, 16)).astype(np.float32) * 0.2 for _ in range(3))

    def graph(nodes, weights, outputs):
        return helper.make_model(helper.make_graph(
            nodes, "g", [helper.make_tensor_value_info("memory", TensorProto.FLOAT, [1, 64, 16])],
            [helper.make_tensor_value_info(o, TensorProto.FLOAT, [1, 64, 16]) for o in outputs],
            [numpy_helper.from_array(w, n) for n, w in weights.items()]), opset_imports=[helper.make_opsetid("", 17)])

    step = graph([helper.make_node("MatMul", ["memory", "wq"], ["q"], name="q_proj")], {"wq": wq}, ["q"])
    first = graph([helper.make_node("MatMul", ["memory", "wq"], ["q"], name="q_proj"),
                   helper.make_node("MatMul", ["memory", "wk"], ["k"], name="cross_k"),
                   helper.make_node("MatMul", ["memory", "wv"], ["v"], name="cross_v")],
                  {"wq": wq, "wk": wk, "wv": wv}, ["q", "k", "v"])
    nodes = cross_kv_nodes(first, weight_parts(step, first))
    assert nodes == ["cross_k", "cross_v"]  # the step's weight is not one of them
    onnx.save(first, str(tmp_path / "first.onnx"))
    quantize_cross_kv(tmp_path / "first.onnx", tmp_path / "q.onnx", nodes)
    q = onnx.load(str(tmp_path / "q.onnx"))
    assert [n.name for n in q.graph.node if n.op_type == "MatMul"] == ["q_proj"]
    assert sum(n.op_type in ("MatMulInteger", "DynamicQuantizeMatMul") for n in q.graph.node) == 2
    x = {"memory": rng.standard_normal((1, 64, 16)).astype(np.float32)}
    so = session_options(threads=1)  # a package's sessions: exact INT8 products on CPUs without VNNI too
    ref = ort.InferenceSession(first.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, x)
    got = ort.InferenceSession(q.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, x)
    np.testing.assert_array_equal(got[0], ref[0])  # untouched
    for a, b in zip(got[1:], ref[1:]):
        assert np.abs(a - b).max() < 0.05 * np.abs(b).max() and not np.array_equal(a, b)


@pytest.mark.slow
def test_a_decoder_node_marked_float_keeps_its_float_weight_in_both_decoder_graphs(root, searched, tmp_path):
    from pipeline.quantization.decoder import weight_nodes

    plan = json.loads((searched / "plan.json").read_text())
    nodes = sorted(plan["decoder_nodes"])
    assert nodes and plan["decoder"] in ("int8", "float")
    floated = nodes[0]
    plan["decoder"] = "int8"
    plan["decoder_nodes"] = {n: ("float" if n == floated else "int8") for n in nodes}
    plan["decoder_cross_kv"] = "int8"
    path = tmp_path / "edited-decoder.json"
    path.write_text(json.dumps(plan))
    _run(root, f"quantize.plan={path}", "quantize.name=quantize-edited-decoder")
    out = root / "quantize-edited-decoder"
    assert json.loads((out / "plan.json").read_text())["decoder_nodes"] == plan["decoder_nodes"]
    step = onnx.load(str(out / "decoder_step.ort_cpu.int8.onnx"))
    assert sum(n.op_type == "MatMulNBits" for n in step.graph.node) == len(nodes) - 1
    assert list(weight_nodes(step)) == [floated]  # the one float MatMul with a constant weight left
    first = onnx.load(str(out / "decoder_first.ort_cpu.int8.onnx"))
    assert sum(n.op_type == "MatMulNBits" for n in first.graph.node) == len(nodes) - 1
    # the same matrix stayed float there; the cross-attention K/V projections, which only
    # decoder_first has, are dynamic INT8 as the plan says
    assert set(weight_nodes(step).values()) == set(weight_nodes(first).values())
    assert sum(n.op_type in ("MatMulInteger", "DynamicQuantizeMatMul") for n in first.graph.node) == 2
    assert json.loads((out / "plan.json").read_text())["decoder_cross_kv"] == "int8"
    bad = dict(plan, decoder_nodes={"no-such-node": "int8"})
    path.write_text(json.dumps(bad))
    with pytest.raises(PipelineError, match="decoder node"):
        _run(root, f"quantize.plan={path}", "quantize.name=quantize-bad-decoder")
    assert not (root / "quantize-bad-decoder").exists()


@pytest.mark.parametrize("losses, want", [([0.0, 0.0, 0.0, 0.0], 0),     # everything INT8 fits
                                          ([0.3, 0.2, 0.004, 0.0], 2),   # two groups back to float
                                          ([0.3, 0.2, 0.1, 0.0], 3)])    # only the float model fits
def test_plan_search_never_reads_the_float_model(losses, want):
    """The binary search's upper end (every group float) is the float model, loss 0 by definition:
    it is never decoded, so a search costs one read fewer."""
    from pipeline.quantization.search import smallest_within

    asked = []

    def loss(k: int) -> float:
        asked.append(k)
        return losses[k]

    n = len(losses) - 1
    assert smallest_within(loss, n, 0.005, progress=False) == want
    assert n not in asked and asked[0] == 0 and len(asked) == len(set(asked))


def test_plan_search_gallops_from_all_int8():
    """Every monotone loss curve: the search returns the smallest k within the budget (what a binary
    search over 0..n returns), and a plan that returns one group of 26 to float reads k = 0 and 1
    only: candidates over the budget stop early, those within it are read whole."""
    import random

    from pipeline.quantization.search import smallest_within

    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 30)
        drops = sorted((rng.random() for _ in range(n)), reverse=True)
        losses = [max(0.0, 0.05 * sum(drops[k:]) - 0.01) for k in range(n)] + [0.0]
        asked = []
        got = smallest_within(lambda k: asked.append(k) or losses[k], n, 0.005, progress=False)
        assert got == min(k for k in range(n + 1) if losses[k] <= 0.005)
        assert n not in asked and len(asked) <= 2 * max(1, n).bit_length() + 1
    asked = []
    assert smallest_within(lambda k: asked.append(k) or (0.5 if k == 0 else 0.0), 26, 0.005, progress=False) == 1
    assert asked == [0, 1]


@pytest.mark.slow
def test_check_off_leaves_the_plan_and_graphs_and_says_so(root, searched):
    """quantize.check=false (stage=all): the same plan and graphs, no eval check, no Pareto plot."""
    _run(root, "quantize.check=false", "quantize.name=quantize-nocheck")
    out = root / "quantize-nocheck"
    metrics = json.loads((out / "quantize.json").read_text())
    assert metrics["anchors"] == [] and not (out / "pareto.png").exists()
    assert "Off (`quantize.check=false`" in (out / "report.md").read_text()
    for name in ("plan.json", "encoder.qdq.onnx", "encoder.ort_cpu.qdq.onnx"):
        assert (out / name).read_bytes() == (searched / name).read_bytes(), name


def test_paired_counts_and_standard_error_of_a_loss():
    from pipeline.quantization.measure import Reading

    ref = Reading([[1]] * 8, [""] * 8, [True, True, True, True, False, False, False, False], 0.0)
    plan = Reading([[1]] * 8, [""] * 8, [True, True, True, False, True, False, False, False], 0.0)
    p = plan.paired(ref)
    assert (p["gained"], p["lost"]) == (1, 1)
    # differences -1, +1 and six 0: variance 2/8, standard error sqrt(0.25 / 8)
    assert p["loss_se"] == pytest.approx((0.25 / 8) ** 0.5)
    assert ref.paired(ref) == {"gained": 0, "lost": 0, "loss_se": 0.0}


def test_the_search_trace_reports_gained_lost_and_the_paired_error(searched):
    metrics = json.loads((searched / "quantize.json").read_text())
    for row in metrics["search_trace"] + metrics["ort_cpu_search_trace"]:
        assert {"gained", "lost", "loss_se"} <= set(row)
        assert row["loss"] == pytest.approx((row["lost"] - row["gained"]) / metrics["search_n"])
    report = (searched / "report.md").read_text()
    assert "gained / lost vs float" in report and "paired standard error" in report


@pytest.mark.slow
def test_anchors_run_beside_ours_nncf_judged_by_our_greedy_reading_of_the_search_set(root, monkeypatch):
    """quantize.anchors=true: every anchor is a row with numbers (or says why not), and NNCF's
    accuracy control validates on our search set, rows named by index, with our budget."""
    pytest.importorskip("nncf")
    import nncf

    from pipeline.quantization import anchors

    seen = {}
    real = nncf.quantize_with_accuracy_control

    def spy(model, calibration_dataset, validation_dataset, validation_fn, **kw):
        seen["rows"] = list(validation_dataset.get_data())
        seen["kw"] = kw
        seen["first"] = validation_fn(model, [0, 1])  # our reading of two search rows with the float encoder
        return real(model, calibration_dataset, validation_dataset, validation_fn, **kw)

    monkeypatch.setattr(nncf, "quantize_with_accuracy_control", spy)
    _run(root, "quantize.anchors=true", "quantize.name=quantize-anchors", "quantize.budget=0.25")
    metrics = json.loads((root / "quantize-anchors" / "quantize.json").read_text())
    rows = {r["variant"]: r for r in metrics["anchors"]}
    assert {"float (ort_cpu package)", "ORT quantize_dynamic", "ORT quantize_static (defaults)",
            anchors.NNCF} <= set(rows)
    nncf_row = rows[anchors.NNCF]
    assert "exact_match" in nncf_row and nncf_row["int8_mac_share"] > 0, nncf_row
    assert "max_drop=0.25" in nncf_row["note"]
    assert seen["rows"] == list(range(8)) and seen["kw"]["max_drop"] == 0.25 and seen["kw"]["subset_size"] == 8
    em, per_row = seen["first"]
    assert len(per_row) == 2 and set(per_row) <= {0.0, 1.0} and em == sum(per_row) / 2
    assert not (root / "quantize-anchors" / ".work").exists()
    assert anchors.NNCF in (root / "quantize-anchors" / "report.md").read_text()
    # ModelOpt ran (or said why not) in a child process: importing it patches ONNX Runtime's
    # calibrators for the whole process, and this process calibrates again after the anchors
    assert "exact_match" in rows[anchors.MODELOPT] or rows[anchors.MODELOPT]["note"].startswith("not run"), rows
    from onnxruntime.quantization.calibrate import CalibraterBase, MinMaxCalibrater

    assert CalibraterBase.select_tensors_to_calibrate.__module__ == "onnxruntime.quantization.calibrate"
    assert MinMaxCalibrater.collect_data.__module__ == "onnxruntime.quantization.calibrate"


def test_a_budget_finer_than_the_search_set_resolves_is_said(searched):
    """The deployable plan's search-set loss and its paired SE are in quantize.json; when the SE is
    above the budget, one line says so (the log and the report), else nothing."""
    from pipeline.quantization.report import resolution_note

    metrics = json.loads((searched / "quantize.json").read_text())
    r = metrics["ort_cpu_search"]
    assert {"loss", "gained", "lost", "loss_se"} <= set(r) and r["loss_se"] >= 0
    m = {"budget": 0.005, "search_n": 256, "ort_cpu_search": {"loss": 0.0, "gained": 3, "lost": 3, "loss_se": 0.0095}}
    note = resolution_note(m)
    assert note and "256 search formulas" in note and "+0.0%" in note and "0.9%" in note and "3 lost" in note
    assert "quantize.search_split=train" in note  # what buys the resolution
    assert resolution_note({**m, "ort_cpu_search": {**m["ort_cpu_search"], "loss_se": 0.004}}) is None
    assert resolution_note({"budget": 0.005, "search_n": 8}) is None  # a plan file from before: no reading kept
    report = (searched / "report.md").read_text()
    assert ("**Resolution:**" in report) == (resolution_note(metrics) is not None)


def test_search_split_reads_the_plan_search_on_that_split(root, searched, monkeypatch):
    """quantize.search_split=train: the plan search (float, methods, both plans, the decoder's) reads
    the split's first search_images formulas; ranges and sensitivity stay calibration rows."""
    from pipeline.quantization import check, decoder_plan, measure, search
    from tiny_model import tiny_corpus

    train = [f.latex for f in tiny_corpus() if f.split == "train"][:5]
    seen = []
    real_read = measure.read

    def recording(readers, encoder, images, truths, *a, **k):
        seen.append(list(truths))
        return real_read(readers, encoder, images, truths, *a, **k)

    for module in (search, decoder_plan, check):  # every reading the stage takes outside read_or_reject
        monkeypatch.setattr(module, "read", recording)
    _run(root, "quantize.search_split=train", "quantize.search_images=5", "quantize.decoder_search_images=5",
         "quantize.check=false", "quantize.name=quantize-train-search")
    metrics = json.loads((root / "quantize-train-search" / "quantize.json").read_text())
    assert metrics["search_n"] == 5
    assert metrics["search"]["search_set"] == "train split, its first 5 formulas"
    assert metrics["search"]["decoder_search_set"] == "train split, its first 5 formulas"
    assert seen and all(t == train for t in seen)
    # the default search (calibration rows) is not the same set, and its artifact is not reused for this one
    assert json.loads((searched / "quantize.json").read_text())["search"]["search_set"].startswith("calibration-set rows")


def test_an_unknown_search_split_is_one_error_and_no_artifact(root):
    with pytest.raises(Exception, match="quantize.search_split=trian") as refused:  # when Hydra composes
        _run(root, "quantize.search_split=trian", "quantize.name=quantize-bad-split")
    assert "Invalid value 'trian', expected one of [train, calib, eval, shift]" in str(refused.value.__cause__)
    assert not (root / "quantize-bad-split").exists() and not list(root.glob(".tmp-quantize-bad-split*"))


def test_a_search_reading_stops_once_its_candidate_is_clearly_over_the_budget_and_not_before(monkeypatch):
    from pipeline.quantization import measure
    from pipeline.quantization.measure import Reading, loss_against, read_or_reject

    truths = [f"t{i}" for i in range(512)]
    reference = Reading([[i] for i in range(512)], truths, [True] * 512, 0.0)
    asked = []

    def fake_read(package, encoder, images, truths, max_length, batch_size):
        asked.append(len(images))
        right = {"bad": lambda i: i % 3 == 0, "close": lambda i: i % 100 != 7}[encoder]
        rows = [int(x) for x in images]
        return Reading([[i] for i in rows], [truths[k] if right(i) else "x" for k, i in enumerate(rows)],
                       [right(i) for i in rows], 0.0)

    monkeypatch.setattr(measure, "read", fake_read)
    images = np.arange(512)
    bad = read_or_reject(None, "bad", images, truths, 8, 16, reference, 0.005, chunk=128)
    assert asked == [128] and len(bad.exact) == 128 and loss_against(bad, reference) > 0.5  # stopped after a chunk
    asked.clear()
    # 1 % lost: over the 0.5-point budget, but not by 3 standard errors: read whole, the whole set decides
    close = read_or_reject(None, "close", images, truths, 8, 16, reference, 0.005, chunk=128)
    assert asked == [128] * 4 and len(close.exact) == 512
    assert loss_against(close, reference) == pytest.approx(1 - np.mean([i % 100 != 7 for i in range(512)]))
