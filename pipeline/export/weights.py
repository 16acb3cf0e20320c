"""One copy of the decoder's weights in a package.

``decoder_first``, ``decoder_step`` and ``decoder_verify`` are three graphs of one decoder: the same
matrices, traced three ways. Saved as they are, a package carries the decoder three times. Here each
graph keeps its nodes in ``<graph>.onnx`` and its tensors of at least ``MIN_BYTES`` go to one ONNX
external-data file (``SHARED_WEIGHTS``), each distinct tensor once, by content: the graphs point at
the same offsets. Optimum's merged decoder solves the same problem with an If node; external data keeps
each graph a plain ONNX file that ONNX Runtime (1.12 too), TensorRT's parser and ``onnx.load`` read
from its folder unchanged."""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Iterable

import onnx
from onnx import numpy_helper

SHARED_WEIGHTS = "decoder_weights.data"  # the file, beside the graphs
MIN_BYTES = 1024                         # smaller tensors (shapes, scales, biases of a few values) stay inline
ALIGN = 64                               # every tensor starts at a multiple of this offset


def _raw(t: onnx.TensorProto) -> bytes:
    if t.HasField("raw_data"):
        return t.raw_data
    return numpy_helper.to_array(t).tobytes()  # typed fields (float_data ...): the same bytes, little-endian


def save_graphs(models: dict[str, onnx.ModelProto], folder: Path, shared: Iterable[str]) -> dict[str, Any]:
    """Write ``<folder>/<graph>.onnx`` for every model; the large tensors of the graphs named in ``shared``
    go once each into ``<folder>/SHARED_WEIGHTS``. The models passed in are left as they are. Returns
    ``package.json: weights`` (the file, the graphs that read it, its tensors and bytes), or {} when no
    graph shares."""
    shared = [g for g in shared if g in models]
    offsets: dict[str, tuple[int, int]] = {}  # sha256 -> (offset, length)
    size = 0
    if shared:
        with open(folder / SHARED_WEIGHTS, "wb") as data:
            for g in shared:
                m = onnx.ModelProto()
                m.CopyFrom(models[g])
                for t in m.graph.initializer:
                    raw = b"" if t.data_location == onnx.TensorProto.EXTERNAL else _raw(t)
                    if len(raw) < MIN_BYTES:  # small, or external already
                        continue
                    key = hashlib.sha256(raw).hexdigest()
                    if key not in offsets:
                        pad = (-size) % ALIGN
                        data.write(b"\0" * pad)
                        offsets[key] = (size + pad, len(raw))
                        data.write(raw)
                        size += pad + len(raw)
                    offset, length = offsets[key]
                    for field in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data",
                                  "string_data"):
                        t.ClearField(field)
                    t.data_location = onnx.TensorProto.EXTERNAL
                    del t.external_data[:]
                    for k, v in (("location", SHARED_WEIGHTS), ("offset", str(offset)), ("length", str(length))):
                        entry = t.external_data.add()
                        entry.key, entry.value = k, v
                onnx.save(m, str(folder / f"{g}.onnx"))
    for g, m in models.items():
        if g not in shared:
            onnx.save(m, str(folder / f"{g}.onnx"))
    if not shared:
        return {}
    return {"file": SHARED_WEIGHTS, "graphs": shared, "tensors": len(offsets), "bytes": size}
