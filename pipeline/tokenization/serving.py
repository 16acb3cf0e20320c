"""Serving-side encoding: an LRU cache keyed by the normalized formula, with hit/miss counters.

Requests repeat (the same formula, often spelled differently: ``$x^2$``, ``x^2`` with other spaces),
so the key is the tokenizer's own normalized form: every spelling the tokenizer would encode the
same way shares one entry. Normalizing costs a few microseconds (four regex passes in Rust plus the
Python call), more than the lookup itself, so a bounded memo maps request strings seen before to
their key and a repeated request costs two dictionary lookups. Cached ids are tuples, so a caller
cannot change what the next caller gets.
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
        self._keys: dict[str, str] = {}  # request string -> normalized key, oldest dropped first
        normalizer = tokenizer.normalizer
        # "raw" keys by the request string itself: the baseline the report compares against
        self._normalize = normalizer.normalize_str if (key == "normalized" and normalizer is not None) else None

    @classmethod
    def from_file(cls, path: str | Path, capacity: int = 4096) -> "CachedEncoder":
        return cls(Tokenizer.from_file(str(path)), capacity)

    def key(self, latex: str) -> str:
        if self._normalize is None:
            return latex
        key = self._keys.get(latex)
        if key is None:
            key = self._keys[latex] = self._normalize(latex)
            if len(self._keys) > 4 * self.capacity:  # spellings per formula are few; bound the memo
                del self._keys[next(iter(self._keys))]
        return key

    def encode(self, latex: str) -> tuple[int, ...]:
        key = self.key(latex)
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
        self._keys.clear()
        self.stats = CacheStats()
