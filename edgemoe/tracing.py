"""Routing traces of a model over a text, and the store's routing profile built from them
(`edgemoe trace`, `edgemoe profile`, and convert with a calibration text).

The text is cut into consecutive windows of `context` tokens, each run from an empty KV cache as
its own sequence (trace "seq" = window number), so every token is routed once.

An encoder-decoder model (Seq2SeqModel) reads each window as text-to-text (edgemoe.seq2seq.text_to_text):
the encoder's layers route the source, the decoder's layers the teacher-forced decoder input. The two
are different token streams, so they are two sequences, "W/encoder" and "W/decoder" (W the window
number): a token's routing then holds the layers of one stack only, and the profile's layer-to-layer
counts (P(expert at l | experts at l-1, l-2)) never pair an encoder token's layer with a decoder
token's. A trailing window of one token has no target and is left out.

TraceRecorder records a model's routing through the model's add_routing_hook; it lives here, beside
the model it observes, so that the scheduling layer (the profile and the trace format) knows no model.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch

from edgemoe.scheduling.predictor_choice import compare_predictors
from edgemoe.scheduling.preload import next_moe_layers
from edgemoe.scheduling.profile import RoutingProfile, TraceRecord, read_trace
from edgemoe.store.profile_file import save_routing_profile

from .evaluate import default_context
from .options import window_length
from .replay import records_for_model
from .seq2seq import text_to_text


class TraceRecorder:
    """Records a model's routing while active:

        with TraceRecorder(model) as rec:
            model.logits(ids)
        write_trace("trace.jsonl", rec.records)

    "seq" is the given label, else the number of the segment's sequence in order of first appearance
    (the segment index of the first step; stable when a batch drops finished sequences, because
    sequences are told apart by their KV cache). A pass without segments (Seq2SeqModel's) is one
    sequence: the given label, else 0."""

    def __init__(self, model, seq: int | str | None = None):
        self.model = model
        self.seq = seq
        self.records: list[TraceRecord] = []
        self._seq_of_cache: dict[int, tuple[object, int]] = {}   # id(cache) -> (cache kept alive, number)

    def __enter__(self) -> "TraceRecorder":
        self.model.add_routing_hook(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        self.model.remove_routing_hook(self._hook)

    def _seq(self, segment) -> int | str:
        if self.seq is not None:
            return self.seq
        cache = segment.cache
        known = self._seq_of_cache.setdefault(id(cache), (cache, len(self._seq_of_cache)))
        return known[1]

    def _hook(self, layer, experts, weights, positions, segments) -> None:
        experts, weights, positions = experts.tolist(), weights.tolist(), positions.tolist()   # [T, A], [T, A], [T]
        if not segments:    # a pass of one sequence without segments (Seq2SeqModel's encoder or decoder)
            seq = 0 if self.seq is None else self.seq
            self.records += [TraceRecord(seq, p, layer, e, w) for p, e, w in zip(positions, experts, weights)]
            return
        t = 0
        for segment in segments:
            seq = self._seq(segment)
            for _ in range(segment.num_tokens):
                self.records.append(TraceRecord(seq, positions[t], layer, experts[t], weights[t]))
                t += 1


class LookaheadRecorder(TraceRecorder):
    """Records, in place of each MoE layer's routing, the gate look-ahead's guess of it: that layer's
    router applied to the MoE input of the MoE layer before it in the stack (what the "lookahead"
    preloader issues, edgemoe.scheduling.preload). Layers without one (a stack's first) are not recorded."""

    def __init__(self, model, seq: int | str | None = None):
        super().__init__(model, seq)
        self.next_moe = next_moe_layers(model.spec)
        self._guesses: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __enter__(self) -> "LookaheadRecorder":
        self.model.add_moe_input_hook(self._guess)
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        self.model.remove_moe_input_hook(self._guess)
        super().__exit__(*exc)

    def _guess(self, layer: int, hidden: torch.Tensor) -> None:
        nxt = self.next_moe.get(layer)
        if nxt is not None:
            weights, experts = self.model.route(nxt, hidden)
            self._guesses[nxt] = (experts, weights)

    def _hook(self, layer, experts, weights, positions, segments) -> None:
        guess = self._guesses.pop(layer, None)
        if guess is not None:
            super()._hook(layer, guess[0], guess[1], positions, segments)


def profile_text(model, text: str, context: int | None = None, min_count: int = 3,
                 on_progress: Callable[[int, int], None] | None = None,
                 max_tokens: int | None = None) -> tuple[RoutingProfile, dict]:
    """The routing profile of a text (its first max_tokens tokens, if given), and which predictor
    (correlation table or gate look-ahead) guessed the text's routing better
    (edgemoe.scheduling.predictor_choice), for save_routing_profile."""
    lookahead: list[TraceRecord] = []
    records = trace_text(model, text, context, on_progress, lookahead, max_tokens)
    spec = model.spec
    choice = compare_predictors(records, lookahead, spec.moe_layer_ids, spec.num_experts, spec.top_k, min_count)
    return build_profile(model, records, min_count), choice


def trace_text(model, text: str, context: int | None = None,
               on_progress: Callable[[int, int], None] | None = None,
               lookahead: list[TraceRecord] | None = None, max_tokens: int | None = None) -> list[TraceRecord]:
    """Every token's routing, window by window; on_progress(windows done, windows in all). lookahead:
    a list to which the gate look-ahead's guesses are added, as a trace (LookaheadRecorder).
    max_tokens: only the text's first tokens (the routing of each is as in the whole text's trace:
    windows start at the same tokens and see only earlier ones)."""
    if model.tokenizer is None:
        raise ValueError("trace: this model has no tokenizer")
    ids = torch.tensor(model.tokenizer.encode(text, add_special_tokens=False))[:max_tokens]
    if ids.numel() == 0:
        raise ValueError("trace: the text has no tokens")
    context = window_length(context, "context=", model.context_length) or default_context(model)
    records: list[TraceRecord] = []
    starts = range(0, ids.numel(), context)
    for window, start in enumerate(starts):
        records += _trace_window(model, ids[start:start + context], window, lookahead)
        if on_progress:
            on_progress(window + 1, len(starts))
    return records


def _trace_window(model, tokens: torch.Tensor, window: int, lookahead: list | None = None) -> list[TraceRecord]:
    if not model.spec.is_encoder_decoder:
        with _recorders(model, window, lookahead) as recorder:
            model.logits(tokens)
        return recorder.records
    if tokens.numel() < 2:
        return []
    pair = text_to_text(tokens, model.spec.stacks.decoder_start_token_id)
    with _recorders(model, f"{window}/encoder", lookahead) as encoder:
        source = model.encode(pair.source)
    with _recorders(model, f"{window}/decoder", lookahead) as decoder:
        model.decode(pair.decoder_input, model.start(source))
    return encoder.records + decoder.records


@contextmanager
def _recorders(model, seq, lookahead: list | None):
    """A TraceRecorder labelled `seq`; with `lookahead`, also a LookaheadRecorder whose records go there."""
    with TraceRecorder(model, seq=seq) as recorder:
        if lookahead is None:
            yield recorder
            return
        with LookaheadRecorder(model, seq=seq) as guesses:
            yield recorder
        lookahead += guesses.records


def build_profile(model, records: list[TraceRecord], min_count: int = 3) -> RoutingProfile:
    spec = model.spec
    return RoutingProfile.from_trace(records, moe_layers=spec.moe_layer_ids, num_experts=spec.num_experts,
                                     top_k=spec.top_k, min_count=min_count)


def profile_store(store: str | Path, text: str | None = None, trace: str | Path | None = None,
                  context: int | None = None, min_count: int = 3, threads: int | None = None,
                  on_progress: Callable[[int, int], None] | None = None) -> RoutingProfile:
    """Profile a store from a text (run the store's own quantized model) or a recorded trace; save it."""
    import edgemoe

    if (text is None) == (trace is None):
        raise ValueError("profile: give a text or a trace (exactly one)")
    with edgemoe.load(store, threads=threads, preload="none") as model:
        if trace is not None:   # numbered as this model's layers, as replayed; no hidden states to look ahead from
            records = records_for_model(read_trace(trace), model.spec.moe_layer_ids, str(trace))
            profile, choice = build_profile(model, records, min_count), None
        else:
            profile, choice = profile_text(model, text, context, min_count, on_progress)
        save_routing_profile(store, profile, choice)
    return profile
