"""KV-cached decoder equals full recompute (torch and ONNX), on a tiny random model; the validator
names planted rule breaks; TensorRT profiles and the builder up to its build call."""
from __future__ import annotations

import sys
import types
from unittest import mock

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf, ValidationError
from onnx import TensorProto, helper, numpy_helper

from pipeline.errors import PipelineError
from pipeline.export import tensorrt as trt_build
from pipeline.adapters.kv_cache import CachedDecoder
from pipeline.export.graphs import DecoderFirstGraph, DecoderStepGraph
from pipeline.export.onnx_graphs import export_graphs
from pipeline.export.targets import resolve_target
from pipeline.export.transforms import to_fp16
from pipeline.export.validator import FLOAT_ONLY_OPS, Rules, validate

BOS, EOS = 1, 2


@pytest.fixture(scope="module")
def tiny_model():
    from latex_ocr_junia.model import ModelConfig, build_model

    from pipeline.adapters.attention import replace_mha

    torch.manual_seed(0)
    cfg = ModelConfig(image_height=16, image_width=32, patch_size=8, d_model=32, num_heads=4,
                      num_encoder_layers=2, num_decoder_layers=2, mlp_dim=64, dropout=0.1, max_length=40,
                      vocab_size=23, pad_token_id=0)
    model = build_model(cfg)
    replace_mha(model)
    return model.eval()


@pytest.fixture(scope="module")
def tiny_adapter(tiny_model):
    from pipeline.adapters.latex_ocr_junia import LatexOcrJuniaAdapter

    tokenizer = types.SimpleNamespace(bos_id=BOS, eos_id=EOS, pad_id=0)
    return LatexOcrJuniaAdapter(tiny_model, tiny_model.config_obj, tokenizer, "tokenizer.json")


def _cached_greedy(model, memory, max_length):
    """Greedy decoding through the two decoder graphs (torch), as the ONNX runner does it."""
    first, step = DecoderFirstGraph(CachedDecoder(model)).eval(), DecoderStepGraph(CachedDecoder(model)).eval()
    n = 2 * len(model.decoder_blocks)
    outs = first(torch.full((memory.shape[0], 1), BOS, dtype=torch.long), memory)
    logits, past, cross = outs[0], list(outs[1:1 + n]), list(outs[1 + n:])
    seqs = []
    for _ in range(max_length - 1):
        logits[:, [0, BOS]] = float("-inf")
        nxt = logits.argmax(-1)
        seqs.append(nxt)
        o = step(nxt[:, None], *past, *cross)
        logits, past = o[0], list(o[1:])
    return torch.stack(seqs, 1)


def _recompute_greedy(model, memory, max_length):
    """The torch model's own way: re-run the whole prefix at every step."""
    seqs = torch.full((memory.shape[0], 1), BOS, dtype=torch.long)
    for _ in range(max_length - 1):
        logits = model.decode(seqs, memory)[:, -1].clone()
        logits[:, [0, BOS]] = float("-inf")
        seqs = torch.cat([seqs, logits.argmax(-1)[:, None]], dim=1)
    return seqs[:, 1:]


@torch.no_grad()
def test_kv_cache_logits_equal_full_recompute(tiny_model):
    memory = tiny_model.encode(torch.rand(3, 1, 16, 32))
    tokens = torch.randint(3, 23, (3, 12))
    tokens[:, 0] = BOS
    full = tiny_model.decode(tokens, memory)  # [B, T, V]
    first = DecoderFirstGraph(CachedDecoder(tiny_model)).eval()
    step = DecoderStepGraph(CachedDecoder(tiny_model)).eval()
    out = first(tokens[:, :1], memory)
    n = 2 * len(tiny_model.decoder_blocks)
    logits, past, cross = out[0], list(out[1:1 + n]), list(out[1 + n:])
    cached = [logits]
    for t in range(1, tokens.shape[1]):
        o = step(tokens[:, t:t + 1], *past, *cross)
        cached.append(o[0])
        past = list(o[1:])
        assert past[0].shape[2] == t + 1
    torch.testing.assert_close(torch.stack(cached, 1), full, rtol=1e-4, atol=1e-5)
    # a whole prefix through the first graph (causal mask from shapes) equals it too
    torch.testing.assert_close(first(tokens, memory)[0], full[:, -1], rtol=1e-4, atol=1e-5)


@torch.no_grad()
def test_kv_cache_greedy_equals_recompute_greedy(tiny_model):
    memory = tiny_model.encode(torch.rand(4, 1, 16, 32))
    ref = _recompute_greedy(tiny_model, memory, 20)
    got = _cached_greedy(tiny_model, memory, 20)
    assert torch.equal(got, ref)


@torch.no_grad()
def test_onnx_graphs_dynamic_axes_equal_recompute(tiny_model, tiny_adapter):
    import onnxruntime as ort

    graphs = export_graphs(tiny_adapter, 17)
    assert all(m.opset_import[0].version == 17 for m in graphs.values())
    sess = {g: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]) for g, m in graphs.items()}
    images = torch.rand(3, 1, 16, 32)  # batch 3: the graphs were traced at batch 2
    memory = sess["encoder"].run(None, {"images": images.numpy()})[0]
    np.testing.assert_allclose(memory, tiny_model.encode(images).numpy(), rtol=1e-4, atol=1e-4)
    tokens = torch.randint(3, 23, (3, 9))
    tokens[:, 0] = BOS
    full = tiny_model.decode(tokens, torch.from_numpy(memory)).numpy()
    outs = sess["decoder_first"].run(None, {"input_ids": tokens[:, :1].numpy(), "memory": memory})
    n = 2 * len(tiny_model.decoder_blocks)
    past, cross = outs[1:1 + n], outs[1 + n:]
    np.testing.assert_allclose(outs[0], full[:, 0], rtol=1e-4, atol=1e-4)
    names = [i.name for i in sess["decoder_step"].get_inputs()]
    for t in range(1, tokens.shape[1]):
        o = sess["decoder_step"].run(None, dict(zip(names, [tokens[:, t:t + 1].numpy(), *past, *cross])))
        np.testing.assert_allclose(o[0], full[:, t], rtol=1e-4, atol=1e-4)
        past = o[1:]
    # the verify graph (batch 1, 1..VERIFY_WIDTH tokens): after a past of any length, logits after each
    # token equal single steps' (a lone token: padded to two rows, VerifyCalls)
    from pipeline.decoding import VerifyCalls
    from pipeline.export.graphs import VERIFY_WIDTH

    vnames = [i.name for i in sess["decoder_verify"].get_inputs()]
    assert vnames == names and sess["decoder_verify"].get_inputs()[0].shape == [1, "width"]

    def run(ids, past, cross):
        o = sess["decoder_verify"].run(None, dict(zip(vnames, [ids, *past, *cross])))
        return o[0], o[1:]

    def step(ids, past, cross):  # near the position table: the step graph
        o = sess["decoder_step"].run(None, dict(zip(names, [ids, *past, *cross])))
        return o[0], o[1:]

    long = torch.randint(3, 23, (3, 14))
    long[:, 0] = BOS
    ref = tiny_model.decode(long, torch.from_numpy(memory)).numpy()
    for row in range(3):
        for cut, width in ((1, 1), (1, 4), (3, VERIFY_WIDTH), (5, 3)):
            o = sess["decoder_first"].run(None, {"input_ids": long[row:row + 1, :cut].numpy(), "memory": memory[row:row + 1]})
            verify = VerifyCalls(run, step, VERIFY_WIDTH, 40)
            lo, present = verify(long[row:row + 1, cut:cut + width].numpy(), o[1:1 + n], o[1 + n:])
            assert lo.shape == (1, width, ref.shape[-1])
            np.testing.assert_allclose(lo[0], ref[row, cut:cut + width], rtol=1e-4, atol=1e-4)
            # the tokens checked (a lone token's pad row too: the loop cuts the cache to what it wrote)
            assert all(p.shape[2] == cut + max(width, 2) for p in present)
    # FP16 weights: still loadable with float32 I/O, close to float
    m16 = to_fp16(graphs["decoder_step"])
    assert any(t.data_type == TensorProto.FLOAT16 for t in m16.graph.initializer)
    s16 = ort.InferenceSession(m16.SerializeToString(), providers=["CPUExecutionProvider"])
    o16 = s16.run(None, dict(zip(names, [tokens[:, 1:2].numpy(), *outs[1:1 + n], *cross])))
    assert np.corrcoef(o16[0].ravel(), full[:, 1].ravel())[0, 1] > 0.99


# ---- validator ----------------------------------------------------------------------------------

def _graph(nodes, inits, opset=17, ir=8, extra_opsets=()):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    g = helper.make_graph(nodes, "g", [x], [y], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset), *extra_opsets])
    m.ir_version = ir
    return m


METAX = Rules("metax", max_opset=17, max_ir_version=8, allow_contrib_ops=False, symmetric_int8=True,
              per_channel_weights=True, per_tensor_activations=True, float_only_ops=FLOAT_ONLY_OPS)


def _int8(name, value):
    return numpy_helper.from_array(np.asarray(value, dtype=np.int8), name)


def _f32(name, value):
    return numpy_helper.from_array(np.asarray(value, dtype=np.float32), name)


def test_validator_accepts_a_clean_symmetric_qdq_graph():
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"], name="q_act"),
             helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"], name="dq_act"),
             helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wd"], name="dq_w", axis=1),
             helper.make_node("MatMul", ["xd", "wd"], ["m"], name="mm"),
             helper.make_node("LayerNormalization", ["m", "g", "b"], ["y"], name="ln", axis=-1)]
    inits = [_f32("s", 0.1), _int8("z", 0), _int8("w", np.ones((4, 4))), _f32("ws", [0.1] * 4),
             _int8("wz", [0] * 4), _f32("g", [1] * 4), _f32("b", [0] * 4)]
    assert validate(_graph(nodes, inits), METAX, "enc") == []


def test_validator_names_planted_opset18_contrib_and_quantized_layernorm():
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"], name="q_act"),
             helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"], name="dq_act"),
             helper.make_node("LayerNormalization", ["xd", "g", "b"], ["ln_out"], name="ln_quantized", axis=-1),
             helper.make_node("Gelu", ["ln_out"], ["y"], name="contrib_gelu", domain="com.microsoft")]
    inits = [_f32("s", 0.1), _int8("z", 0), _f32("g", [1] * 4), _f32("b", [0] * 4)]
    m = _graph(nodes, inits, opset=18, ir=9, extra_opsets=[helper.make_opsetid("com.microsoft", 1)])
    found = [str(v) for v in validate(m, METAX, "encoder")]
    assert any("opset 18 > 17" in f for f in found), found
    assert any("IR version 9 > 8" in f for f in found), found
    assert any("'contrib_gelu'" in f and "contrib op" in f for f in found), found
    assert any("'ln_quantized'" in f and "quantized LayerNormalization" in f for f in found), found
    assert all(f.startswith("encoder: ") for f in found)
    # ORT CPU allows all of it but the opset ceiling it does not set
    assert validate(m, Rules("ort_cpu"), "encoder") == []


def test_validator_names_asymmetric_and_per_tensor_weight_nodes():
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "zu"], ["xq"], name="q_uint8"),
             helper.make_node("DequantizeLinear", ["xq", "s", "zu"], ["xd"], name="dq_uint8"),
             helper.make_node("DequantizeLinear", ["w", "s", "zw"], ["wd"], name="dq_w_per_tensor"),
             helper.make_node("QuantizeLinear", ["x", "s", "z5"], ["y"], name="q_asym")]
    inits = [_f32("s", 0.1), numpy_helper.from_array(np.asarray(128, dtype=np.uint8), "zu"),
             _int8("w", np.ones((4, 4))), _int8("zw", 0), _int8("z5", 5)]
    found = {v.node: v.rule for v in validate(_graph(nodes, inits), METAX, "enc")}
    assert "uint8" in found["q_uint8"] and "uint8" in found["dq_uint8"]
    assert "per-channel" in found["dq_w_per_tensor"]
    assert "asymmetric" in found["q_asym"]


def test_unknown_target_and_bad_opset_are_refused():
    from conftest import compose_cfg

    cfg = compose_cfg(["target=metax"])
    assert resolve_target(cfg.target).rules.max_ir_version == 8
    with pytest.raises(ValidationError, match=r"Invalid value 'nnapi', expected one of \[ort_cpu, tensorrt, metax\]"):
        cfg.target.name = "nnapi"  # the target group's schema refuses it; an untyped config, the target's check
    untyped = OmegaConf.create({**OmegaConf.to_container(cfg.target), "name": "nnapi"})
    with pytest.raises(PipelineError, match="unknown export target 'nnapi'"):
        resolve_target(untyped)
    cfg = compose_cfg(["target=ort_cpu", "target.opset=13"])
    with pytest.raises(PipelineError, match="LayerNormalization"):
        resolve_target(cfg.target)
    cfg = compose_cfg(["target=metax", "target.opset=18"])
    with pytest.raises(PipelineError, match="max_opset"):
        resolve_target(cfg.target)


# ---- TensorRT -------------------------------------------------------------------------------------

META = {"input_shape": [1, 128, 512], "num_heads": 8, "head_dim": 32, "memory_length": 1024, "max_length": 160,
        "hidden_size": 256, "io": {"decoder_step": {"inputs": ["input_ids", "past_key_0", "past_value_0",
                                                               "cross_key_0", "cross_value_0"]}}}


def test_tensorrt_profiles_and_trtexec_command():
    p = trt_build.profiles(META, max_batch=16, opt_len=48)
    assert p["encoder"]["images"] == ((1, 1, 128, 512), (1, 1, 128, 512), (16, 1, 128, 512))
    assert p["decoder_step"]["past_key_0"] == ((1, 8, 1, 32), (1, 8, 48, 32), (16, 8, 159, 32))
    assert p["decoder_step"]["cross_value_0"][2] == (16, 8, 1024, 32)
    cmd = trt_build.trtexec_command("decoder_step.onnx", "decoder_step.plan", p["decoder_step"], int8=True)
    assert cmd.startswith("trtexec --onnx=decoder_step.onnx --saveEngine=decoder_step.plan --fp16 --int8 ")
    assert "--maxShapes=input_ids:16x1,past_key_0:16x8x159x32," in cmd
    # a package with a verify graph: batch 1, 1..verify_width tokens
    v = trt_build.profiles({**META, "graphs": {"decoder_verify": "decoder_verify.onnx"}, "verify_width": 9}, 16, 48)
    assert v["decoder_verify"]["input_ids"] == ((1, 1), (1, 9), (1, 9))
    assert v["decoder_verify"]["past_key_0"] == ((1, 8, 1, 32), (1, 8, 48, 32), (1, 8, 159, 32))
    assert "--timingCacheFile=timing.cache" in cmd


def test_tensorrt_builder_without_tensorrt_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import tensorrt -> ImportError
    assert not trt_build.tensorrt_available()
    with pytest.raises(PipelineError, match="tensorrt is not installed.*trtexec"):
        trt_build.build_engine(tmp_path / "e.onnx", tmp_path / "e.plan", {}, False, tmp_path / "c", tmp_path / "l")


def test_tensorrt_builder_calls_up_to_the_build(tmp_path, monkeypatch):
    """A stand-in ``tensorrt`` module records what the builder is asked; the real one is absent here."""
    trt = mock.MagicMock()
    trt.ILogger = type("ILogger", (), {"__init__": lambda self: None})
    trt.NetworkDefinitionCreationFlag = types.SimpleNamespace(EXPLICIT_BATCH=0)
    builder = trt.Builder.return_value
    builder.build_serialized_network.return_value = b"engine-bytes"
    config = builder.create_builder_config.return_value
    config.get_timing_cache.return_value.serialize.return_value = b"cache"
    trt.OnnxParser.return_value.parse_from_file.return_value = True
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    profile = trt_build.profiles(META, 4, 16)["decoder_step"]
    info = trt_build.build_engine(tmp_path / "decoder_step.onnx", tmp_path / "decoder_step.plan", profile, True,
                                  tmp_path / "timing.cache", tmp_path / "build.log")
    assert (tmp_path / "decoder_step.plan").read_bytes() == b"engine-bytes"
    assert (tmp_path / "timing.cache").read_bytes() == b"cache"
    assert (tmp_path / "build.log").is_file()
    flags = [c.args[0] for c in config.set_flag.call_args_list]
    assert flags == [trt.BuilderFlag.FP16, trt.BuilderFlag.INT8]
    opt = builder.create_optimization_profile.return_value
    assert {c.args[0]: c.args[1:] for c in opt.set_shape.call_args_list} == profile
    config.add_optimization_profile.assert_called_once_with(opt)
    assert info["int8"] and info["engine"] == "decoder_step.plan"
    # a parse failure names the file and the parser's first error
    trt.OnnxParser.return_value.parse_from_file.return_value = False
    trt.OnnxParser.return_value.num_errors = 1
    trt.OnnxParser.return_value.get_error.return_value = "Unsupported op Foo"
    with pytest.raises(PipelineError, match="decoder_step.onnx: TensorRT cannot parse it: Unsupported op Foo"):
        trt_build.build_engine(tmp_path / "decoder_step.onnx", tmp_path / "x.plan", profile, True,
                               tmp_path / "timing.cache", tmp_path / "build.log")


def test_residual_sum_keeps_the_last_add_out_of_skip_layernorm():
    """A block's residual Add read only by a LayerNorm becomes Sum, so the session cannot fuse the two into
    SkipLayerNormalization; a residual also read by the next block, and a bias Add, stay Add; the output
    is the same."""
    import onnxruntime as ort

    from export_session import session_ops
    from pipeline.export.transforms import residual_adds_as_sum

    d = 8
    nodes = [helper.make_node("Add", ["x", "bias"], ["xb"], name="bias_add"),            # a constant input
             helper.make_node("Add", ["xb", "r"], ["h"], name="residual_1"),             # also read by residual_2
             helper.make_node("LayerNormalization", ["h", "g", "b"], ["n1"], name="ln1", axis=-1),
             helper.make_node("Add", ["h", "n1"], ["h2"], name="residual_2"),            # read by the last LN only
             helper.make_node("LayerNormalization", ["h2", "g", "b"], ["y"], name="ln2", axis=-1)]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 5, d]) for n in ("x", "r")]
    inits = [_f32("bias", np.linspace(-1, 1, d)), _f32("g", np.linspace(0.5, 1.5, d)), _f32("b", [0.1] * d)]
    model = helper.make_model(helper.make_graph(nodes, "g", inputs,
                                                [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    assert "SkipLayerNormalization" in session_ops(model)  # what the rewrite prevents
    feed = {n: np.random.default_rng(i).normal(size=(1, 5, d)).astype(np.float32) for i, n in enumerate(("x", "r"))}
    before = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)[0]

    assert residual_adds_as_sum(model) == 1
    assert [n.op_type for n in model.graph.node] == ["Add", "Add", "LayerNormalization", "Sum", "LayerNormalization"]
    assert "SkipLayerNormalization" not in session_ops(model)
    after = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)[0]
    np.testing.assert_allclose(after, before, atol=1e-5)
    assert residual_adds_as_sum(model) == 0  # nothing left to rewrite


def test_only_ort_cpu_writes_residual_sums():
    from pipeline.export.targets import target_config

    assert resolve_target(target_config("ort_cpu")).residual_sum
    assert not resolve_target(target_config("tensorrt")).residual_sum
    assert not resolve_target(target_config("metax")).residual_sum
