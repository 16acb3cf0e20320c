"""Serving-side encoding: an LRU cache keyed by the normalized formula, with hit/miss counters.

Requests repeat (the same formula, often spelled differently: ``$x^2$``, ``x^2`` with other spaces),
so the key is the tokenizer's own normalized form: every spelling the tokenizer would encode the
same way shares one entry. The normalizer runs in Rust (a few microseconds); on a hit nothing else
runs. Cached ids are tuples, so a caller cannot change what the next caller gets.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0

    @property
    def requests(self) -> int:
        return self.hits + self.misses

    @property
    def hit_rate(self) -> float:
        return self.hits / self.requests if self.requests else 0.0


class CachedEncoder:
    """``encode(latex) -> tuple of ids`` (bos ... eos) through an LRU cache of ``capacity`` formulas."""

    def __init__(self, tokenizer: Tokenizer, capacity: int = 4096, key: str = "normalized"):
        if capacity < 1:
            raise ValueError(f"cache capacity must be at least 1, got {capacity}")
        if key not in ("normalized", "raw"):
            raise ValueError(f"cache key must be 'normalized' or 'raw', got {key!r}")
        self.tokenizer = tokenizer
        self.capacity = capacity
        self.stats = CacheStats()
        self._cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        normalizer = tokenizer.normalizer
        # "raw" keys by the request string itself: the baseline the report compares against
        self._key = normalizer.normalize_str if (key == "normalized" and normalizer is not None) else str

    @classmethod
    def from_file(cls, path: str | Path, capacity: int = 4096) -> "CachedEncoder":
        return cls(Tokenizer.from_file(str(path)), capacity)

    def encode(self, latex: str) -> tuple[int, ...]:
        key = self._key(latex)
        ids = self._cache.get(key)
        if ids is not None:
            self._cache.move_to_end(key)
            self.stats.hits += 1
            return ids
        self.stats.misses += 1
        # encode the request itself: its ids depend only on its normalized form, which is the key
        ids = tuple(self.tokenizer.encode(latex).ids)
        self._cache[key] = ids
        if len(self._cache) > self.capacity:
            self._cache.popitem(last=False)
            self.stats.evictions += 1
        return ids

    def __len__(self) -> int:
        return len(self._cache)

    def clear(self) -> None:
        self._cache.clear()
        self.stats = CacheStats()
