"""torch -> ONNX: the wrappers of graphs.py traced into the encoder and decoder graphs, with their
input and output names and dynamic axes. What happens to them next is build.py's."""
from __future__ import annotations

import io
import warnings

import onnx
import torch

from pipeline.errors import PipelineError
from pipeline.export.graphs import (VERIFY_WIDTH, DecoderFirstGraph, DecoderStepGraph, DecoderVerifyGraph, EncoderGraph,
                                    KeptEncoderGraph, io_names)
from pipeline.names import DECODER_FIRST, DECODER_STEP, DECODER_VERIFY, ENCODER

KEEP = "keep"  # the encoder's kept patch indices [B, K] where the model has a token policy


def graph_io(num_layers: int, kept_tokens: bool = False) -> dict[str, dict[str, list[str]]]:
    """Input and output names of each graph (the runner and the TensorRT profiles read these);
    ``kept_tokens``: the encoder also takes the kept patch indices."""
    n = io_names(num_layers)
    return {
        ENCODER: {"inputs": ["images", KEEP] if kept_tokens else ["images"], "outputs": ["memory"]},
        DECODER_FIRST: {"inputs": ["input_ids", "memory"], "outputs": ["logits", *n["present"], *n["cross"]]},
        DECODER_STEP: {"inputs": ["input_ids", *n["past"], *n["cross"]], "outputs": ["logits", *n["present"]]},
        # speculative decoding's check of T drafted tokens: logits [B, T, V]
        DECODER_VERIFY: {"inputs": ["input_ids", *n["past"], *n["cross"]], "outputs": ["logits", *n["present"]]},
    }


def _to_model(module: torch.nn.Module, args: tuple, names: dict[str, list[str]], dynamic: dict, opset: int
              ) -> onnx.ModelProto:
    buf = io.BytesIO()
    module.eval()  # a fresh wrapper is in train mode: dropout on
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # the TorchScript exporter with dynamic_axes writes opset 17 directly (no down-conversion)
        torch.onnx.export(module, args, buf, dynamo=False, opset_version=opset, do_constant_folding=True,
                          input_names=names["inputs"], output_names=names["outputs"], dynamic_axes=dynamic)
    return onnx.load_from_string(buf.getvalue())


def export_graphs(adapter, opset: int) -> dict[str, onnx.ModelProto]:
    """Encoder, decoder first step, decoder step with past K/V and the verify graph (T tokens after a
    past, logits after each); dynamic batch and sequence axes.

    The decoder graphs wrap the adapter's KV-cached decoder (``ModelAdapter.cached_decoder``)."""
    adapter.model.eval()
    cached = adapter.cached_decoder()
    if cached is None:
        raise PipelineError(f"model family {adapter.family!r} has no KV-cached decoder to export")
    cached = cached.eval()
    nl = int(cached.num_layers)
    policy = adapter.token_policy
    io = graph_io(nl, policy is not None)
    n = io_names(nl)
    images = torch.rand(2, *adapter.input_shape)
    with torch.no_grad():
        memory = adapter.encode(images)
    if policy is None:
        graphs = {ENCODER: _to_model(EncoderGraph(adapter), (images,), io[ENCODER],
                                     {"images": {0: "batch"}, "memory": {0: "batch"}}, opset)}
    else:  # traced with a count that is no bucket, so no size is baked in
        k = next(c for c in (policy.buckets[0] + 3, *range(policy.num_patches - 1, 1, -1))
                 if c <= policy.num_patches and c not in policy.buckets)  # within the image's patches
        keep = torch.stack([torch.arange(k) * (policy.num_patches // k), torch.arange(k)])
        graphs = {ENCODER: _to_model(KeptEncoderGraph(adapter), (images, keep), io[ENCODER],
                                     {"images": {0: "batch"}, KEEP: {0: "batch", 1: "tokens"},
                                      "memory": {0: "batch", 1: "tokens"}}, opset)}
    first = DecoderFirstGraph(cached).eval()
    ids = torch.tensor([[adapter.bos_id, 5, 6], [adapter.bos_id, 7, 7]], dtype=torch.long)
    dyn = {"input_ids": {0: "batch", 1: "seq"}, "memory": {0: "batch", 1: "mem_len"}, "logits": {0: "batch"}}
    dyn.update({k: {0: "batch", 2: "seq"} for k in n["present"]})
    dyn.update({k: {0: "batch", 2: "mem_len"} for k in n["cross"]})
    graphs[DECODER_FIRST] = _to_model(first, (ids, memory), io[DECODER_FIRST], dyn, opset)
    with torch.no_grad():
        kv = first(ids, memory)[1:]
    dyn = {"input_ids": {0: "batch"}, "logits": {0: "batch"}}
    dyn.update({k: {0: "batch", 2: "past_len"} for k in n["past"]})
    dyn.update({k: {0: "batch", 2: "total_len"} for k in n["present"]})
    dyn.update({k: {0: "batch", 2: "mem_len"} for k in n["cross"]})
    step_ids = torch.tensor([[9], [10]], dtype=torch.long)
    graphs[DECODER_STEP] = _to_model(DecoderStepGraph(cached).eval(), (step_ids, *kv), io[DECODER_STEP], dyn, opset)
    # batch 1, fixed; the width (tokens checked, at most VERIFY_WIDTH), the past's length and the memory's dynamic
    dyn = {k: {2: "past_len"} for k in n["past"]}
    dyn.update({"input_ids": {1: "width"}, "logits": {1: "width"}})
    dyn.update({k: {2: "total_len"} for k in n["present"]})
    dyn.update({k: {2: "mem_len"} for k in n["cross"]})
    verify_ids = (torch.arange(VERIFY_WIDTH, dtype=torch.long) % 7 + 4)[None]
    graphs[DECODER_VERIFY] = _to_model(DecoderVerifyGraph(cached).eval(), (verify_ids, *[t[:1] for t in kv]),
                                       io[DECODER_VERIFY], dyn, opset)
    return graphs
