"""The decode engine: a one-token step's attention block in one kernel call per layer, and with
every expert resident in RAM the MoE block too, or the whole step in one call.

Contract. `DecodeEngine.for_model(spec, layers)` returns an engine, or None where the layers are
not its kind (then the generic forward runs every step). Its kind: grouped-query attention (RMSNorm or
LayerNorm, rotary over the whole head) or multi-head latent attention (DeepSeek), whose
projections are QuantizedLinear ("qkv" stacked, or MLA's q / q_a, q_b, kv_a, kv_b; and "o"), which is what `--dense-bits 8` or `4` loads (the default for a store).
`layer(l, x, position, cos, sin, cache)` takes one token's hidden state x float32 [1, D] at
`position` (the cache holds the positions before it) and returns (x + attention [1, D], h [1, D],
logits [1, E] or None): the residual stream after the attention block, the MoE block's normed
input and the router's float32 logits; it writes the token's keys and values into the cache. The
model runs the MoE block on h (model.py). Against the generic forward on the same token: the
projections, RMSNorms, rotary and residual are bit-identical; the attention, the router logits and
LayerNorm differ in the last bits, so the results match within float32 rounding (tested per
architecture in tests/test_decode_engine.py). `layer_rows(l, x, cos, sin, caches)` runs layer() for
one token of each of several sequences in one call (grouped-query attention), each row layer()'s
bits: a step of sequences decoded together (model.py, StepParts).

With every expert resident in RAM at full width (the store's resident tables), `moe(l, x, h, logits,
layouts)` runs a layer's MoE block (computes_moe: a router in ROUTERS, top-k of the softmax, GPT-OSS's
softmax of the biased top-k, Phi-3.5-MoE's sparsemixer or DeepSeek's group-limited softmax or
grouped sigmoid, weights scaled by routed_scaling_factor;
SwiGLU or GPT-OSS experts; a shared expert, gated (Qwen2-MoE) or not (DeepSeek), where its matrices
are quantized) in one more call, and `step(x, position, cos, sin, cache, layouts)` runs the
layers from step_start on, both blocks each, in one call (computes_token: the layers after the last
one whose MoE block moe() does not compute, e.g. after DeepSeek's dense first layers, which the model
runs layer by layer first; either attention kind). Both give the bits of layer() followed by the
model's generic MoE block on the integer path (tests/test_resident_step.py); a replayed routing is
given to them. The generic
block adds a shared expert after layer() by the same kernel (add_shared), so a store gives the same
bits whether its experts are all resident or not.

Why: the generic forward makes about 40 torch ops and kernel calls for a token's attention block,
each with Python around it; on a fine-grained model that glue cost more than the kernels
(tools/profile_decode.py, docs/benchmarks.md).
"""

from __future__ import annotations

import numpy as np
import torch

from .dense import QuantizedLinear
from .kernels import cpu, cpu_layer, cpu_seq2seq
from .kernels.ops import _int_path, expert_layout
from .kernels.views import address
from .layers import choose_experts
from .spec import ModelSpec


# The matrices each attention kind's table holds, by slot: the first of several names the layer has.
MATRICES = {"gqa": ((cpu_layer.QKV, ("qkv",)), (cpu_layer.O, ("o",))),
            "mla": ((cpu_layer.QKV, ("q_b", "q")), (cpu_layer.O, ("o",)), (cpu_layer.Q_A, ("q_a",)),
                    (cpu_layer.KV_A, ("kv_a",)), (cpu_layer.KV_B, ("kv_b",)))}
VECTORS = {cpu_layer.ATTN_NORM: "attn_norm", cpu_layer.ATTN_NORM_BIAS: "attn_norm_bias",
           cpu_layer.MLP_NORM: "mlp_norm", cpu_layer.MLP_NORM_BIAS: "mlp_norm_bias", cpu_layer.Q_BIAS: "q_bias",
           cpu_layer.K_BIAS: "k_bias", cpu_layer.V_BIAS: "v_bias", cpu_layer.O_BIAS: "o_bias",
           cpu_layer.Q_NORM: "q_norm", cpu_layer.K_NORM: "k_norm", cpu_layer.SINKS: "sinks",
           cpu_layer.Q_A_NORM: "q_a_norm", cpu_layer.Q_A_BIAS: "q_a_bias", cpu_layer.KV_A_NORM: "kv_a_norm",
           cpu_layer.KV_A_BIAS: "kv_a_bias"}


# The routers moe() and step() compute, by spec.router (softmax and sigmoid_group: renormalised by
# spec.norm_topk_prob; softmax_group, DeepSeek-V2's, never).
ROUTERS = {"softmax": cpu_layer.SOFTMAX, "topk_softmax": cpu_layer.TOPK_SOFTMAX,
           "sparsemixer": cpu_layer.SPARSEMIXER, "softmax_group": cpu_layer.SOFTMAX_GROUP,
           "sigmoid_group": cpu_layer.SIGMOID_GROUP}
NORMALIZED = {cpu_layer.SOFTMAX: cpu_layer.SOFTMAX_NORMALIZED,
              cpu_layer.SIGMOID_GROUP: cpu_layer.SIGMOID_GROUP_NORMALIZED}


def router_code(spec: ModelSpec) -> int | None:
    """The kernel's code for the spec's router (cpu_layer.SOFTMAX, ...), None for one it does not compute."""
    code = ROUTERS.get(spec.router)
    return NORMALIZED.get(code, code) if spec.norm_topk_prob else code


class DecodeEngine:
    def __init__(self, spec: ModelSpec, layers: list[dict]):
        self.spec = spec
        self._keep: list = []     # arrays the tables point into (float32 copies of norms and biases)
        self.tables = [self._table(l, w) for l, w in enumerate(layers)]
        self.stacked_tables = np.stack(self.tables)   # step()'s: every layer's table in one array
        self.dims = self._dims(spec)
        self.scale = np.float32(spec.attention.softmax_scale(spec))
        clip = spec.attention.clip_qkv
        self.clip = np.float32(-1 if clip is None else clip)
        self.eps = float(spec.rms_norm_eps)   # a float64, as the generic path's norms take it
        self.router = router_code(spec)   # None: a router moe() does not compute
        self.jitter = float(getattr(spec.routing, "router_jitter_eps", 0.0))   # sparsemixer's
        self.scaling = np.float32(spec.routed_scaling_factor)
        self.step_start = self._step_start()

    @classmethod
    def for_model(cls, spec: ModelSpec, layers: list[dict]) -> "DecodeEngine | None":
        """An engine for these decoder layers (MoEModel.layers), or None if they are not its kind."""
        if spec.attention.kind not in MATRICES:
            return None
        no_query_latent = spec.attention.kind == "mla" and not spec.attention.q_lora_rank
        optional = {"q_a"} if no_query_latent else set()
        for w in layers:
            for _, names in MATRICES[spec.attention.kind]:
                present = [name for name in names if name in w]
                if not (present and isinstance(w[present[0]], QuantizedLinear)) and not optional.issuperset(names):
                    return None
        return cls(spec, layers)

    @staticmethod
    def _dims(spec: ModelSpec) -> np.ndarray:
        c = cpu_layer
        dims = np.zeros(c.DIMS, np.int64)
        dims[[c.DIM_D, c.DIM_H, c.DIM_K, c.DIM_DK, c.DIM_DV]] = (spec.hidden_size, spec.num_heads,
                                                               *spec.cache_layout)
        dims[c.DIM_QK_NORM] = {None: c.QK_NORM_NONE, "head": c.QK_NORM_HEAD, "proj": c.QK_NORM_PROJ}[spec.attention.qk_norm]
        dims[c.DIM_NORM] = {"rms": c.NORM_RMS, "layer": c.NORM_LAYER}[spec.norm]
        if spec.attention.kind == "mla":
            mla = spec.attention
            dims[[c.DIM_N, c.DIM_R, c.DIM_CKV, c.DIM_CQ, c.DIM_INTERLEAVE, c.DIM_V]] = (
                mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.kv_lora_rank, mla.q_lora_rank,
                int(spec.rotary.rope_interleave), mla.v_head_dim)
        return dims

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
        for slot, names in MATRICES[self.spec.attention.kind]:
            name = next((n for n in names if n in w), None)
            if name is not None:   # None: q_a without a query latent
                _matrix_columns(table, slot, w[name])
        for column, name in VECTORS.items():
            table[column] = self._float32(w.get(name))
        if self.spec.moe_layers[l]:
            table[c.ROUTER] = self._float32(w["router"])
            table[c.ROUTER_BIAS] = self._float32(w.get("router_bias"))
            table[c.EXPERTS] = w["router"].shape[0]
            table[c.GROUPS] = getattr(self.spec.routing, "n_group", 1)
            table[c.KEPT_GROUPS] = getattr(self.spec.routing, "topk_group", 1)
            table[c.SHARED] = self._shared_layout(w)
            if table[c.SHARED] and self.spec.shared_expert_gated:
                table[c.SHARED_GATE] = self._float32(w["shared_gate"])
        window = self.spec.sliding_windows[l]
        table[c.WINDOW] = 0 if window is None else window
        return table

    def _shared_layout(self, w: dict, prefix: str = "shared.", gated: bool = True) -> int:
        """The address of the layout row (kept alive by the engine) of the layer's shared expert (or of
        another MLP of its matrices prefix + gate / up / down; gated False: up and down only, a relu
        MLP), 0 where it has none or its matrices are not quantized (dense_bits none: the generic block
        runs it)."""
        matrices = [w.get(prefix + name) for name in (("gate", "up", "down") if gated else ("up", "down"))]
        if not all(isinstance(m, QuantizedLinear) for m in matrices):
            return 0
        codes = [m.qt for m in matrices]
        row = expert_layout(*codes) if gated else expert_layout(None, *codes)
        self._keep.append(row)
        return address(row)

    def layer(self, l: int, x: torch.Tensor, position: int, cos: torch.Tensor, sin: torch.Tensor, cache):
        """Layer l's attention block for one token: see the module docstring."""
        keys, values = cache.layer_arrays(l, position + 1)
        table = self.tables[l]
        x = x.clone()   # the residual stream is updated in place
        h = torch.empty_like(x)
        logits = torch.empty(1, int(table[cpu_layer.EXPERTS]), dtype=torch.float32)
        arrays = (x.numpy()[0], cos.numpy()[0], sin.numpy()[0], keys, values, position, h.numpy()[0],
                  logits.numpy()[0], cpu.row_blocks())
        if self.spec.attention.kind == "mla":
            cpu_layer.latent_attention_block_kernel(_int_path(None), table, self.dims, self.eps, self.scale, self.clip,
                                                    *arrays)
        else:
            cpu_layer.attention_block_kernel(_int_path(None), table, self.dims, self.eps, self.scale, self.clip,
                                             *arrays)
        return x, h, (logits if table[cpu_layer.ROUTER] else None)

    def attends_rows(self) -> bool:
        """Whether layer_rows() computes this model's attention blocks (grouped-query attention)."""
        return self.spec.attention.kind == "gqa"

    def layer_rows(self, l: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, caches):
        """layer() for one token of each of several sequences in one call (attends_rows): x float32
        [T, D], row t at position caches[t].length, cos / sin [T, Dk] (each row made alone). Returns
        (x + attention [T, D], h [T, D], logits [T, E] or None), each row the bits of layer() on it;
        the layer's matrices are read once for all rows."""
        table = self.tables[l]
        kv = np.empty((len(caches), 3), np.int64)
        arrays = [cache.layer_arrays(l, cache.length + 1) for cache in caches]   # alive through the call
        for row, (keys, values) in zip(kv, arrays):
            row[:] = (address(keys), address(values), keys.shape[1])
        positions = np.array([cache.length for cache in caches], np.int64)
        x = x.clone()   # the residual stream is updated in place
        h = torch.empty_like(x)
        logits = torch.empty(x.shape[0], max(1, int(table[cpu_layer.EXPERTS])), dtype=torch.float32)
        cpu_layer.attention_rows_kernel(_int_path(None), table, self.dims, self.eps, self.scale, self.clip, x.numpy(),
                                        np.ascontiguousarray(cos.numpy()), np.ascontiguousarray(sin.numpy()), kv,
                                        arrays[0][0], positions, h.numpy(), logits.numpy(), cpu.row_blocks())
        return x, h, (logits if table[cpu_layer.ROUTER] else None)

    def _step_start(self) -> int | None:
        """The first layer of the layers step() runs in one call: those after the last layer whose MoE
        block moe() does not compute (a dense MLP, as DeepSeek's first layers; an unknown router), if
        any are left; None if none."""
        computed = [self.computes_moe(l) for l in range(len(self.tables))]
        start = len(computed) - computed[::-1].index(False) if False in computed else 0
        return start if start < len(computed) else None

    def computes_token(self) -> bool:
        """Whether step() can run a token through its last layers (step_start on) in one call."""
        return self.step_start is not None

    def step(self, x: torch.Tensor, position: int, cos: torch.Tensor, sin: torch.Tensor, cache,
             layouts: np.ndarray, replayed: tuple[torch.Tensor, torch.Tensor] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One token through layers step_start, step_start + 1, ... in one kernel call (computes_token):
        layer() then moe(), layer after layer, with the bits of those calls. x float32 [1, D] is updated
        in place (layer step_start's input in, the last layer's output out); layouts int64 [S, E,
        LAYOUT_COLUMNS] (the store's resident_tables of those S layers); replayed: their (weights
        [S, A], experts [S, A]) given (a replayed trace), else the routers choose. Returns each of
        those layers' MoE input hs [S, D] and router choice (weights [S, A] float32, experts [S, A]),
        for the hooks and counts that follow."""
        start = self.step_start
        kv, like = cache.layer_addresses(position + 1)
        hs = torch.empty(len(self.tables) - start, self.spec.hidden_size, dtype=torch.float32)
        weights, experts = self._choice(hs.shape[0], replayed)
        kernel = (cpu_layer.decode_latent_token_kernel if self.spec.attention.kind == "mla"
                  else cpu_layer.decode_token_kernel)
        kernel(_int_path(None), self.stacked_tables[start:], self.dims, self.eps, self.scale, self.clip, x.numpy()[0],
               cos.numpy()[0], sin.numpy()[0], kv[start:], like, position, layouts, experts.shape[1], self.router,
               self.jitter, self.scaling, replayed is not None, hs.numpy(), weights.numpy(), experts.numpy(),
               cpu.row_blocks())
        return hs, weights, experts

    def _choice(self, layers: int, replayed: tuple[torch.Tensor, torch.Tensor] | None):
        """The kernel's (weights float32 [L, A], experts int64 [L, A]): copies of a replayed choice,
        or arrays for the routers' (A = top_k)."""
        if replayed is not None:
            weights, experts = replayed
            if experts.numel() and not 0 <= int(experts.min()) <= int(experts.max()) < self.spec.num_experts:
                raise ValueError(f"replayed routing: expert ids must be in [0, {self.spec.num_experts}), "
                                 f"got {experts.tolist()}")
            return (weights.to(torch.float32).contiguous().clone(), experts.to(torch.long).contiguous().clone())
        return (torch.empty(layers, self.spec.top_k, dtype=torch.float32),
                torch.empty(layers, self.spec.top_k, dtype=torch.long))

    def computes_moe(self, l: int) -> bool:
        """Whether moe() can run layer l's MoE block: a routed layer with a router in ROUTERS (top-k of
        the softmax, GPT-OSS's softmax of the biased top-k, Phi-3.5-MoE's sparsemixer, DeepSeek's
        group-limited ones; its weights
        scaled by routed_scaling_factor), and a shared expert, gated or not, only where its matrices
        are quantized (computes_shared; other MoE blocks run through the model's generic MoE block)."""
        spec = self.spec
        return (self.tables[l][cpu_layer.ROUTER] != 0 and self.router is not None
                and (not spec.shared_expert_hidden or self.computes_shared(l)))

    def computes_shared(self, l: int) -> bool:
        """Whether add_shared() computes layer l's shared expert: its matrices are quantized."""
        return self.tables[l][cpu_layer.SHARED] != 0

    def add_shared(self, l: int, h: torch.Tensor, out: torch.Tensor) -> None:
        """out float32 [T, D] += layer l's shared expert on each token's h [T, D] (computes_shared),
        gated where the model gates it, in place: the bits moe() and step() add, a call per token."""
        for h_row, out_row in zip(h.numpy(), out.numpy()):
            cpu_layer.shared_expert_kernel(_int_path(None), self.tables[l], h_row, out_row, cpu.row_blocks())

    def moe(self, l: int, x: torch.Tensor, h: torch.Tensor, logits: torch.Tensor, layouts: np.ndarray,
            replayed: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer l's MoE block (computes_moe) for one token whose experts are all resident on the integer
        path: x [1, D] += the weighted sum of its chosen experts' outputs on h [1, D], in place; layouts
        int64 [E, LAYOUT_COLUMNS] (the store's resident layer table, as the layer kernel computes
        each expert: StoreExperts.resident_layouts); replayed: (weights [1, A],
        experts [1, A]) given, else the router chooses. Returns the (weights [1, A] float32, experts
        [1, A]) it used, as choose() gives them. Bit for bit the generic MoE block's."""
        weights, experts = self._choice(1, replayed)
        cpu_layer.moe_block_kernel(_int_path(None), layouts, h.numpy()[0], logits.numpy()[0], experts.shape[1],
                                   self.router, self.tables[l], self.jitter, self.scaling, replayed is not None,
                                   x.numpy()[0], weights.numpy()[0], experts.numpy()[0], cpu.row_blocks())
        return weights, experts

    def choose(self, logits: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The router's choice from the layer's logits [T, E]: (weights [T, A] float32, experts [T, A]),
        as layers.choose_experts, each token's as it is chosen alone; a router in ROUTERS in one numba
        call a token, the one moe() and step() make (softmax, top-k and renormalisation in torch cost
        ~10 us a layer, most of it per-op overhead)."""
        if logits.shape[0] != 1:
            rows = [self.choose(row, bias) for row in logits.split(1)]
            return torch.cat([w for w, _ in rows]), torch.cat([e for _, e in rows])
        spec = self.spec
        if self.router is None:
            return choose_experts(logits, bias, spec)
        weights = torch.empty(1, spec.top_k, dtype=torch.float32)
        experts = torch.empty(1, spec.top_k, dtype=torch.long)
        if self.router == cpu_layer.SPARSEMIXER:
            cpu_layer.sparsemixer_kernel(logits.numpy()[0], self.jitter, weights.numpy()[0], experts.numpy()[0])
        elif self.router == cpu_layer.TOPK_SOFTMAX:
            cpu_layer.topk_softmax_kernel(logits.numpy()[0], self._biases(bias), spec.top_k, weights.numpy()[0],
                                          experts.numpy()[0])
        elif self.router >= cpu_layer.SOFTMAX_GROUP:
            cpu_layer.grouped_kernel(logits.numpy()[0], self._biases(bias), spec.routing.n_group,
                                     spec.routing.topk_group, self.router != cpu_layer.SOFTMAX_GROUP,
                                     self.router == cpu_layer.SIGMOID_GROUP_NORMALIZED, spec.top_k,
                                     weights.numpy()[0], experts.numpy()[0])
        else:
            cpu_layer.softmax_topk_kernel(logits.numpy()[0], spec.top_k, self.router == cpu_layer.SOFTMAX_NORMALIZED,
                                          weights.numpy()[0], experts.numpy()[0])
        if spec.routed_scaling_factor != 1.0:
            weights = weights * spec.routed_scaling_factor
        return weights, experts

    def _biases(self, bias: torch.Tensor | None) -> np.ndarray:
        """A router's float32 bias [E] as its numba router takes it (zeros for none)."""
        return np.zeros(self.spec.num_experts, np.float32) if bias is None else bias.detach().float().numpy()


def _matrix_columns(table: np.ndarray, slot: int, matrix: QuantizedLinear) -> None:
    """A quantized matrix's columns of a layer table (cpu_layer.MATRIX_COLUMNS from slot)."""
    qt = matrix.qt
    table[slot:slot + cpu_layer.MATRIX_COLUMNS] = (address(qt.packed), address(qt.scale), address(qt.zero),
                                                   qt.bits, qt.group, qt.ngroups)


class EncoderDecoderEngine(DecodeEngine):
    """The decode engine of a T5 encoder-decoder (Switch Transformers): a decoder layer's self- and
    cross-attention blocks for one token in one kernel call (edgemoe/kernels/cpu_seq2seq.py), its
    dense MLP in the same call, its MoE block (top-1 of the softmax, ungated relu experts) by moe()
    with every expert resident, else by the model's generic block on choose()'s choice. No whole-step
    call (step_start None). Matches the generic forward within float32 rounding and gives the same
    bits whether the experts are resident or not (tests/test_seq2seq_engine.py)."""

    DECODER_MATRICES = ((cpu_layer.QKV, "qkv"), (cpu_layer.O, "o"), (cpu_layer.CROSS_Q, "cross.q"),
                        (cpu_layer.CROSS_O, "cross.o"))

    def __init__(self, spec: ModelSpec, layers: list[dict], bias_by_distance: torch.Tensor):
        super().__init__(spec, layers)
        self.bias = np.ascontiguousarray(bias_by_distance.detach().float().numpy())

    @classmethod
    def for_model(cls, spec: ModelSpec, layers: list[dict], bias_by_distance: torch.Tensor | None = None
                  ) -> "EncoderDecoderEngine | None":
        """An engine for a T5 model's layers (Seq2SeqModel.layers) whose decoder projections are
        quantized (dense_bits), with the decoder's relative-position bias by distance (float [H, C]);
        None where they are not."""
        decoder = layers[spec.stacks.encoder_layers:]
        needed = [name for _, name in cls.DECODER_MATRICES]
        for l, w in enumerate(decoder, spec.stacks.encoder_layers):
            names = needed if spec.moe_layers[l] else needed + ["mlp.up", "mlp.down"]
            if not all(isinstance(w.get(name), QuantizedLinear) for name in names):
                return None
        return cls(spec, layers, bias_by_distance)

    def _table(self, l: int, w: dict) -> np.ndarray:
        c = cpu_layer
        table = np.zeros(c.TABLE_COLUMNS, np.int64)
        if l < self.spec.stacks.encoder_layers:   # the encoder runs on the generic forward
            return table
        for slot, name in self.DECODER_MATRICES:
            _matrix_columns(table, slot, w[name])
        for column, name in ((c.ATTN_NORM, "attn_norm"), (c.CROSS_NORM, "cross_norm"), (c.MLP_NORM, "mlp_norm")):
            table[column] = self._float32(w[name])
        if self.spec.moe_layers[l]:
            table[c.ROUTER] = self._float32(w["router"])
            table[c.EXPERTS] = w["router"].shape[0]
        else:
            table[c.SHARED] = self._shared_layout(w, "mlp.", gated=False)
        return table

    def _step_start(self) -> None:
        return None

    def layer(self, l: int, x: torch.Tensor, position: int, cache, cross: tuple[torch.Tensor, torch.Tensor]):
        """Decoder layer l for one token x float32 [1, D] at `position` of the layer's self-attention
        cache (decoder layer l - encoder_layers of `cache`, which holds the positions before it; the
        token's keys and values are written there), over the encoder output's cross keys and values
        (float32 [H, S, Dh], contiguous). Returns (x + both attention blocks [+ the dense MLP], h [1, D],
        logits [1, E] or None): a routed layer's MoE block is the caller's, on h."""
        keys, values = cache.layer_arrays(l - self.spec.stacks.encoder_layers, position + 1)
        table = self.tables[l]
        x = x.clone()   # the residual stream is updated in place
        h = torch.empty_like(x)
        logits = torch.empty(1, max(1, int(table[cpu_layer.EXPERTS])), dtype=torch.float32)
        cpu_seq2seq.t5_decoder_layer_kernel(_int_path(None), table, self.dims, self.eps, x.numpy()[0], keys, values,
                                            position, self.bias, cross[0].numpy(), cross[1].numpy(), h.numpy()[0],
                                            logits.numpy()[0], cpu.row_blocks())
        return x, h, (logits if table[cpu_layer.ROUTER] else None)
