"""One copy of the decoder's weights: graphs saved with their large tensors in one shared external-data
file, each distinct tensor once, read by ONNX Runtime and onnx alike."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from pipeline.export.weights import ALIGN, MIN_BYTES, SHARED_WEIGHTS, save_graphs


def _matmul_graph(name: str, weights: dict[str, np.ndarray], extra: np.ndarray | None = None) -> onnx.ModelProto:
    """x @ W1 @ W2 (+ b): initializers named per graph, as a tracer names them."""
    inits, nodes, last = [], [], "x"
    for i, (wname, w) in enumerate(weights.items()):
        inits.append(numpy_helper.from_array(w, f"{name}.{wname}"))
        nodes.append(helper.make_node("MatMul", [last, f"{name}.{wname}"], [f"h{i}"]))
        last = f"h{i}"
    if extra is not None:  # a small tensor, typed field (not raw_data): stays inline
        inits.append(helper.make_tensor(f"{name}.bias", TensorProto.FLOAT, extra.shape, extra.ravel().tolist()))
        nodes.append(helper.make_node("Add", [last, f"{name}.bias"], ["y"]))
    else:
        nodes.append(helper.make_node("Identity", [last], ["y"]))
    graph = helper.make_graph(nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _run(path, x) -> np.ndarray:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def test_shared_tensors_are_written_once_and_every_graph_reads_as_before(tmp_path):
    rng = np.random.default_rng(0)
    w1, w2, w3 = (rng.standard_normal((32, 32)).astype(np.float32) for _ in range(3))
    bias = rng.standard_normal((1, 32)).astype(np.float32)
    models = {"decoder_first": _matmul_graph("first", {"a": w1, "b": w2, "c": w3}, bias),
              "decoder_step": _matmul_graph("step", {"a": w1, "b": w2}, bias),
              "decoder_verify": _matmul_graph("verify", {"a": w1, "b": w2}),
              "encoder": _matmul_graph("enc", {"a": w1})}
    before = {g: m.SerializeToString() for g, m in models.items()}
    x = rng.standard_normal((1, 32)).astype(np.float32)
    ref = {}
    for g, m in models.items():
        ref[g] = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]

    weights = save_graphs(models, tmp_path, shared=["decoder_first", "decoder_step", "decoder_verify", "no_such"])

    assert {g: m.SerializeToString() for g, m in models.items()} == before  # the models passed in are untouched
    assert weights["file"] == SHARED_WEIGHTS and weights["graphs"] == ["decoder_first", "decoder_step", "decoder_verify"]
    assert weights["tensors"] == 3 and weights["bytes"] == (tmp_path / SHARED_WEIGHTS).stat().st_size
    assert weights["bytes"] < 3 * w1.nbytes + 2 * ALIGN  # three distinct matrices, once each (7 references)
    for g in models:
        np.testing.assert_array_equal(_run(tmp_path / f"{g}.onnx", x), ref[g])
        loaded = onnx.load(str(tmp_path / f"{g}.onnx"))  # onnx reads the shared file from the graph's folder
        onnx.checker.check_model(loaded)
        np.testing.assert_array_equal(numpy_helper.to_array(loaded.graph.initializer[0]), w1)
    step = onnx.load(str(tmp_path / "decoder_step.onnx"), load_external_data=False)
    external = [t for t in step.graph.initializer if t.data_location == TensorProto.EXTERNAL]
    assert len(external) == 2 and all(int(dict((e.key, e.value) for e in t.external_data)["offset"]) % ALIGN == 0
                                      for t in external)
    assert bias.nbytes < MIN_BYTES and len(step.graph.initializer) == 3  # the bias stays inline
    # the encoder is not among the sharing graphs: one self-contained file
    encoder = onnx.load(str(tmp_path / "encoder.onnx"), load_external_data=False)
    assert all(t.data_location != TensorProto.EXTERNAL for t in encoder.graph.initializer)


def test_no_sharing_graph_writes_no_shared_file(tmp_path):
    w = np.ones((32, 32), np.float32)
    assert save_graphs({"encoder": _matmul_graph("enc", {"a": w})}, tmp_path, shared=["decoder_step"]) == {}
    assert not (tmp_path / SHARED_WEIGHTS).exists() and (tmp_path / "encoder.onnx").is_file()
