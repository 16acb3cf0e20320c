"""Which heads go: the lowest-scored ones, globally, keeping ``min_heads_per_layer`` in each layer."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np


NORMALIZE = ("layer", "global")


def normalized(scores: Sequence[Sequence[float]], how: str) -> list[list[float]]:
    """``layer``: each layer's scores divided by their L2 norm (Michel et al.), so layers with large
    weights do not keep all their heads; ``global``: the raw scores compared across layers."""
    if how not in NORMALIZE:
        raise ValueError(f"normalize must be one of {', '.join(NORMALIZE)}, got {how!r}")
    if how == "global":
        return [list(map(float, s)) for s in scores]
    out = []
    for s in scores:
        a = np.asarray(s, dtype=float)
        norm = float(np.sqrt((a ** 2).sum()))
        out.append((a / norm if norm > 0 else a).tolist())
    return out


def removable(head_counts: Sequence[int], min_per_layer: int) -> int:
    return sum(max(0, h - min_per_layer) for h in head_counts)


def select_heads(scores: Sequence[Sequence[float]], n_remove: int, min_per_layer: int = 1,
                 normalize: str = "layer") -> dict[int, list[int]]:
    """The ``n_remove`` lowest-scored heads, never leaving a layer under ``min_per_layer`` heads.

    Ties break by (layer, head) so the choice is deterministic."""
    counts = [len(s) for s in scores]
    if min_per_layer < 1:
        raise ValueError(f"min_per_layer must be at least 1 (a layer without heads is not attention any "
                         f"more), got {min_per_layer}")
    if n_remove < 0:
        raise ValueError(f"cannot remove a negative number of heads ({n_remove})")
    limit = removable(counts, min_per_layer)
    if n_remove > limit:
        raise ValueError(f"removing {n_remove} of {sum(counts)} heads would leave a layer with fewer than "
                         f"{min_per_layer} head(s); at most {limit} can go")
    norm = normalized(scores, normalize)
    order = sorted((s, layer, h) for layer, row in enumerate(norm) for h, s in enumerate(row))
    left = list(counts)
    chosen: dict[int, list[int]] = {}
    for _, layer, h in order:
        if sum(len(v) for v in chosen.values()) == n_remove:
            break
        if left[layer] - 1 >= min_per_layer:
            chosen.setdefault(layer, []).append(h)
            left[layer] -= 1
    return {layer: sorted(hs) for layer, hs in sorted(chosen.items())}


def heads_for_ratio(head_counts: Sequence[int], ratio: float) -> int:
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"ratio must be in [0, 1), got {ratio}")
    return int(round(ratio * sum(head_counts)))


def heads_for_flops(reduction: float, flops_full: float, flops_per_head: float, head_counts: Sequence[int],
                    min_per_layer: int) -> int:
    """Fewest heads whose removal cuts encoder FLOPs by ``reduction`` (FLOPs are linear in heads)."""
    if not 0.0 <= reduction < 1.0:
        raise ValueError(f"reduction must be in [0, 1), got {reduction}")
    n = math.ceil(reduction * flops_full / flops_per_head - 1e-9) if reduction > 0 else 0
    limit = removable(head_counts, min_per_layer)
    if n > limit:
        best = limit * flops_per_head / flops_full
        raise ValueError(f"a {reduction} reduction needs {n} heads removed, which would leave a layer with "
                         f"fewer than {min_per_layer} head(s); removing heads can cut at most {best:.1%} of "
                         f"encoder FLOPs here")
    return n


def heads_to_remove(head_counts: Sequence[int], min_per_layer: int, ratio: float, num_heads: int | None = None,
                    flops_reduction: float | None = None, flops_full: float = 0.0, flops_per_head: float = 0.0
                    ) -> int:
    """How many heads go: the fewest for ``flops_reduction`` if set, else ``num_heads``, else ``ratio`` of
    them; more than leave ``min_per_layer`` in every layer is a ``ValueError`` with the numbers."""
    if flops_reduction is not None:
        return heads_for_flops(flops_reduction, flops_full, flops_per_head, head_counts, min_per_layer)
    n = num_heads if num_heads is not None else heads_for_ratio(head_counts, ratio)
    limit = removable(head_counts, min_per_layer)
    if n > limit:
        raise ValueError(f"removing {n} of {sum(head_counts)} heads would leave a layer with fewer than "
                         f"{min_per_layer} head(s); at most {limit} can go")
    return n
