"""`edgemoe.load(path)`: a model from a Hugging Face checkpoint directory (everything in RAM) or from a
store (dense weights in RAM, experts in the tiered store): a MoEModel, or a Seq2SeqModel for an
encoder-decoder spec (spec.is_encoder_decoder)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from edgemoe.options import OptionError, check_device, one_of, parse_bytes, routing_weight
from edgemoe.scheduling.policies import DEFAULT_POLICY, POLICIES
from edgemoe.scheduling.preload import PREDICTORS
from edgemoe.store import TieredStore
from edgemoe.store.disk import IO_MODES, drop_page_cache
from edgemoe.store.format import DENSE_FILE, MANIFEST, Manifest, StoreError, file_crc32, read_manifest
from edgemoe.store.memory import (KERNEL_COMPILE_GROWTH, RUNTIME_GROWTH, ram_budget, read_buffer_bytes, read_memory_facts,
                                  return_freed_memory)

from .checkpoint import (TORCH_DTYPES, Checkpoint, CheckpointError, all_finite, check_finite, pread_tensor,
                         read_json, read_safetensors_header)
from .errors import EdgeMoEError
from .dense import (DENSE_BITS, GROUP_SIZE, QuantizedLinear, dense_bits_for, quantize_rows,
                    quantized_at_load)
from .generate import GenerationOptions
from .kernels.ops import kernels_compiled
from .kv_cache import KV_DTYPES
from .layers import attention_peak_bytes
from .experts import DenseExpert, ExpertProvider, InMemoryExperts, expert_activations
from .model import MoEModel
from .seq2seq import Seq2SeqModel
from .models import architecture, parse_spec
from .spec import ModelSpec
from .precision import compute_dtype
from .quant import group_layout
from .quantized import COMPUTE_CHOICES, StoreExperts, latency_model
from .tokenizer import Tokenizer
from .weights import WeightPlan, iter_experts, plan_weights, read_dense, read_expert


def python_name(option: str) -> str:
    return f"{option}="


@dataclass(frozen=True)
class StoreOptions:
    """How a store's experts are held and run, checked once, when made; errors name each option as
    `name` spells it (python_name: "ram=", cli_flag: "--ram").

    ram, vram: bytes, sizes like "512MiB", or shares of the store's expert bytes like "25%" (resolved
    when the store opens; ram None: unlimited, vram None or 0: no VRAM tier); ram "auto" (the commands'
    default): sized from the memory this process may still take (auto_ram). device: the VRAM tier's torch
    device. policy: eviction (edgemoe.scheduling.policies). preload: predictor
    (edgemoe.scheduling.preload). compute: the experts' path (edgemoe.quantized). skip_below:
    adaptive top-k, a non-resident expert chosen only below this weight is not read. fallback_below:
    an expert chosen only below this weight is served by the store's narrower copy when not resident
    (a store converted with fallback copies). io: direct (the default:
    O_DIRECT into recycled buffers, buffered where the file system refuses it) or buffered reads. place_popular: start with the most popular experts resident. routing_profile:
    a RoutingProfile to use instead of the store's profile.json."""

    ram: int | str | None = None
    vram: int | str | None = None
    device: str | None = None
    policy: str = DEFAULT_POLICY
    preload: str = "auto"
    compute: str = "auto"
    skip_below: float = 0.0
    fallback_below: float = 0.0
    io: str = "direct"
    place_popular: bool = True
    routing_profile: object = None
    name: Callable[[str], str] = field(default=python_name, repr=False, compare=False)

    def __post_init__(self):
        n = self.name
        parse_bytes(self.ram, n("ram"), allow_share=True, allow_auto=True)
        parse_bytes(self.vram, n("vram"), allow_share=True)
        check_device(self.device, n("device"))
        one_of(self.policy, n("policy"), sorted(POLICIES))
        one_of(self.preload, n("preload"), PREDICTORS)
        one_of(self.compute, n("compute"), COMPUTE_CHOICES)
        one_of(self.io, n("io"), IO_MODES)
        routing_weight(self.skip_below, n("skip_below"))
        routing_weight(self.fallback_below, n("fallback_below"))

    def given(self) -> list[str]:
        """The options set to something other than their defaults, as `name` spells them (ram="auto",
        the commands' default, asks for nothing a checkpoint directory lacks: it holds every expert)."""
        return [self.name(f.name) for f in fields(self)
                if f.name != "name" and getattr(self, f.name) != f.default
                and not (f.name == "ram" and self.ram == "auto")]


def model_class(spec: ModelSpec) -> type:
    """The model class that runs `spec`: Seq2SeqModel (encoder-decoder) or MoEModel (decoder-only)."""
    return Seq2SeqModel if spec.is_encoder_decoder else MoEModel


def require_decoder_only(spec: ModelSpec, where, what: str) -> None:
    """Refuse an encoder-decoder model for `what` (a command or option that only runs MoEModel)."""
    if spec.is_encoder_decoder:
        raise EdgeMoEError(f"{where}: {what} needs a decoder-only model, and this is an encoder-decoder "
                           f"{spec.model_type} model (edgemoe run generates from it)")


def read_spec(ckpt: Checkpoint) -> ModelSpec:
    return parse_spec(ckpt.config, where=str(ckpt.path / "config.json"))


def read_text_config(directory: Path) -> tuple[Tokenizer | None, dict]:
    """The tokenizer (if tokenizer.json is there) and generation_config.json (or {}) of a directory."""
    tokenizer = Tokenizer(directory) if (directory / "tokenizer.json").exists() else None
    gen_path = directory / "generation_config.json"
    return tokenizer, read_json(gen_path) if gen_path.exists() else {}


def weight_in(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A weight as the model keeps it: a matrix in `dtype` (None: auto, the stored type where the CPU
    computes it natively, else float32: edgemoe.precision), a vector (norm, bias: a few KB, added to
    float32 activations) in float32."""
    return t.float() if t.dim() < 2 else t.to(compute_dtype(t.dtype, dtype))


def held_as_stored(name: str, stored: torch.dtype, requested: torch.dtype | None, tied: bool) -> bool:
    """Whether a store's load keeps this dense tensor in its stored type rather than weight_in's: the
    embedding of a model whose LM head is a matrix of its own, where the compute type is wider than
    the stored one. Only its rows are read, each converted exactly as it is looked up
    (MoEModel.embeddings), so a bfloat16 vocabulary's float32 copy would double its bytes for nothing
    (Qwen3-30B-A3B's: 1.2 GB against 0.6 GB)."""
    return name == "embed" and not tied and compute_dtype(stored, requested).itemsize > stored.itemsize


def weights_in(dense: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    return {name: weight_in(t, dtype) for name, t in dense.items()}


def load_checkpoint(path: str | os.PathLike, dtype: torch.dtype | None = None, threads: int | None = None) -> MoEModel:
    """Load a checkpoint directory. Weight matrices in `dtype`; by default (None) as stored where the
    CPU computes that type natively (a bfloat16 checkpoint stays bfloat16 on AVX-512 BF16: half the
    bytes per token of float32), else float32. Activations float32."""
    ckpt = Checkpoint(path)
    try:
        return model_from_checkpoint(ckpt, plan_checkpoint(ckpt), dtype, threads)
    finally:
        ckpt.close()


def plan_checkpoint(ckpt: Checkpoint):
    """The checkpoint's ModelSpec and WeightPlan (edgemoe.weights), from its headers."""
    spec = read_spec(ckpt)
    return spec, plan_weights(ckpt, spec, architecture(spec.model_type).tensor_names(spec))


def model_from_checkpoint(ckpt: Checkpoint, planned, dtype: torch.dtype | None = None,
                          threads: int | None = None, lazy_experts: bool = False) -> MoEModel:
    """Every weight of an open checkpoint read into RAM (planned: plan_checkpoint's result);
    lazy_experts: the dense weights only, the experts read as the forward pass asks for them
    (CheckpointExperts; the checkpoint must stay open while the model runs)."""
    spec, plan = planned
    dense = weights_in(read_dense(ckpt, plan), dtype)
    activation = expert_activations(spec, dense)
    if lazy_experts:
        experts = CheckpointExperts(ckpt, plan, dtype, activation)
    else:
        experts = InMemoryExperts({key: DenseExpert(**weights_in(weights, dtype), activation=activation(*key))
                                   for key, weights in iter_experts(ckpt, plan, dtype)})
    tokenizer, generation_config = read_text_config(ckpt.path)
    return model_class(spec)(spec, dense, experts, tokenizer, generation_config, name=ckpt.path.name,
                             threads=threads)


class CheckpointExperts(ExpertProvider):
    """A checkpoint's experts read when first asked for, as model_from_checkpoint would load them,
    holding one layer's at a time: a forward pass reads each expert it routes to once per layer, in
    memory bounded by one layer's experts whatever the model's size."""

    def __init__(self, ckpt: Checkpoint, plan: WeightPlan, dtype: torch.dtype | None, activation):
        self.ckpt, self.plan, self.dtype, self.activation = ckpt, plan, dtype, activation
        self._layer, self._held = None, {}

    def expert(self, layer: int, expert: int) -> DenseExpert:
        if layer != self._layer:
            self._layer, self._held = layer, {}
        if expert not in self._held:
            self._held[expert] = self.read((layer, expert))
        return self._held[expert]

    def read(self, key: tuple[int, int]) -> DenseExpert:
        """The expert `key` from the checkpoint (not held)."""
        weights = read_expert(self.ckpt, self.plan.experts[key], self.dtype)
        return DenseExpert(**weights_in(weights, self.dtype), activation=self.activation(*key))




def is_store(path: str | os.PathLike) -> bool:
    path = Path(path)
    return (path / MANIFEST).exists() or (path / DENSE_FILE).exists()


# While a store's dense matrices are quantized as read, the C heap is trimmed after this many bytes of
# them are freed: each trim takes ~7 ms (a trim after every matrix added 0.85 s to bench-qwen3moe's load).
TRIM_EVERY_FREED_BYTES = 64 << 20


def expert_gemm_dtype(dense: dict[str, torch.Tensor]) -> torch.dtype:
    """The type the experts' "dequant" path multiplies in: the dense matrices' (weight_in chose it:
    bfloat16 for a bfloat16 model where the CPU multiplies it natively, unless a dtype was forced),
    so that a prefill's expert batches run at the dense part's speed and precision."""
    matrices = {t.gemm_dtype if isinstance(t, QuantizedLinear) else t.dtype for t in dense.values()
                if isinstance(t, QuantizedLinear) or t.dim() >= 2}
    return torch.bfloat16 if matrices == {torch.bfloat16} else torch.float32


def load_store(path: str | os.PathLike, options: StoreOptions | None = None, dtype: torch.dtype | None = None,
               threads: int | None = None, manifest=None, dense_bits: int | str | None = None,
               context: int | None = None, batch: int = 1, kv_dtype: str = "float32",
               score_windows: bool = False, cap_context: bool = False) -> MoEModel:
    """A model whose experts stay in a tiered store, held and run as `options` say (default
    StoreOptions()); the model owns the store: close it with model.close() or use the model as a
    context manager. manifest: the store's, already parsed (the converter's store before commit).
    dense_bits, context, batch, kv_dtype, score_windows, cap_context: what ram="auto" reserves for the dense
    weights, the KV cache and the activations (auto_ram); the store's breakdown of that choice is
    store.ram_breakdown (None without "auto")."""
    o = options or StoreOptions()
    ram, ram_breakdown = o.ram, None
    if ram == "auto":
        manifest = manifest if manifest is not None else read_manifest(Path(path))
        ram, ram_breakdown = auto_ram(manifest, dtype, dense_bits, context, batch, kv_dtype=kv_dtype,
                                      score_windows=score_windows, cap_context=cap_context)
    store = TieredStore(path, ram=ram, vram=o.vram, device=o.device, policy=o.policy, io=o.io,
                        place_popular=o.place_popular, routing_profile=o.routing_profile, manifest=manifest,
                        place_now=False)
    store.ram_breakdown = ram_breakdown
    if o.fallback_below and not store.manifest.fallback:
        store.close()
        raise OptionError(o.name("fallback_below"), o.fallback_below, f"{store.path} has no fallback copies "
                          f"(convert it with --fallback-bits)")
    dense_info = store.manifest.data["dense"]
    dense_path = store.path / dense_info["file"]
    if file_crc32(dense_path) != dense_info["crc32"]:
        store.close()
        raise StoreError(f"{dense_path}: checksum mismatch: the store is corrupt")
    bits = dense_bits_for(dense_bits, store.manifest, store.spec)
    dense = read_store_dense(dense_path, bits, dtype, store.spec.tie_word_embeddings)
    drop_page_cache(dense_path)   # the tensors are copied out: the file's pages would only double them
    store.place()    # after the dense weights: the load's passing extra never meets a full cache
    missing = sorted(set(store.spec.dense_shapes()) - set(dense))
    if missing:
        store.close()
        raise StoreError(f"{dense_path}: missing dense tensors {missing[:5]}")
    directory = Path(path)
    tokenizer, generation_config = read_text_config(directory)
    # preload="none" is pure on-demand loading (the baseline): no background reads of any kind.
    gemm_dtype = expert_gemm_dtype(dense)
    experts = StoreExperts(store, o.compute, overlap=o.preload != "none", skip_below=o.skip_below,
                           fallback_below=o.fallback_below, activations=expert_activations(store.spec, dense),
                           gemm_dtype=gemm_dtype,
                           latency=latency_model(store, gemm_dtype) if o.compute == "auto" else None)
    return model_class(store.spec)(store.spec, dense, experts, tokenizer, generation_config, name=directory.name,
                                   threads=threads, store=store, preload=o.preload)


def read_store_dense(dense_path: Path, bits: int | None, dtype: torch.dtype | None, tied: bool) -> dict[str, torch.Tensor]:
    """A store's dense tensors as the model keeps them, read one at a time with pread (each owns its
    memory; its pages leave the page cache as it is read), each checked finite. Each matrix that
    quantize_dense would replace is quantized as it is read, straight from the file a block of rows at
    a time (quantize_rows), so that the load holds no float copy of it: the load's peak is what it
    keeps plus one block. The experts are not checked here: convert checked every one as it read it,
    and their blobs are checksummed."""
    try:
        infos = read_safetensors_header(dense_path)
    except CheckpointError as e:
        raise StoreError(str(e)) from None
    dense, freed = {}, 0
    fd = os.open(dense_path, os.O_RDONLY)
    try:
        for name in sorted(infos):
            info, where = infos[name], f"{dense_path}: tensor {name!r}"
            if info.dtype not in TORCH_DTYPES:
                raise StoreError(f"{where}: dtype {info.dtype} is not supported ({', '.join(TORCH_DTYPES)})")
            stored = TORCH_DTYPES[info.dtype]
            if bits and quantized_at_load(name):
                kept = compute_dtype(stored, dtype)
                dense[name] = quantize_rows(lambda start, stop: _finite_rows(fd, info, start, stop, where),
                                            info.shape, bits, kept)
                freed += math.prod(info.shape) * kept.itemsize   # the quantizer's temporaries scale with this
                if freed >= TRIM_EVERY_FREED_BYTES:    # else glibc keeps them and the peak grows
                    return_freed_memory()
                    freed = 0
            else:
                tensor = check_finite(pread_tensor(fd, info.file, info.offset, info.nbytes, info.shape, stored),
                                      where, StoreError)
                dense[name] = tensor if held_as_stored(name, stored, dtype, tied) else weight_in(tensor, dtype)
    except CheckpointError as e:
        raise StoreError(str(e)) from None
    finally:
        os.close(fd)
    return dense


def _finite_rows(fd: int, info, start: int, stop: int, where: str) -> torch.Tensor:
    """Rows start..stop-1 of a stored matrix; a non-finite value anywhere in the matrix is refused
    with the whole matrix's count, as check_finite words it."""
    row = info.nbytes // info.shape[0]
    rows = pread_tensor(fd, info.file, info.offset + start * row, (stop - start) * row, (stop - start, *info.shape[1:]),
                        TORCH_DTYPES[info.dtype])
    if not all_finite(rows):
        check_finite(pread_tensor(fd, info.file, info.offset, info.nbytes, info.shape, TORCH_DTYPES[info.dtype]),
                     where, StoreError)
    return rows


# --context auto serves no fewer tokens than this where the model's context is longer: llama.cpp's
# fitting shortens a context to fit memory down to this many, and ollama serves this many by default.
MIN_AUTO_CONTEXT = 4096


@dataclass
class ServedContext:
    """serve and chat's context: `tokens`, the longest sequence served (prompt and completion), and
    why, in words; `shortened` when auto chose less than the model's context."""
    tokens: int
    why: str
    shortened: bool = False


def served_context(path: str | os.PathLike, requested: int | None, store: StoreOptions,
                   dtype: torch.dtype | None = None, dense_bits: int | str | None = "auto", kv_dtype: str = "float32",
                   root: str | os.PathLike = "/") -> ServedContext:
    """--context: `requested` tokens, at most the model's context; None (auto): the model's context,
    unless the store's RAM tier is sized by ram="auto", memory can be read, and one sequence at that
    context would leave too little room to cache every expert; then the longest of MIN_AUTO_CONTEXT
    and its doublings below the model's context that still would, else MIN_AUTO_CONTEXT (or the model's
    context, if shorter). A KV cache at the whole context can take more than the experts that would
    otherwise be cached (Qwen3-30B-A3B: 40,960 positions of float32 keys and values are 7.5 GiB), and
    a conversation rarely needs it."""
    from_store = is_store(path)
    manifest = read_manifest(Path(path)) if from_store else None
    spec = manifest.spec if from_store else _checkpoint_spec(path)
    whole = spec.max_position_embeddings
    if requested is not None:
        if requested > whole:
            raise OptionError("--context", requested, f"longer than the model's context of {whole} tokens "
                                                      f"(max_position_embeddings)")
        return ServedContext(requested, f"--context {requested}", shortened=requested < whole)
    if not from_store or store.ram != "auto":
        return ServedContext(whole, "the model's context")
    facts = read_memory_facts(root)
    if facts.available is None:
        return ServedContext(whole, "the model's context (free memory unknown)")
    needs = run_needs(manifest, dtype, dense_bits, whole, 1, kv_dtype, cap_context=True)
    shorter = [MIN_AUTO_CONTEXT << k for k in range(whole.bit_length()) if MIN_AUTO_CONTEXT << k < whole]
    for tokens in [whole, *reversed(shorter)]:
        at = {**needs, **sequence_needs(spec, tokens, kv_dtype, cap_context=True)}
        if ram_budget(facts, manifest.expert_bytes, at)[0] >= manifest.expert_bytes:
            break
    else:
        tokens = min(whole, MIN_AUTO_CONTEXT)
    if tokens == whole:
        return ServedContext(whole, "the model's context")
    reserved = needs["kv_cache"] + needs["activations"]
    return ServedContext(tokens, f"--context auto: one sequence at the model's {whole} tokens would reserve "
                                 f"{reserved / 2**20:.0f} MiB (its KV cache, a prompt chunk's attention) that "
                                 f"caching experts can use; --context {whole} serves it whole", shortened=True)


def _checkpoint_spec(path: str | os.PathLike) -> ModelSpec:
    ckpt = Checkpoint(path)
    try:
        return read_spec(ckpt)
    finally:
        ckpt.close()


def auto_ram(manifest: Manifest, dtype: torch.dtype | None = None, dense_bits: int | str | None = "auto",
             context: int | None = None, batch: int = 1, root: str | os.PathLike = "/",
             kv_dtype: str = "float32", score_windows: bool = False, cap_context: bool = False) -> tuple[int, dict]:
    """ram="auto": the RAM tier's capacity for this store and run, and its breakdown (ram_budget): the
    memory this process may still take (read under `root`), less what the run holds besides experts."""
    needs = run_needs(manifest, dtype, dense_bits, context, batch, kv_dtype, score_windows, cap_context)
    return ram_budget(read_memory_facts(root), manifest.expert_bytes, needs)


def run_needs(manifest: Manifest, dtype: torch.dtype | None, dense_bits: int | str | None, context: int | None,
              batch: int, kv_dtype: str = "float32", score_windows: bool = False,
              cap_context: bool = False) -> dict[str, int]:
    """Bytes a run of `batch` sequences of up to `context` tokens (None or more: the model's context
    length) holds besides cached experts, by name, once loaded; "kernel_compile" only where numba's
    cache lacks the kernels (kernels_compiled). score_windows: the run scores every position of a
    `context`-token window in one step (eval), else it generates (activation_bytes). cap_context:
    `context` is the model's context_length too, where each KV cache stops growing (else the model's
    own context is)."""
    spec = manifest.spec
    tokens = min(context or spec.max_position_embeddings, spec.max_position_embeddings)
    sequence = sequence_needs(spec, tokens, kv_dtype, score_windows, cap_context)
    return {"dense": dense_bytes(manifest, dtype, dense_bits),
            **{name: batch * size for name, size in sequence.items()},
            "read_buffers": read_buffer_bytes(manifest),
            "runtime": RUNTIME_GROWTH,
            **({} if kernels_compiled() else {"kernel_compile": KERNEL_COMPILE_GROWTH})}


def sequence_needs(spec: ModelSpec, tokens: int, kv_dtype: str = "float32", score_windows: bool = False,
                   cap_context: bool = False) -> dict[str, int]:
    """What one sequence of `tokens` takes (run_needs's kv_cache and activations): its KV cache,
    stopping at `tokens` with cap_context, else at the model's context, and its largest step."""
    limit = tokens if cap_context else spec.max_position_embeddings
    return {"kv_cache": kv_cache_bytes(spec, tokens, KV_DTYPES[kv_dtype], limit),
            "activations": activation_bytes(spec, tokens, score_windows)}


def dense_bytes(manifest: Manifest, dtype: torch.dtype | None, dense_bits: int | str | None) -> int:
    """The dense weights' bytes as read_store_dense keeps them: vectors in float32, matrices in the
    compute dtype, an untied embedding as stored where that is narrower (held_as_stored); with dense
    bits (dense_bits_for) each matrix that quantize_dense replaces as its quantized copy, routers in
    float32 (quantize_layer), a tied LM head's quantized copy too."""
    spec = manifest.spec
    bits = dense_bits_for(dense_bits, manifest, spec)
    tied = spec.tie_word_embeddings
    held = 0
    with safe_open(str(manifest.path / manifest.data["dense"]["file"]), framework="pt") as f:
        for name in f.keys():
            tensor = f.get_slice(name)
            shape, stored = tensor.get_shape(), TORCH_DTYPES.get(tensor.get_dtype(), torch.float32)
            numel = math.prod(shape)
            if bits and len(shape) >= 2 and quantized_at_load(name):
                held += _codes_bytes(shape, bits)
            elif bits and name.endswith(".router"):
                held += numel * 4
            else:
                kept = (torch.float32 if len(shape) < 2 else stored if held_as_stored(name, stored, dtype, tied)
                        else compute_dtype(stored, dtype))
                held += numel * kept.itemsize
            if bits and name == "embed" and tied:
                held += _codes_bytes(shape, bits)
    return held


def _codes_bytes(shape, bits: int) -> int:
    """A matrix's quantized copy (edgemoe.dense.quantize_matrix): codes, and a float32 scale and zero
    per row and group."""
    group, ngroups = group_layout(bits, GROUP_SIZE[bits], math.prod(shape[1:]))
    return shape[0] * ngroups * (group * bits // 8 + 8)


def kv_cache_bytes(spec: ModelSpec, tokens: int, dtype: torch.dtype = torch.float32, limit: int | None = None) -> int:
    """One sequence's KVCache at `tokens`: it grows by doubling from 64 positions, so its capacity
    may reach twice the tokens held; a cache with a `limit` (KVCache.limit: the context it is served
    at) stops there, holding the limit's positions and, while its last growth copies, one layer's
    old arrays beside them."""
    heads, key_dim, value_dim = spec.cache_layout
    per_token = spec.num_layers * heads * (key_dim + value_dim) * dtype.itemsize
    doubled = max(64, 2 * tokens)
    if limit is None or doubled <= limit or tokens > limit:
        return per_token * doubled
    return per_token * limit + per_token // spec.num_layers * limit


def activation_bytes(spec: ModelSpec, tokens: int, score_windows: bool = False) -> int:
    """One sequence's float32 activations in its largest step against `tokens` of context: a few
    hidden-sized tensors per token of the step, its logits, and what its attention holds at once
    (edgemoe.layers.attention_peak_bytes: a block of scores, keys and values widened). Generating,
    the step is a prefill chunk whose last token alone gets logits (MoEModel.next_logits); scoring
    windows (score_windows, edgemoe.evaluate), the step is the whole window and every position's
    logits are kept beside their log-softmax."""
    step = tokens if score_windows else min(tokens, GenerationOptions().prefill_chunk)
    logit_rows = 2 * step if score_windows else 1
    widest = max(spec.hidden_size, spec.expert_hidden, spec.num_heads * spec.head_dim)
    kv_heads, key_dim, _ = spec.cache_layout
    return (4 * (logit_rows * spec.vocab_size + step * 8 * widest)
            + attention_peak_bytes(spec.num_heads, kv_heads, key_dim, step, tokens))


def step_row_bytes(spec: ModelSpec, tokens: int) -> int:
    """A sequence's float32 rows of a step's activations, `tokens` of them in the step, besides the
    attention scores (computed one sequence at a time): a few hidden-sized tensors per token, two
    per (token, expert) pair (the routed tokens' inputs and outputs, edgemoe.quantized), and its
    logits row (edgemoe.engine's admission counts a decoding token's; a step's prompt chunks are
    bounded by the engine's step budget)."""
    widest = max(spec.hidden_size, spec.expert_hidden, spec.num_heads * spec.head_dim)
    return 4 * (spec.vocab_size + tokens * (8 * widest + 2 * spec.top_k * spec.hidden_size))


def load(path: str | os.PathLike, dtype: torch.dtype | None = None, threads: int | None = None,
         store: StoreOptions | None = None, dense_bits: int | None = None, context: int | None = None,
         batch: int = 1, kv_dtype: str = "float32", score_windows: bool = False, cap_context: bool = False,
         **options) -> MoEModel:
    """A model from a Hugging Face checkpoint directory (all in RAM) or from a store (experts tiered,
    held and run as `store` says, or StoreOptions(**options): load(path, ram="25%", policy="lfu")).
    Dense weight matrices in `dtype`, by default as the checkpoint stores them where the CPU
    computes that type natively, else float32; activations float32. threads: the kernels' thread
    count (None: the cores other processes leave free, followed as the machine's load changes).
    dense_bits: 8 or 4 quantizes the dense projections and the LM head at load (edgemoe.dense);
    "auto" (the commands' default): 4 or 8 for a store, by its experts' widths, else as loaded
    (edgemoe.dense.dense_bits_for).
    context, batch: the tokens of KV cache per sequence (None: the model's context length) and the
    sequences the caller will run at once, reserved by ram="auto" (auto_ram); score_windows: the
    caller scores every position of `context`-token windows (edgemoe.evaluate), not generates, so
    auto reserves their logits. kv_dtype: the KV cache's "float32" or "bfloat16" (edgemoe.kv_cache.KV_DTYPES).
    cap_context: `context` is also the longest sequence the model runs (model.context_length: serve and
    chat's --context), where its KV caches stop growing; a prompt that fills it is refused."""
    if store is not None and options:
        raise TypeError("load: give store=StoreOptions(...) or option keywords, not both")
    if dense_bits not in (None, "auto", "none", *DENSE_BITS):
        raise OptionError("dense_bits=", dense_bits, f"expected one of {DENSE_BITS}, 'auto' or None (as loaded)")
    if kv_dtype not in KV_DTYPES:
        raise OptionError("kv_dtype=", kv_dtype, f"expected one of {tuple(KV_DTYPES)}")
    store = store if store is not None else StoreOptions(**options)
    from_store = is_store(path)
    if from_store:
        model = load_store(path, store, dtype, threads, dense_bits=dense_bits, context=context, batch=batch,
                           kv_dtype=kv_dtype, score_windows=score_windows, cap_context=cap_context)
    else:
        given = store.given()
        if given:
            verb = "applies" if len(given) == 1 else "apply"
            raise EdgeMoEError(f"{path}: {', '.join(given)} {verb} to stores, and this is a checkpoint directory "
                               f"(make a store with edgemoe convert)")
        model = load_checkpoint(path, dtype, threads)
    dense_bits = dense_bits_for(dense_bits, model.store.manifest if from_store else None, model.spec)
    if dense_bits is not None:
        model.quantize_dense(dense_bits)
    model.kv_dtype = KV_DTYPES[kv_dtype]
    if cap_context and context is not None:
        model.context_length = min(context, model.spec.max_position_embeddings)
    if model.spec.is_encoder_decoder and model.kv_dtype != torch.float32:
        model.close()
        require_decoder_only(model.spec, path, "kv_dtype= (--kv-dtype)")
    return_freed_memory()    # the loaded weights' float copies, freed as they were converted or quantized
    return model
