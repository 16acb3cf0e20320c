"""The ort_cpu decoder in INT8: weight-only 8-bit ``MatMulNBits``, node by node, chosen by sensitivity.

A decoder step reads one token, so its cost on the CPU is reading its weights (3.9 M of them, 16 MB
in FP32, every step) and the cross-attention over the encoder's 1024 tokens; the arithmetic is small.
ONNX Runtime's ``MatMulNBitsQuantizer`` stores each weight matrix in 8 bits per element with one
scale per block of 32 inputs (symmetric), and its CPU kernel (``accuracy_level=4``) multiplies in
INT8 with VNNI. Measured on 384 calibration formulas: every weight in 8 bits cost 0.7 point of exact
match and changed 9 % of the readings; ``quantize_dynamic`` (per-channel weights, per-tensor dynamic
activations) the same loss with 18 % of readings changed (docs/quantize.md). The loss is spread:
each weight alone changes 1-9 % of readings; so the stage ranks the nodes by the logit SNR each
costs alone, on decoder-step inputs recorded from greedy readings of calibration images (the K/V
caches and tokens the graph really sees), and keeps the most sensitive in float until the budget
holds. ``decoder_first`` (one call a formula) follows the plan of ``decoder_step`` (same weights).
Its cross-attention K/V projections of the encoder output, which only it has, are matrices of 1,024
rows (every memory token): in FP32 they were 10 of the 14 ms ``decoder_first`` takes (a quarter of a
formula's decoder time on eval); ``MatMulNBits`` ran them no faster (its INT8 path is made for a few
rows), ORT's dynamic INT8 (``quantize_dynamic``: per-channel INT8 weights, per-tensor UINT8
activations, ``MatMulIntegerToFloat`` on VNNI) in half the time (:func:`quantize_cross_kv`).

Contrib op: ``ort_cpu`` only. TensorRT and Metax keep the float decoder (FP16 at export).
"""
from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from pipeline.errors import PipelineError
from pipeline.names import DECODER_STEP

BITS = 8
BLOCK = 32
ACCURACY_LEVEL = 4  # INT8 activations inside the kernel (VNNI); 0 computes in FP32 and ran 6x slower


def to_matmul(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every ``Gemm`` with a constant weight becomes ``MatMul`` (+ ``Add`` of its bias), in place:
    ORT's weight-only quantizer rewrites MatMul only. Same outputs (``Gemm`` with ``transB`` has
    its weight stored transposed here once).

    A ``Gemm`` reads two dimensions, so the exported graph flattens a projection's [B, S, K] input to
    [B·S, K] with a ``Reshape`` and reshapes the result back (onnxsim's MatMul + Add -> Gemm fusion
    writes that pair around every projection). ``MatMul`` reads [B, S, K] as it is: where the shapes
    say the pair is a plain flatten and unflatten, the ``MatMul`` takes the unflattened input and
    writes the reshaped output's name, and the pair is gone (the default model's decoder step: all 72
    ``Reshape`` nodes, 151 -> 79 nodes in the session, a step 8 % faster on this CPU; docs/export.md)."""
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    shapes = _shapes(model)
    made = {o: n for n in g.node for o in n.output}
    readers: dict[str, list] = {}
    for n in g.node:
        for name in n.input:
            readers.setdefault(name, []).append(n)
    outputs = {o.name for o in g.output}
    nodes, gone = [], set()
    for n in g.node:
        if id(n) in gone:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        if n.op_type != "Gemm" or n.input[1] not in inits or attrs.get("transA", 0) \
                or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0:
            nodes.append(n)
            continue
        w = numpy_helper.to_array(inits[n.input[1]])
        if attrs.get("transB", 0):
            w = w.T
        weight = f"{n.input[1]}/matmul"
        g.initializer.append(numpy_helper.from_array(np.ascontiguousarray(w), weight))
        name = n.name or n.output[0]
        source, out = n.input[0], n.output[0]
        plain = _plain_flatten(model, made.get(source), shapes, w.shape[0])
        if plain is not None:  # MatMul reads [B, S, K]; the flatten is dropped below once nothing reads it
            source, rows = plain
            out, dropped = _unflattened(out, readers, outputs, shapes, [*rows[:-1], w.shape[1]])
            gone.update(dropped)
        if len(n.input) > 2 and n.input[2]:
            nodes.append(helper.make_node("MatMul", [source, weight], [f"{out}/matmul"], name=f"{name}/matmul"))
            nodes.append(helper.make_node("Add", [f"{out}/matmul", n.input[2]], [out], name=f"{name}/bias"))
        else:
            nodes.append(helper.make_node("MatMul", [source, weight], [out], name=f"{name}/matmul"))
    read = {i for n in nodes for i in n.input} | outputs
    nodes = [n for n in nodes if n.op_type != "Reshape" or n.output[0] in read]  # flattens nothing reads now
    del g.node[:]
    g.node.extend(nodes)
    used = {i for n in g.node for i in n.input}
    keep = [t for t in g.initializer if t.name in used]
    del g.initializer[:]
    g.initializer.extend(keep)
    return model


def _plain_flatten(model: onnx.ModelProto, node, shapes: dict[str, list], k: int) -> tuple[str, list] | None:
    """(its input, that input's shape) where ``node`` reshapes a [..., K] tensor of rank 3 or more to
    [-1, K] (rows stay rows); None otherwise."""
    if node is None or node.op_type != "Reshape":
        return None
    rows = shapes.get(node.input[0])
    if rows is None or len(rows) < 3 or rows[-1] != k or _const(model, node.input[1]) != [-1, k]:
        return None
    return node.input[0], rows


def _unflattened(out: str, readers: dict[str, list], outputs: set[str], shapes: dict[str, list], want: list
                 ) -> tuple[str, set[int]]:
    """The tensor that ends the chain of ``Reshape`` nodes after ``out`` (each the only reader of the last)
    where it has the shape ``want`` (the unflatten, or a head split merged straight back: fusion.py's),
    and the chain's node ids; ``(out, set())`` where no such chain ends in that shape."""
    chain, at = [], out
    while at not in outputs and len(readers.get(at, [])) == 1:
        nxt = readers[at][0]
        if nxt.op_type != "Reshape" or nxt.input[0] != at:
            break
        chain.append(nxt)
        at = nxt.output[0]
        if shapes.get(at) == want:
            return at, {id(r) for r in chain}
    return out, set()


def _shapes(model: onnx.ModelProto) -> dict[str, list]:
    """Every tensor's shape as ONNX Runtime's symbolic shape inference gives it (contrib ops included):
    a dimension is an int or a symbol (the same symbol, the same size). A graph it cannot infer: {}, and
    :func:`to_matmul` keeps every reshape."""
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    try:
        inferred = SymbolicShapeInference.infer_shapes(model, auto_merge=True, guess_output_rank=True)
    except Exception:  # the inference raises plain Exceptions on graphs it does not know
        return {}
    values = [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]
    out = {}
    for v in values:
        dims = v.type.tensor_type.shape.dim
        if v.type.tensor_type.HasField("shape") and all(d.HasField("dim_value") or d.dim_param for d in dims):
            out[v.name] = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in dims]
    return out


def _const(model: onnx.ModelProto, name: str) -> list | None:
    """The values of a constant tensor (an initializer or a ``Constant`` node's), as a list; None otherwise."""
    for t in model.graph.initializer:
        if t.name == name:
            return numpy_helper.to_array(t).tolist()
    for n in model.graph.node:
        if n.op_type == "Constant" and n.output[0] == name and n.attribute and n.attribute[0].name == "value":
            return numpy_helper.to_array(n.attribute[0].t).tolist()
    return None


def _weights(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """MatMul nodes with a constant weight: node name -> the weight."""
    inits = {t.name: t for t in model.graph.initializer}
    return {n.name: numpy_helper.to_array(inits[n.input[1]]) for n in model.graph.node
            if n.op_type == "MatMul" and len(n.input) > 1 and n.input[1] in inits}


def _digest(arr: np.ndarray) -> str:
    return hashlib.sha256(arr.tobytes() + str(arr.shape).encode()).hexdigest()[:16]


def weight_nodes(model: onnx.ModelProto) -> dict[str, str]:
    """MatMul nodes with a constant weight: node name -> a digest of the weight (the same matrix in
    ``decoder_first`` and ``decoder_step`` has the same digest, whatever the exporter named it)."""
    return {name: _digest(w) for name, w in _weights(model).items()}


def quantize(model_path: Path, out: Path, nodes: Sequence[str]) -> None:
    """``model_path`` (MatMul form) with ``nodes`` as 8-bit ``MatMulNBits``, written to ``out``."""
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    from pipeline.quantization.qdq import quiet

    model = onnx.load(str(model_path))
    if not nodes:
        onnx.save(model, str(out))
        return
    config = DefaultWeightOnlyQuantConfig(block_size=BLOCK, is_symmetric=True, accuracy_level=ACCURACY_LEVEL,
                                          bits=BITS)
    # ORT reads nodes_to_include as "these too" (besides every MatMul): name the rest to exclude
    exclude = [n.name for n in model.graph.node if n.op_type == "MatMul" and n.name not in set(nodes)]
    with quiet():
        q = MatMulNBitsQuantizer(model, bits=BITS, block_size=BLOCK, is_symmetric=True,
                                 accuracy_level=ACCURACY_LEVEL, nodes_to_exclude=exclude, algo_config=config)
        q.process()
        q.model.save_model_to_file(str(out), use_external_data_format=False)
    if not out.is_file():
        raise PipelineError(f"onnxruntime's MatMulNBitsQuantizer wrote no graph for {model_path.name}")


def cross_kv_nodes(first: onnx.ModelProto, parts: dict[str, list[str]]) -> list[str]:
    """``decoder_first``'s MatMul nodes (MatMul form) with a constant weight that hold none of
    ``decoder_step``'s weights (``parts``: :func:`weight_parts`): the cross-attention K/V projections of
    the encoder output."""
    return [name for name in _weights(first) if name not in parts]


def quantize_cross_kv(model_path: Path, out: Path, nodes: Sequence[str]) -> None:
    """``model_path`` with ``nodes`` (:func:`cross_kv_nodes`) in dynamic INT8, written to ``out``:
    ORT's ``quantize_dynamic`` (per-channel symmetric INT8 weights; activations quantized per tensor
    at run time), the other nodes as they are (``MatMulNBits`` included)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from pipeline.quantization.qdq import quiet

    if not nodes:
        shutil.copyfile(model_path, out)
        return
    with quiet():
        # a MatMul reading a contrib op's output (MultiHeadAttention's) has no type ONNX can infer: float
        quantize_dynamic(str(model_path), str(out), nodes_to_quantize=list(nodes), per_channel=True,
                         weight_type=QuantType.QInt8, extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
    if not out.is_file():
        raise PipelineError(f"onnxruntime's quantize_dynamic wrote no graph for {Path(model_path).name}")


def weight_parts(step: onnx.ModelProto, other: onnx.ModelProto) -> dict[str, list[str]]:
    """The MatMul nodes of ``other`` (MatMul form) that hold ``step``'s weights -> those step nodes, in
    column order: one for a node holding one of the step's weights, several where ORT's optimizer merged
    q, k and v into one matrix (the shapes fixed). A node holding a weight the step does not have
    (decoder_first's cross-attention K/V) is left out. Computed once; :func:`follow_plan` then maps
    each candidate plan."""
    step_w = _weights(step)
    by_digest = {_digest(w): name for name, w in step_w.items()}
    widths = sorted({w.shape[1] for w in step_w.values()}, reverse=True)
    out = {}
    for name, w in _weights(other).items():
        parts, at = [], 0
        while at < w.shape[1]:
            found = next((by_digest[d] for width in widths if at + width <= w.shape[1]
                          for d in [_digest(w[:, at:at + width])] if d in by_digest and
                          step_w[by_digest[d]].shape[0] == w.shape[0]), None)
            if found is None:
                parts = []
                break
            parts.append(found)
            at += step_w[found].shape[1]
        if parts:
            out[name] = parts
    return out


def follow_plan(parts: dict[str, list[str]], int8_step: Sequence[str]) -> list[str]:
    """The nodes of another decoder graph (``parts``: :func:`weight_parts`) to make 8-bit so that it
    computes what the step with ``int8_step`` in 8 bits does: a node follows the step's node whose weight
    it holds; a merged node is 8-bit when all its parts are, float when none is (``MatMulNBits``
    quantizes each output column on its own, blocks along the input, so a merged matrix in 8 bits holds
    exactly its parts in 8 bits). A merge of 8-bit and float parts cannot follow the plan: ``ValueError``."""
    chosen = set(int8_step)
    out = []
    for name, held in parts.items():
        eight = [p in chosen for p in held]
        if all(eight):
            out.append(name)
        elif any(eight):
            raise ValueError(f"{name} merges decoder_step weights of which some are 8-bit and some float "
                             f"({', '.join(held)})")
    return out


class StepFeeds:
    """Decoder-step inputs recorded from greedy readings (every ``stride``-th step of each image):
    what the step graph really sees. The cross-attention K/V of an image are stored once."""

    def __init__(self, package, images: np.ndarray, max_length: int, stride: int = 4):
        self.names = package.io[DECODER_STEP]["inputs"]
        self.feeds: list[dict[str, np.ndarray]] = []
        original = package.step
        count = [0]

        def recording(input_ids, past, cross):
            if count[0] % stride == 0:
                self.feeds.append(dict(zip(self.names, [np.asarray(input_ids, np.int64), *past, *cross])))
            count[0] += 1
            return original(input_ids, past, cross)

        package.step = recording
        try:
            for img in images:
                package.generate(img[None], max_length=max_length, batch_size=1)
        finally:
            package.step = original
        if not self.feeds:
            raise PipelineError("the decoder took no step on the sensitivity images (every reading ended at once)")

    def logits(self, session) -> np.ndarray:
        return np.concatenate([session.run(["logits"], f)[0].reshape(-1) for f in self.feeds])
