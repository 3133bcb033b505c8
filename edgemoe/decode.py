"""The decode engine: a one-token step's attention block in one kernel call per layer.

Contract. `DecodeEngine.for_model(spec, layers)` returns an engine, or None where the layers are
not its kind (then the generic forward runs every step). Its kind: grouped-query attention (with
RMSNorm or LayerNorm, rotary over the whole head) whose projections are QuantizedLinear ("qkv"
stacked, "o"), which is what `--dense-bits 8` or `4` loads (the default for a store).
`layer(l, x, position, cos, sin, cache)` takes one token's hidden state x float32 [1, D] at
`position` (the cache holds the positions before it) and returns (x + attention [1, D], h [1, D],
logits [1, E] or None): the residual stream after the attention block, the MoE block's normed
input and the router's float32 logits; it writes the token's keys and values into the cache. The
model runs the MoE block on h (model.py). Against the generic forward on the same token: the
projections, RMSNorms, rotary and residual are bit-identical; the attention, the router logits and
LayerNorm differ in the last bits, so the results match within float32 rounding (tested per
architecture in tests/test_decode_engine.py).

Why: the generic forward makes about 40 torch ops and kernel calls for a token's attention block,
each with Python around it; on a fine-grained model that glue cost more than the kernels
(tools/profile_decode.py, docs/benchmarks.md).
"""

from __future__ import annotations

import numpy as np
import torch

from .dense import QuantizedLinear
from .kernels import cpu, cpu_layer
from .kernels.ops import _int_path
from .kernels.views import address
from .layers import choose_experts
from .spec import ModelSpec


class DecodeEngine:
    def __init__(self, spec: ModelSpec, layers: list[dict]):
        self.spec = spec
        self._keep: list = []     # arrays the tables point into (float32 copies of norms and biases)
        self.tables = [self._table(l, w) for l, w in enumerate(layers)]
        qk_norm = {None: cpu_layer.QK_NORM_NONE, "head": cpu_layer.QK_NORM_HEAD, "proj": cpu_layer.QK_NORM_PROJ}
        norm = {"rms": cpu_layer.NORM_RMS, "layer": cpu_layer.NORM_LAYER}[spec.norm]
        self.dims = np.array([spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.key_dim, spec.value_dim,
                              qk_norm[spec.qk_norm], norm], np.int64)
        self.scale = np.float32(spec.key_dim ** -0.5 if spec.attention_scale is None else spec.attention_scale)
        self.clip = np.float32(-1 if spec.clip_qkv is None else spec.clip_qkv)
        self.eps = float(spec.rms_norm_eps)   # a float64, as the generic path's norms take it

    @classmethod
    def for_model(cls, spec: ModelSpec, layers: list[dict]) -> "DecodeEngine | None":
        """An engine for these decoder layers (MoEModel.layers), or None if they are not its kind."""
        if spec.attention != "gqa" or spec.rope_dim != spec.head_dim:
            return None
        if not all(isinstance(w.get("qkv"), QuantizedLinear) and isinstance(w.get("o"), QuantizedLinear)
                   for w in layers):
            return None
        return cls(spec, layers)

    def _float32(self, t: torch.Tensor | None) -> int:
        """The address of a float32 contiguous copy of t (kept alive by the engine), 0 for None."""
        if t is None:
            return 0
        array = np.ascontiguousarray(t.detach().float().numpy())
        self._keep.append(array)
        return address(array)

    def _table(self, l: int, w: dict) -> np.ndarray:
        c = cpu_layer
        table = np.zeros(c.TABLE_COLUMNS, np.int64)
        for first, name in ((c.QKV_P, "qkv"), (c.O_P, "o")):
            qt = w[name].qt
            table[first:first + 3] = [address(qt.packed), address(qt.scale), address(qt.zero)]
            bits_col = c.QKV_BITS if name == "qkv" else c.O_BITS
            table[bits_col:bits_col + 3] = [qt.bits, qt.group, qt.ngroups]
        for column, name in ((c.ATTN_NORM, "attn_norm"), (c.MLP_NORM, "mlp_norm"), (c.ATTN_NORM_BIAS, "attn_norm_bias"),
                             (c.MLP_NORM_BIAS, "mlp_norm_bias"), (c.Q_BIAS, "q_bias"),
                             (c.K_BIAS, "k_bias"), (c.V_BIAS, "v_bias"), (c.O_BIAS, "o_bias"),
                             (c.Q_NORM, "q_norm"), (c.K_NORM, "k_norm"), (c.SINKS, "sinks")):
            table[column] = self._float32(w.get(name))
        if self.spec.moe_layers[l]:
            table[c.ROUTER] = self._float32(w["router"])
            table[c.EXPERTS] = w["router"].shape[0]
        window = self.spec.sliding_windows[l]
        table[c.WINDOW] = 0 if window is None else window
        return table

    def layer(self, l: int, x: torch.Tensor, position: int, cos: torch.Tensor, sin: torch.Tensor, cache):
        """Layer l's attention block for one token: see the module docstring."""
        keys, values = cache.layer_arrays(l, position + 1)
        table = self.tables[l]
        x = x.clone()   # the residual stream is updated in place
        h = torch.empty_like(x)
        logits = torch.empty(1, int(table[cpu_layer.EXPERTS]), dtype=torch.float32)
        cpu_layer.attention_block_kernel(_int_path(None), table, self.dims, self.eps, self.scale, self.clip,
                                         x.numpy()[0], cos.numpy()[0], sin.numpy()[0], keys, values, position,
                                         h.numpy()[0], logits.numpy()[0], cpu.row_blocks())
        return x, h, (logits if table[cpu_layer.ROUTER] else None)

    def choose(self, logits: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The router's choice from the layer's logits [1, E]: (weights [1, A] float32, experts [1, A]),
        as layers.choose_experts; the softmax router's in one numba call (softmax, top-k and
        renormalisation in torch cost ~10 us a layer, most of it per-op overhead)."""
        spec = self.spec
        if spec.router != "softmax":
            return choose_experts(logits, bias, spec)
        weights = torch.empty(1, spec.top_k, dtype=torch.float32)
        experts = torch.empty(1, spec.top_k, dtype=torch.long)
        cpu_layer.softmax_topk_kernel(logits.numpy()[0], spec.top_k, spec.norm_topk_prob, weights.numpy()[0],
                                      experts.numpy()[0])
        if spec.routed_scaling_factor != 1.0:
            weights = weights * spec.routed_scaling_factor
        return weights, experts
