"""Speculative decoding: a draft proposes n tokens, the target checks them all in one forward step.

The draft is another model with the target's tokenizer (its own KV cache), or the target itself
with low-width experts ("self"): the target's dense weights and KV cache, and
  - from a store with fallback copies (convert --fallback-bits): whatever the store's RAM tier holds
    of each expert, the expert or its narrowed copy, else the copy read from disk and cached in the
    RAM tier (FallbackDraftExperts): the draft reads only copies, and they count against --ram;
  - from a checkpoint, or a store whose RAM is unbounded: each expert re-quantized to INT2 the first
    time the draft uses it and held in RAM beside the experts (LowWidthExperts);
  - from a store with a RAM budget and no fallback copies: no draft, speculation off (one warning):
    the draft would read full experts from disk to propose tokens whose reads it is meant to save.

Under a RAM budget smaller than the store's experts, speculation is also measured against plain
decoding once (the first PROBE_TOKENS tokens decoded plainly, then as many speculatively): where
it read more expert bytes per token, it is turned off with one warning and decoding goes on plainly.

A round, with the KV cache holding every committed token but the last one, c:
  draft:  n forward steps from c -> proposals d1..dn, with their distributions q1..qn
  verify: the target on [c, d1..dn] (T = n + 1 tokens, one segment) -> p1..p(n+1)
  accept: greedy: d_i while it is the target's argmax, then the target's own token;
          sampling (Leviathan et al., Chen et al.): d_i with probability min(1, p_i(d_i) / q_i(d_i)),
          else a token from norm(max(0, p_i - q_i)) and stop; all accepted: one from p(n+1)
  rollback: both caches truncated past the first rejected proposal.
p and q are the distributions sampling draws from (temperature, top-k, top-p applied to both:
generate.sampling_probs), so the output has the target's distribution; greedy output is plain
greedy decoding's, token for token (tested): greedy verification computes each position as its
one-token step would, bit for bit (MoEModel.logits, one_token_at_a_time), in every dtype.

Expert prefetch (SP-MoE): while the draft runs, the target's router at each MoE layer, applied to
the draft's input of that layer, names the experts verification will need; those the store neither
holds nor is reading are handed to its loader, at most as many per round as the disk can read in
the draft's time (the last rounds' draft seconds / the disk's seconds per read). With a self-draft
those inputs are the target's own layer inputs (to the draft's accuracy), so the prediction is the
draft's own routing. A separate draft with the target's hidden size and layer count is treated the
same way; any other shape gets no draft prefetch (no draft layer corresponds to a target layer),
and the target's own preloader (routing profile or look-ahead) still runs during verification.

Shapes: n proposals per round, T = n + 1 verified tokens, V vocab, D hidden, E experts.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from edgemoe import kernels
from edgemoe.quant import QuantizedTensor, quantize

from .errors import DraftError
from .experts import Activation, ExpertProvider, WeightSource
from .generate import (Event, Feed, Generation, GenerationOptions, decode, last_logits, sampling_probs,
                       token_ids)
from .kv_cache import KVCache
from .loader import require_decoder_only
from .model import MoEModel
from .options import OptionError
from .quantized import QuantizedExpert, StoreExperts

DRAFT_BITS = 2
# INT2 with one scale per 64 weights: per-row INT2 loses too much of a trained expert to propose
# well, and a group of 64 adds one bit per weight (float32 scale and zero), half the INT2 codes.
DRAFT_GROUP = 64
# Tokens decoded plainly, then at least as many speculatively, whose expert bytes read per token
# decide (once per Speculator) whether speculation stays on under a RAM budget. Short: the probe's
# plain tokens are decoded without speculation's gain; long enough that a round or two is measured.
PROBE_TOKENS = 4


# ---- the self-draft's experts ---------------------------------------------------------------------
class LowWidthExpert:
    """An expert re-quantized for the draft: its matrices (gate, up [I, D], down [D, I]; no gate
    when ungated) as INT2 QuantizedTensors, computed as the target's expert of that kind is."""

    def __init__(self, tensors: dict[str, QuantizedTensor], activation: Activation = None):
        self.tensors = tensors
        self.activation = activation   # None: SwiGLU, on the fused kernel
        self.nbytes = sum(qt.nbytes for qt in tensors.values())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        t = self.tensors
        if self.activation is not None:
            return self.activation(x.float(), lambda h, role: torch.from_numpy(
                kernels.qmatmul(h.contiguous().numpy(), t[role]))).to(x.dtype)
        y = kernels.swiglu_expert(x.float().contiguous().numpy(), t["gate"], t["up"], t["down"])
        return torch.from_numpy(y).to(x.dtype)


class LowWidthExperts(ExpertProvider):
    """The target's experts re-quantized to INT2 (DRAFT_GROUP weights per scale) the first time the
    draft asks for each, from the weights its `source` gives (the target's provider: a store's stored
    codes, dequantized; a checkpoint's matrices). Kept in RAM within `capacity` bytes (None: all of
    them), least recently used dropped first; the copy is the draft's own memory, outside the store's --ram."""

    def __init__(self, source: WeightSource, capacity: int | None = None):
        self.source = source
        self.capacity = capacity
        self.copies: OrderedDict[tuple[int, int], LowWidthExpert] = OrderedDict()
        self.nbytes = 0           # bytes of the copies held now
        self.built = 0            # copies made (one dropped and made again counts twice)
        self.build_seconds = 0.0  # time spent reading and re-quantizing them

    def expert(self, layer: int, expert: int) -> LowWidthExpert:
        key = (layer, expert)
        copy = self.copies.get(key)
        if copy is not None:
            self.copies.move_to_end(key)
            return copy
        start = time.perf_counter()
        weights = self.source.float_weights(layer, expert)
        copy = LowWidthExpert({role: quantize(w, DRAFT_BITS, DRAFT_GROUP) for role, w in weights.items()},
                              self.source.activation(layer, expert))
        self.build_seconds += time.perf_counter() - start
        self.built += 1
        self._keep(key, copy)
        return copy

    def _keep(self, key: tuple[int, int], copy: LowWidthExpert) -> None:
        if self.capacity is not None and copy.nbytes > self.capacity:
            return   # larger than the whole cap: used once, not kept
        while self.capacity is not None and self.nbytes + copy.nbytes > self.capacity:
            _, dropped = self.copies.popitem(last=False)
            self.nbytes -= dropped.nbytes
        self.copies[key] = copy
        self.nbytes += copy.nbytes


class FallbackDraftExperts(ExpertProvider):
    """The self-draft's experts from a store with fallback copies: each asked of the store as a weakly
    chosen expert is (TieredStore.get(fallback=True)), so a resident expert or copy serves it, one
    being read waits for that read, and a miss reads the narrowed copy, never the expert itself, and
    caches it in the RAM tier, within --ram. Computed as the target computes its experts. No
    begin_layer: the draft's layers do not move the store's notion of the running layer."""

    def __init__(self, target: StoreExperts):
        self.target = target

    def expert(self, layer: int, expert: int) -> QuantizedExpert:
        t = self.target
        return QuantizedExpert(t.store.get(layer, expert, fallback=True), t.choose, t.store.device,
                               t.activation(layer, expert), t.gemm_dtype)


def no_self_draft(target: MoEModel) -> str | None:
    """Why the target cannot draft for itself without reading full experts from disk under its RAM
    budget, and what to do (None: it can)."""
    store = target.store
    if store is None or store.manifest.fallback or store.ram_capacity is None:
        return None
    return (f"{store.path}: no fallback copies, so a self-draft would read full experts from disk to draft "
            f"under the RAM budget (convert with --fallback-bits 2 for a self-draft, or give --draft a smaller model)")


def self_draft(target: MoEModel, capacity: int | None = None) -> MoEModel:
    """The target with low-width experts: a store's fallback copies (FallbackDraftExperts) where it
    has them, else INT2 copies (LowWidthExperts within `capacity` bytes); the same dense tensors
    (shared, not copied), tokenizer and thread governor. DraftError where it would read full experts
    under a RAM budget (no_self_draft)."""
    require_decoder_only(target.spec, target.name, "speculative decoding (--draft)")
    cannot = no_self_draft(target)
    if cannot is not None:
        raise DraftError(cannot)
    if target.store is not None and target.store.manifest.fallback:
        if capacity is not None:
            raise OptionError("draft_ram=", capacity, "the store's fallback copies the self-draft uses are held "
                              "in its RAM tier, within the store's RAM budget")
        experts, name = FallbackDraftExperts(target.experts), f"INT{target.store.manifest.fallback_bits} fallback"
    else:
        experts, name = LowWidthExperts(target.experts, capacity), f"INT{DRAFT_BITS}"
    draft = MoEModel(target.spec, target.dense_weights(), experts, target.tokenizer,
                     target.generation_config, name=f"{target.name} ({name} self-draft)", threads=1)
    draft.threads = target.threads
    return draft


def check_draft(target: MoEModel, draft: MoEModel, where: str) -> None:
    """A draft must propose the target's tokens: same vocabulary size and tokenizer (DraftError
    naming `where`, the draft's path, otherwise)."""
    if draft.spec.vocab_size != target.spec.vocab_size:
        raise DraftError(f"{where}: the draft's vocabulary has {draft.spec.vocab_size} tokens and the target's "
                         f"{target.spec.vocab_size}: a draft needs the target's tokenizer")
    if draft.tokenizer is None or target.tokenizer is None:
        missing = where if draft.tokenizer is None else target.name
        raise DraftError(f"{missing}: no tokenizer.json, so the draft's tokens cannot be checked against the target's")
    difference = target.tokenizer.difference(draft.tokenizer)
    if difference:
        raise DraftError(f"{where}: the draft's tokenizer is not the target's: {difference}")


# ---- accepting proposals --------------------------------------------------------------------------
def accept(target_logits: torch.Tensor, proposals: Sequence[int], draft_probs: torch.Tensor | None,
           opts: GenerationOptions, generator: torch.Generator) -> tuple[int, int]:
    """(k, token): the first k proposals are accepted, and `token` follows them. target_logits
    [n + 1, V] are the target's at [c, d1..dn]; draft_probs [n, V] the q the proposals were drawn
    from (None when greedy)."""
    n = len(proposals)
    if opts.temperature == 0:
        chosen = torch.argmax(target_logits, dim=-1).tolist()
        k = next((i for i in range(n) if chosen[i] != proposals[i]), n)
        return k, chosen[k]
    for i, d in enumerate(proposals):
        p, q = sampling_probs(target_logits[i], opts), draft_probs[i]
        # Accept with probability min(1, p(d) / q(d)); q(d) > 0 since d was drawn from q.
        if float(torch.rand((), generator=generator)) * float(q[d]) < float(p[d]):
            continue
        residual = torch.clamp(p - q, min=0)
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return n, int(torch.multinomial(sampling_probs(target_logits[n], opts), 1, generator=generator))


# ---- is it worth it? ------------------------------------------------------------------------------
class ReadProbe:
    """Expert bytes a store read per token, decoding plainly for the first `tokens` tokens, then
    speculatively for at least as many: what turns speculation off under a RAM budget. Each window
    ends with the store's queued preloads drained, so that the reads a mode asked for count in it."""

    def __init__(self, store, tokens: int, num_draft: int):
        self.store, self.tokens, self.num_draft = store, tokens, num_draft
        self.plain = [0, 0]        # bytes read, tokens
        self.speculative = [0, 0]

    def bytes_read(self) -> int:
        return self.store.stats.disk_bytes_read

    def plain_tokens_wanted(self) -> int:
        return max(0, self.tokens - self.plain[1])

    def decoded_plainly(self, read_before: int, tokens: int) -> None:
        self._add(self.plain, read_before, tokens, self.plain[1] + tokens >= self.tokens)

    def speculated(self, read_before: int, tokens: int) -> bool:
        """Count a round; True once speculation has been measured over enough tokens."""
        done = self.speculative[1] + tokens >= self.tokens
        self._add(self.speculative, read_before, tokens, done)
        return done

    def _add(self, window: list[int], read_before: int, tokens: int, last: bool) -> None:
        if last:
            self.store.drain()
        window[0] += self.bytes_read() - read_before
        window[1] += tokens

    def verdict(self) -> str | None:
        """Why speculation is off (it read more per token than plain decoding), or None."""
        plain, speculative = (w[0] / max(1, w[1]) for w in (self.plain, self.speculative))
        if speculative <= plain:
            return None
        return (f"speculative decoding off: it read {speculative / 2**10:.0f} KiB of experts per token over "
                f"{self.speculative[1]} tokens (n = {self.num_draft}) against {plain / 2**10:.0f} KiB for plain "
                f"decoding over {self.plain[1]}, under a RAM budget of {self.store.ram_capacity / 2**20:.1f} MiB; "
                f"decoding plainly from here")


# ---- the decoder ----------------------------------------------------------------------------------
@dataclass
class SpeculationStats:
    rounds: int = 0
    drafted: int = 0            # proposals made
    accepted: int = 0           # proposals the target accepted
    emitted: int = 0            # tokens output (accepted + one per round + the prefill's)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    prefetched: int = 0         # experts handed to the store's loader on the draft's prediction
    prefetched_used: int = 0    # of them, routed to by the next verification
    draft_copy_bytes: int | None = None   # a self-draft's INT2 experts held in RAM now
    plain_tokens: int = 0       # tokens decoded plainly after a prompt's first (the probe's, or speculation off)
    plain_seconds: float = 0.0
    off: str | None = None      # why speculation was turned off (None: it is on)

    @property
    def decode_seconds(self) -> float:
        """Time decoding tokens after each prompt's first: drafts, verifications and plain steps."""
        return self.draft_seconds + self.verify_seconds + self.plain_seconds

    @property
    def seconds_per_token(self) -> float | None:
        """Decode time per token after the first (which prefill makes)."""
        return self.decode_seconds / (self.emitted - 1) if self.emitted > 1 else None

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def prefetch_precision(self) -> float | None:
        return self.prefetched_used / self.prefetched if self.prefetched else None

    def to_dict(self) -> dict:
        return {**self.__dict__, "acceptance_rate": self.acceptance_rate,
                "prefetch_precision": self.prefetch_precision, "seconds_per_token": self.seconds_per_token}


class Speculator:
    """Speculative decoding of `target` with `draft`, `num_draft` proposals per round. The draft
    shares the target's KV cache when `shares_cache` (a self-draft: the same dense weights, so the
    target's keys and values of committed tokens are the draft's best ones too); else it has its own.
    probe_tokens: under a RAM budget smaller than the target store's experts, decode this many tokens
    plainly, then at least as many speculatively, and turn speculation off where it read more expert
    bytes per token (0: never). off: a reason speculation is off from the start (draft None then)."""

    def __init__(self, target: MoEModel, draft: MoEModel | None, num_draft: int = 4, shares_cache: bool = False,
                 probe_tokens: int = PROBE_TOKENS, off: str | None = None):
        if num_draft < 1:
            raise ValueError(f"num_draft must be >= 1, got {num_draft}")
        if draft is None and off is None:
            raise ValueError("Speculator: no draft, and no reason given for speculation to be off")
        self.target, self.draft, self.num_draft, self.shares_cache = target, draft, num_draft, shares_cache
        self.stats = SpeculationStats(off=off)
        self._warned = False
        store = target.store
        self.prefetches = (store is not None and draft is not None and draft.spec.hidden_size == target.spec.hidden_size
                           and draft.spec.num_layers == target.spec.num_layers)
        under_budget = store is not None and store.ram_capacity is not None and \
            store.ram_capacity < store.manifest.expert_bytes
        self._probe = ReadProbe(store, probe_tokens, num_draft) if under_budget and probe_tokens and off is None \
            else None
        self._draft_seconds: float | None = None    # moving average of a round's draft time
        self._round_prefetched: set[tuple[int, int]] = set()
        self._budget = 0

    def __enter__(self) -> "Speculator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the draft (a separate draft's store; a self-draft holds none). The target stays open."""
        if self.draft is not None:
            self.draft.close()

    # ---- one prompt -------------------------------------------------------------------------------
    def stream(self, prompt_ids: Sequence[int], opts: GenerationOptions,
               warn: Callable[[str], None] | None = None) -> Iterator[int]:
        """New token ids for one prompt, as generate.stream_tokens yields them (same arguments)."""
        yield from token_ids(self.decode(Generation(self.target, prompt_ids, opts, warn)))

    def decode(self, generation: Generation) -> Iterator[Event]:
        """The events of a generation of the target, decoded speculatively (a driver of generate's loop,
        as generate.decode is): the prompt as plain decoding feeds it, to the first new token, then
        draft-verify rounds whose tokens the generation accepts (stops, limit, stop strings its own).
        Plainly instead while the probe measures plain decoding, and once speculation is off."""
        if self.draft is not None:
            generation.bound_context(self.draft.context_length)
        plain = decode(generation)
        for event in plain:         # the prompt, in chunks, and the first new token
            self.stats.emitted += len(event.token_ids)
            yield event
            break
        yield from self._plain(generation, plain, self._probe.plain_tokens_wanted() if self._probe else 0)
        if generation.finished or self._is_off(generation):
            yield from self._plain(generation, plain)
            return
        cache = generation.feed.state
        draft_cache = cache if self.shares_cache else self.draft.new_cache()
        tokens = generation.prompt + generation.output
        while not generation.finished:
            n = min(self.num_draft, generation.limit - len(generation.output) - 1)
            read_before = self._probe.bytes_read() if self._probe else 0
            emitted = 0
            for token in self._round(tokens, n, cache, draft_cache, generation.opts, generation.generator):
                event = generation.accept(token)
                self.stats.emitted += len(event.token_ids)
                emitted += len(event.token_ids)
                yield event
                if generation.finished:
                    break
            if self._probe is not None and self._probe.speculated(read_before, emitted):
                self._decide()
                if self._is_off(generation):
                    yield from self._plain(generation, plain)
                    return

    def _plain(self, generation: Generation, plain: Iterator[Event], tokens: int | None = None) -> Iterator[Event]:
        """Plain decoding's next events (`tokens` of them, None: to the end), timed; counted by the
        probe while it measures plain decoding."""
        done = 0
        while (tokens is None or done < tokens) and not generation.finished:
            read_before = self._probe.bytes_read() if self._probe else 0
            start = time.perf_counter()
            event = next(plain)
            self.stats.plain_seconds += time.perf_counter() - start
            self.stats.plain_tokens += len(event.token_ids)
            self.stats.emitted += len(event.token_ids)
            if self._probe is not None and tokens is not None:
                self._probe.decoded_plainly(read_before, len(event.token_ids))
            done += 1
            yield event

    def _decide(self) -> None:
        """The probe has measured both ways: off (once) where speculation read more per token."""
        self.stats.off = self._probe.verdict()
        self._probe = None

    def _is_off(self, generation: Generation) -> bool:
        """Speculation is off: said once per Speculator, through the generation's warning channel."""
        if self.stats.off is None:
            return False
        if not self._warned:
            generation.warn(self.stats.off)
            self._warned = True
        return True

    def _round(self, tokens: list[int], n: int, cache: KVCache, draft_cache: KVCache,
               opts: GenerationOptions, generator) -> list[int]:
        """One draft-verify round: the new tokens (accepted proposals, then the target's), appended
        to tokens. The caches hold tokens[:-1] afterwards (the draft's at most that)."""
        committed = len(tokens) - 1
        start = time.perf_counter()
        proposals, draft_probs = self._propose(tokens, n, draft_cache, opts, generator)
        drafted = time.perf_counter()
        cache.truncate(committed)   # a shared cache holds the draft's keys past c: the target's replace them
        logits, used = self._verify([tokens[-1]] + proposals, cache, greedy=opts.temperature == 0)
        k, token = accept(logits, proposals, draft_probs, opts, generator)
        cache.truncate(committed + k + 1)
        draft_cache.truncate(min(draft_cache.length, committed + k + 1))
        self._count(n, k, drafted - start, time.perf_counter() - drafted, used)
        new = proposals[:k] + [token]
        tokens.extend(new)
        return new

    def _verify(self, run: list[int], cache: KVCache, greedy: bool) -> tuple[torch.Tensor, set[tuple[int, int]]]:
        """The target's logits [n + 1, V] on [c, d1..dn] in one step, and the experts it routed to.
        Greedy: each position computed as its one-token step (MoEModel.logits one_token_at_a_time),
        so that the output is plain greedy decoding's bit for bit, at the compute of n + 1 one-token
        steps. Sampling promises the target's distribution, not its bits: one batched step."""
        used: set[tuple[int, int]] = set()

        def record(layer, experts, weights, positions, segments):
            used.update((layer, e) for e in experts.reshape(-1).tolist())

        self.target.add_routing_hook(record)
        try:
            return self.target.logits(run, cache, one_token_at_a_time=greedy), used
        finally:
            self.target.remove_routing_hook(record)

    def _propose(self, tokens: list[int], n: int, draft_cache: KVCache, opts: GenerationOptions,
                 generator) -> tuple[list[int], torch.Tensor | None]:
        """n proposals from the draft, fed what its cache lacks first, and (sampling) their
        distributions [n, V]."""
        self._start_prefetch()
        feed = Feed(draft_cache, tokens[draft_cache.length:], opts.prefill_chunk)
        proposals, probs = [], []
        try:
            for _ in range(n):
                logits = last_logits(self.draft, feed)
                if opts.temperature == 0:
                    proposals.append(int(torch.argmax(logits)))
                else:
                    probs.append(sampling_probs(logits, opts))
                    proposals.append(int(torch.multinomial(probs[-1], 1, generator=generator)))
                feed.pending = proposals[-1:]
        finally:
            self._stop_prefetch()
        return proposals, torch.stack(probs) if probs else None

    # ---- prefetch ---------------------------------------------------------------------------------
    def _start_prefetch(self) -> None:
        self._round_prefetched = set()
        if not self.prefetches:
            return
        unlimited = self.target.spec.num_layers * self.target.spec.num_experts
        reads = self.target.store.disk.reads_within(self._draft_seconds)
        # nothing measured yet: every predicted expert
        self._budget = unlimited if reads is None else min(unlimited, int(reads))
        self.draft.add_moe_input_hook(self._predict)

    def _stop_prefetch(self) -> None:
        self.draft.remove_moe_input_hook(self._predict)

    def _predict(self, layer: int, hidden: torch.Tensor) -> None:
        """At the draft's MoE input of `layer` (hidden [S, D]): the target's router on it names the
        experts verification will use; prefetch those not held, within the round's budget."""
        if not self.target.spec.moe_layers[layer] or len(self._round_prefetched) >= self._budget:
            return
        _, experts = self.target.route(layer, hidden)
        store = self.target.store
        wanted = store.missing(sorted({(layer, e) for e in experts.reshape(-1).tolist()} - self._round_prefetched))
        wanted = wanted[:self._budget - len(self._round_prefetched)]
        store.prefetch(wanted)
        self._round_prefetched.update(wanted)

    def _count(self, n: int, k: int, draft_seconds: float, verify_seconds: float, used: set) -> None:
        s = self.stats
        s.rounds += 1
        s.drafted += n
        s.accepted += k
        s.draft_seconds += draft_seconds
        s.verify_seconds += verify_seconds
        s.prefetched += len(self._round_prefetched)
        s.prefetched_used += len(self._round_prefetched & used)
        if isinstance(self.draft.experts, LowWidthExperts):
            s.draft_copy_bytes = self.draft.experts.nbytes
        previous = self._draft_seconds
        self._draft_seconds = draft_seconds if previous is None else 0.8 * previous + 0.2 * draft_seconds


def speculator_for(target: MoEModel, draft: str | os.PathLike, num_draft: int = 4, draft_ram: int | None = None,
                   dtype: torch.dtype | None = None, threads: int | None = None,
                   probe_tokens: int = PROBE_TOKENS) -> Speculator:
    """A Speculator for `target`: draft "self" (self_draft; draft_ram: the INT2 copy's cap, None:
    none), off where the target cannot draft for itself within its RAM budget (no_self_draft), or a
    checkpoint directory or store that edgemoe.load opens (dtype, threads as there), checked to share
    the target's tokenizer (DraftError otherwise). probe_tokens: as Speculator's."""
    from .loader import load

    if str(draft) == "self":
        cannot = no_self_draft(target)
        if cannot is not None:
            require_decoder_only(target.spec, target.name, "speculative decoding (--draft)")
            return Speculator(target, None, num_draft, off=f"speculative decoding off: {cannot}")
        return Speculator(target, self_draft(target, draft_ram), num_draft, shares_cache=True,
                          probe_tokens=probe_tokens)
    if draft_ram is not None:
        raise OptionError("draft_ram=", draft_ram, "only with draft='self' (a separate draft is held as it loads)")
    model = load(draft, dtype, threads)
    try:
        check_draft(target, model, str(draft))
    except DraftError:
        model.close()
        raise
    return Speculator(target, model, num_draft, probe_tokens=probe_tokens)
