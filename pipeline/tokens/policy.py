"""The token policy: the patches that hold ink, their neighbours, and a coarse grid of real background
patches that keeps the frame (where the formula sits, where it ends), padded up to a size bucket.

Computed from the preprocessed image alone (numpy, no torch: a package's runtime imports it, and a runtime
of its own can load this file alone). A patch
token of the default model is conv(patch) + its learned position embedding: keeping a patch is a gather
of its index, and a batch needs no mask, since a shorter row is topped up with more of its own real
patches (the next ones in its ranking) to the batch's bucket. Buckets keep the shapes few (TensorRT
profiles, ONNX Runtime's memory planner). Indices are computed once on the host and passed as the
encoder's ``keep`` input: no data-dependent shapes inside a graph.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Sequence

import numpy as np

try:  # the project's error (one line, exit 2); loaded by file path where only numpy is (the MacaRT stand-in)
    from pipeline.errors import PipelineError
except ImportError:  # pragma: no cover - exercised in the ONNX Runtime 1.12 venv
    PipelineError = ValueError

KIND = "ink"
INK_BELOW = 250 / 255  # a pixel darker than this grey level (0 black .. 1 white) is ink (pipeline/data/render.py)

# a patch's rank, the order tokens are kept in (ties by index): ink first, the frame before filler
INK, NEIGHBOUR, FRAME, FILL, REST = range(5)


@dataclass(frozen=True)
class TokenPolicy:
    """Which of a [grid_h x grid_w] patch grid's tokens an image keeps (``package.json: token_policy``)."""
    grid_h: int                      # patch rows and columns of the model's input
    grid_w: int
    patch: int                       # pixels a patch side
    ink_below: float = INK_BELOW     # a patch holding a pixel darker than this (preprocessed scale) holds ink
    dilate: int = 1                  # ink patches' neighbours kept, this many patches around (Chebyshev)
    frame_stride: int = 4            # plus every frame_stride-th patch of rows and columns (0: none)
    buckets: tuple[int, ...] = field(default=(128, 256, 384, 1024))  # kept counts, padded up; smallest = floor
    kind: str = KIND
    # from encoder layer ``narrow_from`` on (0: never) the last ``narrow_by`` kept tokens (by rank: filler) skip
    # the layers and join the memory as they were; an image's bucket holds its ink, neighbours and frame
    # without them
    narrow_from: int = 0
    narrow_by: int = 0
    # proportional attention (ToMe's): in the encoder's attention a kept patch weighs as many patches as it stands
    # for, itself and the dropped ones nearest it (``pipeline.adapters.attention.stand_for``), a bias log(count)
    # on its key; computed inside the exported encoder from ``keep``, so a runtime passes nothing more
    proportional: bool = False

    def __post_init__(self) -> None:
        n = self.grid_h * self.grid_w
        if self.kind != KIND:
            raise PipelineError(f"token policy kind {self.kind!r}: known kinds: {KIND}")
        if min(self.grid_h, self.grid_w, self.patch) < 1:
            raise PipelineError(f"token policy: grid {self.grid_h}x{self.grid_w}, patch {self.patch}: each must be >= 1")
        if self.dilate < 0 or self.frame_stride < 0:
            raise PipelineError(f"token policy: dilate={self.dilate}, frame_stride={self.frame_stride} must be >= 0")
        b = list(self.buckets)
        if not b or b != sorted(set(b)) or b[0] < 1 or b[-1] > n:
            raise PipelineError(f"token policy: buckets {b} must rise strictly, within 1..{n} (the image's patches)")
        if self.narrow_from < 0 or self.narrow_by < 0 or (self.narrow_from > 0) != (self.narrow_by > 0):
            raise PipelineError(f"token policy: narrow_from={self.narrow_from}, narrow_by={self.narrow_by}: both "
                                f"0 (no narrowing) or both >= 1")
        if self.proportional and self.narrows:
            raise PipelineError("token policy: proportional attention and narrowing do not go together (the narrowed "
                                "layers would read counts of tokens they do not see)")
        if self.narrow_by >= b[0]:
            raise PipelineError(f"token policy: narrow_by={self.narrow_by} must be below the smallest bucket {b[0]}")
        object.__setattr__(self, "buckets", tuple(int(x) for x in b))

    @property
    def num_patches(self) -> int:
        return self.grid_h * self.grid_w

    @property
    def narrows(self) -> bool:
        return self.narrow_from > 0

    def narrowed(self, kept):
        """Tokens the layers from ``narrow_from`` on read of ``kept`` (arithmetic only: a traced token count
        stays symbolic in an exported graph)."""
        return kept - self.narrow_by

    def to_dict(self) -> dict:
        out = {**asdict(self), "buckets": list(self.buckets)}
        if not self.proportional:  # the settings as they were before the option
            out.pop("proportional")
        return out

    @classmethod
    def from_dict(cls, spec: dict, where: str = "token_policy") -> "TokenPolicy":
        try:
            return cls(**{**spec, "buckets": tuple(spec.get("buckets", cls.__dataclass_fields__["buckets"].default))})
        except TypeError as exc:
            raise PipelineError(f"{where}: {exc}") from None

    # ---- one image -----------------------------------------------------------------------------
    def ranks(self, image: np.ndarray) -> np.ndarray:
        """Each patch's rank (INK ... REST), row-major over the grid, from a preprocessed [C, H, W] image."""
        c, h, w = image.shape
        if (h, w) != (self.grid_h * self.patch, self.grid_w * self.patch):
            raise PipelineError(f"token policy: image {h}x{w} px is not the policy's {self.grid_h}x{self.grid_w} "
                                f"patches of {self.patch} px")
        darkest = image.min(axis=0).reshape(self.grid_h, self.patch, self.grid_w, self.patch).min(axis=(1, 3))
        ink = darkest < self.ink_below
        rank = np.full((self.grid_h, self.grid_w), REST, dtype=np.int8)
        fill = _lattice(self.grid_h, self.grid_w, max(1, self.frame_stride // 2)) if self.frame_stride > 1 \
            else np.zeros_like(ink)
        rank[fill] = FILL
        if self.frame_stride:
            rank[_lattice(self.grid_h, self.grid_w, self.frame_stride)] = FRAME
        rank[_dilated(ink, self.dilate) & ~ink] = NEIGHBOUR
        rank[ink] = INK
        return rank.reshape(-1)

    def count(self, ranks: np.ndarray) -> int:
        """Tokens an image keeps: its ink, neighbours and frame (besides the filler a narrowing lets skip), up to the
        next bucket (the smallest one at least: the floor; the largest at most: the cap)."""
        wanted = int((ranks <= FRAME).sum()) + self.narrow_by
        return next((b for b in self.buckets if b >= wanted), self.buckets[-1])

    def keep(self, image: np.ndarray) -> np.ndarray:
        """The kept patch indices of one preprocessed image (int64): ascending, or by rank (ink first) where
        the policy narrows (the encoder's later layers read the first of them)."""
        ranks = self.ranks(image)
        return _first(ranks, self.count(ranks), self.narrows)

    # ---- a batch ---------------------------------------------------------------------------------
    def keep_batch(self, images: np.ndarray) -> np.ndarray:
        """[B, K] kept indices of a batch [B, C, H, W]: K the largest count among its images; a row that
        keeps fewer is topped up with its own next-ranked real patches (no padding mask anywhere)."""
        ranks = [self.ranks(im) for im in images]
        k = max((self.count(r) for r in ranks), default=self.buckets[0])
        return np.stack([_first(r, k, self.narrows) for r in ranks]) if ranks else np.zeros((0, k), np.int64)

    def batches_by_bucket(self, images: np.ndarray, order: Sequence[int], batch: int) -> list[int]:
        """``order`` rearranged so that each run of ``batch`` indices holds images of one bucket: a training
        batch then reads each image with the tokens it keeps alone (batch 1's reading), not topped up to
        the batch's largest bucket. A bucket's last short batch is filled with its own first images;
        batches follow each other as their first image came in ``order`` (seeded order in, same out)."""
        keys = [self.count(self.ranks(images[i])) for i in order]
        members = {key: [i for i, k in zip(order, keys) if k == key] for key in set(keys)}
        out = []
        for run in grouped_batches(keys, batch):
            own = members[keys[run[0]]]
            out += [order[j] for j in run] + [own[j % len(own)] for j in range(batch - len(run))]
        return out

    def check(self, keep: np.ndarray, batch: int) -> None:
        """One error line for indices that do not fit this policy's image (or the batch)."""
        keep = np.asarray(keep)
        if keep.ndim != 2 or keep.shape[0] != batch or keep.shape[1] < 1:
            raise PipelineError(f"token indices of shape {list(keep.shape)} do not fit a batch of {batch} images "
                                f"([batch, tokens], at least one token)")
        if keep.size and (keep.min() < 0 or keep.max() >= self.num_patches):
            raise PipelineError(f"token indices {int(keep.min())}..{int(keep.max())} outside the image's "
                                f"{self.num_patches} patches")


def _first(ranks: np.ndarray, k: int, by_rank: bool = False) -> np.ndarray:
    """The ``k`` best-ranked patches (by rank, then index), in that order or ascending."""
    first = np.lexsort((np.arange(ranks.size), ranks))[:k]
    return (first if by_rank else np.sort(first)).astype(np.int64)


def reading_batches(images, batch: int, policy: "TokenPolicy | None" = None) -> list[list[int]]:
    """Index batches of at most ``batch`` of ``images`` (preprocessed, or anything with a length without a
    policy) for a reading. With a token policy each batch holds one bucket: every image reads the tokens it
    keeps alone, whatever else came with it, so a reading does not depend on its batch (a batch topped up
    to its largest bucket read the shift split 4 points worse). Batches follow each other as their first
    image came; without a policy, consecutive."""
    if policy is None:
        return [list(range(s, min(s + batch, len(images)))) for s in range(0, len(images), batch)]
    return grouped_batches([policy.count(policy.ranks(im)) for im in images], batch)


def grouped_batches(keys: Sequence, batch: int) -> list[list[int]]:
    """Indices ``0..len(keys)-1`` cut into batches of at most ``batch`` that each hold one key, in the
    order of their first index (all keys equal: plain consecutive batches)."""
    groups: dict = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    runs = [m[j:j + batch] for m in groups.values() for j in range(0, len(m), batch)]
    return sorted(runs, key=lambda run: run[0])


def _lattice(h: int, w: int, stride: int) -> np.ndarray:
    """Every ``stride``-th row and column, centred (offset stride // 2): [h, w] bool."""
    mask = np.zeros((h, w), dtype=bool)
    mask[stride // 2::stride, stride // 2::stride] = True
    return mask


def _dilated(mask: np.ndarray, radius: int) -> np.ndarray:
    """``mask`` grown by ``radius`` patches in every direction (a (2r+1)^2 square)."""
    if radius <= 0 or not mask.any():
        return mask.copy()
    h, w = mask.shape
    padded = np.pad(mask, radius)
    out = np.zeros_like(mask)
    for dy in range(2 * radius + 1):
        for dx in range(2 * radius + 1):
            out |= padded[dy:dy + h, dx:dx + w]
    return out


def for_grid(grid_h: int, grid_w: int, patch: int, settings: dict | None = None) -> TokenPolicy:
    """The policy for a model's patch grid with ``settings`` (dilate, frame_stride, buckets, ink_below);
    a bucket past the image's patches is cut to them."""
    settings = dict(settings or {})
    n = grid_h * grid_w
    if "buckets" in settings:
        settings["buckets"] = tuple(sorted({min(int(b), n) for b in settings["buckets"]}))
    return TokenPolicy(grid_h=grid_h, grid_w=grid_w, patch=patch, **settings)


def stats(counts: Sequence[int], num_patches: int) -> dict:
    """Tokens kept per image: mean, p95, share of the image's patches."""
    arr = np.asarray(list(counts), dtype=np.float64)
    if not arr.size:
        return {"mean": 0.0, "p95": 0.0, "share": 0.0, "n": 0}
    return {"mean": float(arr.mean()), "p95": float(np.percentile(arr, 95)), "share": float(arr.mean() / num_patches),
            "n": int(arr.size)}
