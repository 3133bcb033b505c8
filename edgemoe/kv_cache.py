"""KV cache of one sequence: per layer, keys [K, L, Dk] and values [K, L, Dv], grown by doubling
(K kv heads, Dk = Dv = Dh; multi-head latent attention keeps one row of Dk = Ckv + R a position and
no values: ModelSpec.cache_layout).

A forward step writes each layer's new keys/values at positions [length, length + S) and reads
[0, length + S); the model then advances `length` once, after the last layer. The cache holds them
in `dtype` (float32, or bfloat16: half the bytes a decode step reads, rounded to nearest even on
the way in) and gives them back in the dtype of the keys and values appended. `fork` copies a
sequence (beams), `truncate` rolls it back (rejected speculative tokens).
"""

from __future__ import annotations

import numpy as np
import torch

from .kernels.views import address

# The KV cache's element types (load(kv_dtype=...), --kv-dtype). float32 is the default: bfloat16
# halves the cache's memory and moves the bundled model's perplexity by -0.02% token by token, but
# it decodes slower at 512 cached positions than float32 here and faster only from about 2048
# (docs/benchmarks.md), and its coarser rounding turns the last-bit differences between expert
# compute paths into different greedy tokens more often.
KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", capacity: int = 64, value_dim: int | None = None,
                 limit: int | None = None):
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        # Positions no sequence of this cache goes past (the context it is served at): growing stops
        # there rather than doubling past it, which would hold up to twice the context's bytes.
        self.limit = limit
        capacity = capacity if limit is None else max(1, min(capacity, limit))
        self.value_dim = head_dim if value_dim is None else value_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.length = 0
        self._k: list[torch.Tensor] = [self._empty(capacity, head_dim) for _ in range(num_layers)]
        self._v: list[torch.Tensor] = [self._empty(capacity, self.value_dim) for _ in range(num_layers)]
        self._addresses: tuple[np.ndarray, np.ndarray] | None = None   # layer_addresses', until _grow

    @classmethod
    def for_spec(cls, spec, dtype: torch.dtype = torch.float32, capacity: int = 64,
                 limit: int | None = None) -> "KVCache":
        """A cache in the layout the model's attention kind keeps (ModelSpec.cache_layout)."""
        heads, key_dim, value_dim = spec.cache_layout
        return cls(spec.num_layers, heads, key_dim, dtype, capacity=capacity, value_dim=value_dim, limit=limit)

    def _empty(self, capacity: int, dim: int) -> torch.Tensor:
        return torch.empty(self.num_kv_heads, capacity, dim, dtype=self.dtype, device=self.device)

    @property
    def capacity(self) -> int:
        return self._k[0].shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes its arrays hold, every layer's keys and values."""
        return sum(t.nbytes for t in self._k + self._v)

    def growth_to(self, length: int) -> int:
        """Bytes this cache will still allocate to hold `length` positions, as _grow grows it: the
        final arrays' growth over today's, plus one layer's old arrays, alive while they are copied."""
        capacity = final = previous = max(self.capacity, 1)
        while final < length:     # one position a step: each growth doubles, up to the limit
            previous, final = final, self._grown(final, final + 1)
        per_position = self.num_layers * self.num_kv_heads * (self.head_dim + self.value_dim) * self.dtype.itemsize
        copying = per_position // self.num_layers * previous if final > capacity else 0
        return per_position * (final - capacity) + copying

    def _grown(self, capacity: int, needed: int) -> int:
        """The capacity a layer's arrays of `capacity` positions grow to, to hold `needed`: doubled, but
        not past the limit while `needed` is within it."""
        doubled = max(needed, 2 * capacity)
        return doubled if self.limit is None or needed > self.limit else min(doubled, self.limit)

    def _grow(self, layer: int, needed: int) -> None:
        self._addresses = None
        capacity = self._grown(self._k[layer].shape[1], needed)
        for store, dim in ((self._k, self.head_dim), (self._v, self.value_dim)):
            bigger = self._empty(capacity, dim)
            bigger[:, :self.length] = store[layer][:, :self.length]
            store[layer] = bigger

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k [K, S, Dk], v [K, S, Dv] after the cached positions; return all keys and values
        [K, length+S, Dk / Dv]."""
        end = self.length + k.shape[1]
        if end > self._k[layer].shape[1]:
            self._grow(layer, end)
        self._k[layer][:, self.length:end] = k
        self._v[layer][:, self.length:end] = v
        return self._k[layer][:, :end].to(k.dtype), self._v[layer][:, :end].to(v.dtype)

    def layer_arrays(self, layer: int, end: int):
        """numpy views of layer's keys [K, C, Dk] and values [K, C, Dv], C >= end (grown if need be):
        what the decode engine's kernel writes position end - 1 into and attends over. float32, or
        for a bfloat16 cache int16 arrays of its bit patterns (numpy has no bfloat16)."""
        if end > self._k[layer].shape[1]:
            self._grow(layer, end)
        if self.dtype == torch.bfloat16:
            return self._k[layer].view(torch.int16).numpy(), self._v[layer].view(torch.int16).numpy()
        return self._k[layer].numpy(), self._v[layer].numpy()

    def layer_addresses(self, end: int) -> tuple[np.ndarray, np.ndarray]:
        """layer_arrays for every layer at once, as a kernel that runs all layers takes them: int64
        [L, 3] (each layer's keys and values addresses and its capacity) and layer 0's keys array
        (their element type). Made again only when a layer's arrays were reallocated (_grow)."""
        if self._addresses is None or end > int(self._addresses[0][:, 2].min()):
            rows = np.empty((self.num_layers, 3), np.int64)
            for layer in range(self.num_layers):
                keys, values = self.layer_arrays(layer, end)
                rows[layer] = (address(keys), address(values), keys.shape[1])
                if layer == 0:
                    like = keys
            self._addresses = (rows, like)
        return self._addresses

    def advance(self, n: int) -> None:
        self.length += n

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"truncate: length {length} outside [0, {self.length}]")
        self.length = length

    def fork(self) -> "KVCache":
        twin = KVCache(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype, self.device, capacity=1,
                       value_dim=self.value_dim, limit=self.limit)
        twin._k = [k.clone() for k in self._k]
        twin._v = [v.clone() for v in self._v]
        twin.length = self.length
        return twin
