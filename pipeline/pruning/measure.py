"""What stage prune's table shows for one model: size, encoder cost, accuracy on each split, and
whether a pruned model holds against the original (exact match and CER within the tolerances)."""
from __future__ import annotations

import torch

from pipeline.device import placed
from pipeline.evaluation import EvalItem, evaluate_items
from pipeline.pruning import count


def measure(adapter, items: dict[str, list[EvalItem]], max_length: int, batch_size: int, latency_images: int,
            use_cache: bool, device, progress: bool, desc: str) -> dict:
    """Size, encoder cost and accuracy on every split of ``items``; the first split's accuracy also on
    top; the encoder's batch-1 milliseconds on its first ``latency_images`` images. The torch reading
    runs on ``device`` (``model.device``)."""
    splits = {}
    for split, split_items in items.items():
        with placed(device, adapter):
            r = evaluate_items(adapter, split_items, max_length, batch_size, image_match=False,
                               progress=progress, desc=f"decode {desc} ({split})", use_cache=use_cache)["metrics"]
        splits[split] = {"n": r["n"], "exact_match": r["exact_match"], "cer": r["cer"], "bleu": r["bleu"],
                         "hit_cap_share": r["hit_cap_share"]}
    first = next(iter(items.values()))
    k = min(latency_images, len(first))
    lat = count.encoder_latency_ms(adapter, torch.stack([it.image for it in first[:k]])) if k else float("nan")
    return {
        "params": count.parameters(adapter),
        "attention_params": count.attention_parameters(adapter),
        "encoder_gflops": count.encoder_flops(adapter) / 1e9,
        "encoder_ms_batch1": lat,
        **{key: next(iter(splits.values()))[key] for key in ("exact_match", "cer", "bleu", "hit_cap_share")},
        "splits": splits,
        "encoder_heads": adapter.encoder_head_counts(),
        **({"encoder_mlp": adapter.encoder_mlp_widths()} if adapter.narrows_mlp() else {}),
    }


def holds(pruned: dict, original: dict, em_tolerance: float, cer_tolerance: float) -> dict:
    """Whether the pruned model stays within the tolerances of the original on one split: exact match at
    most ``em_tolerance`` below, CER at most ``cer_tolerance`` higher (relative)."""
    em_drop = original["exact_match"] - pruned["exact_match"]
    cer_rel = pruned["cer"] / original["cer"] - 1 if original["cer"] else float(pruned["cer"] > 0)
    return {"n": pruned["n"], "exact_match": pruned["exact_match"], "exact_match_original": original["exact_match"],
            "cer": pruned["cer"], "cer_original": original["cer"], "exact_match_drop": em_drop,
            "cer_relative_change": cer_rel,
            "holds": em_drop <= em_tolerance + 1e-12 and cer_rel <= cer_tolerance + 1e-12}


def verdict(variants: dict[str, dict], em_tolerance: float, cer_tolerance: float) -> dict:
    """The pruned model's figures against the original's (``variants``: the table's rows, the pruned
    model's being ``pruned, after recovery`` or, without a recovery, ``pruned, before recovery``):
    whether it holds on each split and on all, its exact match, CER and encoder GFLOPs beside the
    original's, and the share of encoder FLOPs it saves."""
    final = variants.get("pruned, after recovery") or variants["pruned, before recovery"]
    original = variants["original"]
    splits = {split: holds(final["splits"][split], original["splits"][split], em_tolerance, cer_tolerance)
              for split in final["splits"]}
    return {"splits": splits, "holds_on_every_split": all(v["holds"] for v in splits.values()),
            "exact_match": final["exact_match"], "cer": final["cer"],
            "exact_match_original": original["exact_match"],
            "encoder_gflops": final["encoder_gflops"], "encoder_gflops_original": original["encoder_gflops"],
            "flops_reduction": 1 - final["encoder_gflops"] / original["encoder_gflops"]}
