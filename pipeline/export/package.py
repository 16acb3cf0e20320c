"""Write an exported package folder: the graphs build.py made for a target, package.json (I/O
names, shapes, decoding), the tokenizer, preprocessing and provider options."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from pipeline.errors import PipelineError
from pipeline.export.build import BuiltGraphs, decoder_shapes
from pipeline.export.graphs import VERIFY_WIDTH
from pipeline.export.onnx_graphs import graph_io
from pipeline.export.runtime import PACKAGE_META, PREPROCESS, TOKENIZER, package_format, session_config
from pipeline.export.targets import Target
from pipeline.export.weights import save_graphs
from pipeline.names import DECODER_VERIFY


def write_package(folder: Path, adapter, built: BuiltGraphs, target: Target, max_length: int,
                  flush_denormals: bool = True) -> dict[str, Any]:
    """The files a deployment engineer ships; returns ``package.json``'s content. ``flush_denormals``
    (model.flush_denormals): recorded in ``session_config``, the ONNX Runtime session entries a runtime
    reads the package with."""
    shapes = decoder_shapes(adapter)
    nl = shapes["num_layers"]
    # the decoder's three graphs (first, step, verify) read one copy of its weights
    weights = save_graphs(built.models, folder, shared=[g for g in built.models if g.startswith("decoder")])
    graphs = {g: f"{g}.onnx" for g in built.models}
    shutil.copyfile(adapter.tokenizer_path, folder / TOKENIZER)
    (folder / PREPROCESS).write_text(json.dumps(adapter.preprocess_spec(), indent=2) + "\n")
    meta = {
        "format": package_format(adapter.token_policy is not None),
        "target": target.name, "provider": target.provider, "provider_options": target.provider_options,
        "graphs": graphs, **({"weights": weights} if weights else {}), "io": graph_io(nl, adapter.token_policy is not None), "precision": built.precision,
        "opset": target.opset, "ir_version": {g: int(m.ir_version) for g, m in built.models.items()},
        # the char vocabulary, or the formula BPE (HF tokenizers JSON) of a decoder from stage distill
        # (hf: any HF tokenizers JSON, read with the ids below)
        "tokenizer": {"file": TOKENIZER, "kind": adapter.tokenizer_kind()},
        "bos_id": adapter.bos_id, "eos_id": adapter.eos_id, "pad_id": adapter.pad_id,
        "banned_token_ids": adapter.banned_token_ids(), "max_length": int(max_length),
        "max_positions": adapter.max_positions or int(max_length),  # the decoder position table
        # tokens a decoder_verify call reads at most (batch 1; speculative decoding, pipeline/decoding.py)
        **({"verify_width": VERIFY_WIDTH} if DECODER_VERIFY in built.models else {}),
        **shapes,
        "input_shape": list(adapter.input_shape), "model_family": adapter.family,
        # greedy decoding's cap on runs of layout-only LaTeX (pipeline/decoding.py; 0 = none)
        "layout_run_cap": int(adapter.layout_run_cap),
        # the patch tokens the encoder reads: the runtime computes the kept indices from the preprocessed image
        # with this policy (pipeline/tokens/policy.py) and feeds them as the encoder's "keep" input
        **({"token_policy": adapter.token_policy.to_dict()} if adapter.token_policy is not None else {}),
        # ONNX Runtime session config entries to read it with (MacaRT too): denormals flushed to zero
        # (same readings, the encoder's softmax tails 100x cheaper on x86), pools that do not spin
        "session_config": session_config(flush_denormals),
        "decoding": "greedy; decoder_first(BOS, memory) then decoder_step per token with the present K/V fed "
                    "back as past; pad and BOS logits set to -inf; stop at EOS or max_length tokens incl. BOS; "
                    "where layout_run_cap > 0, a token that would make the reading end in more than that many "
                    "layout-only atoms (spacing, &, \\\\, style switches) gives way to the best one that does not",
    }
    (folder / PACKAGE_META).write_text(json.dumps(meta, indent=2) + "\n")
    missing = [k for k in target.required_provider_options if k not in target.provider_options]
    if missing:
        raise PipelineError(f"target.provider_options for {target.name} lacks {missing}")
    (folder / "provider_options.json").write_text(json.dumps(
        {"provider": target.provider, "options": target.provider_options}, indent=2) + "\n")
    return meta
