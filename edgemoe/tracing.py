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
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from edgemoe.scheduling.profile import RoutingProfile, TraceRecord, TraceRecorder, read_trace
from edgemoe.store.profile_file import save_routing_profile

from .evaluate import default_context
from .options import window_length
from .replay import records_for_model
from .seq2seq import text_to_text


def trace_text(model, text: str, context: int | None = None,
               on_progress: Callable[[int, int], None] | None = None,
               max_tokens: int | None = None) -> list[TraceRecord]:
    """Every token's routing, window by window; on_progress(windows done, windows in all).
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
        records += _trace_window(model, ids[start:start + context], window)
        if on_progress:
            on_progress(window + 1, len(starts))
    return records


def _trace_window(model, tokens: torch.Tensor, window: int) -> list[TraceRecord]:
    if not model.spec.is_encoder_decoder:
        with TraceRecorder(model, seq=window) as recorder:
            model.logits(tokens)
        return recorder.records
    if tokens.numel() < 2:
        return []
    pair = text_to_text(tokens, model.spec.decoder_start_token_id)
    with TraceRecorder(model, seq=f"{window}/encoder") as encoder:
        source = model.encode(pair.source)
    with TraceRecorder(model, seq=f"{window}/decoder") as decoder:
        model.decode(pair.decoder_input, model.start(source))
    return encoder.records + decoder.records


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
        if trace is not None:   # numbered as this model's layers, as replayed
            records = records_for_model(read_trace(trace), model.spec.moe_layer_ids, str(trace))
        else:
            records = trace_text(model, text, context, on_progress)
        profile = build_profile(model, records, min_count)
        save_routing_profile(store, profile)
    return profile
