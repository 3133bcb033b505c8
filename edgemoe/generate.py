"""Token generation: greedy or sampled (temperature, top-k, top-p, seeded), stop tokens and strings,
streaming, and several sequences decoded together.

Sampling applies temperature, then top-k, then top-p, as transformers' logits warpers do.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from .errors import ContextLengthError, EdgeMoEError
from .model import MoEModel, Segment
from .tokenizer import StreamDecoder


@dataclass
class GenerationOptions:
    max_new_tokens: int = 128
    temperature: float = 0.0          # 0: greedy
    top_k: int = 0                    # 0: off
    top_p: float = 1.0                # 1: off
    seed: int | None = None
    stop_token_ids: Sequence[int] | None = None  # None: the model's eos tokens
    stop_strings: Sequence[str] = field(default_factory=tuple)
    prefill_chunk: int = 512          # prompt tokens per step: each expert is read once per chunk
    truncate: bool = False            # a prompt past the context: keep its last tokens (else refuse it)

    def __post_init__(self):
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")


def defaults_from(generation_config: dict) -> dict:
    """Sampling defaults from a checkpoint's generation_config.json (greedy unless it says do_sample)."""
    if not generation_config.get("do_sample", False):
        return {}
    return {k: generation_config[k] for k in ("temperature", "top_k", "top_p") if generation_config.get(k) is not None}


def eos_token_ids(model: MoEModel) -> list[int]:
    ids = model.generation_config.get("eos_token_id")
    if ids is None and model.tokenizer is not None:
        ids = model.tokenizer.eos_token_id
    if ids is None:
        return []
    return [ids] if isinstance(ids, int) else list(ids)


def next_token(logits: torch.Tensor, opts: GenerationOptions, generator: torch.Generator | None) -> int:
    """Choose the next token from float32 logits [V]; an error, not a garbage token or a failed draw,
    when they hold a nan or +inf (finite weights, checked at load, whose computation overflowed)."""
    if bool(torch.isnan(logits).any() or torch.isposinf(logits).any()):
        raise EdgeMoEError("generate: the model computed non-finite logits (nan or inf): an overflow in its dtype?")
    if opts.temperature == 0:
        return int(torch.argmax(logits))
    return int(torch.multinomial(sampling_probs(logits, opts), 1, generator=generator))


def sampling_probs(logits: torch.Tensor, opts: GenerationOptions) -> torch.Tensor:
    """The distribution sampling draws from: float32 logits [V] -> probabilities [V] after
    temperature, top-k and top-p (opts.temperature > 0). Speculative decoding applies the same to
    the draft's and the target's logits."""
    logits = logits / opts.temperature
    if opts.top_k:
        kth = torch.topk(logits, min(opts.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if opts.top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) >= opts.top_p  # keep the smallest set >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return torch.softmax(logits, dim=-1)


def fit_context(model: MoEModel, prompt_ids: Sequence[int], opts: GenerationOptions,
                warn: Callable[[str], None]) -> list[int]:
    """The prompt as it fits the model's context (positions 0 .. context - 1). One that leaves no room
    for a new token is refused, or with opts.truncate cut from the left: its last tokens are kept,
    leaving room for max_new_tokens but at most half the context."""
    limit, n = model.context_length, len(prompt_ids)
    if n < limit:
        return list(prompt_ids)
    if not opts.truncate:
        raise ContextLengthError(f"the prompt has {n} tokens and the model's context is {limit} "
                                 f"(max_position_embeddings): shorten it, or truncate it from the left "
                                 f"(--truncate, truncate=True)")
    keep = limit - min(max(opts.max_new_tokens, 1), limit // 2)
    warn(f"prompt truncated from the left to its last {keep} of {n} tokens (the model's context is {limit})")
    return list(prompt_ids[n - keep:])


def new_token_limit(model: MoEModel, prompt_length: int, opts: GenerationOptions) -> int:
    """New tokens a sequence may get: max_new_tokens, or fewer where the context ends first."""
    return min(opts.max_new_tokens, model.context_length - prompt_length)


def make_generator(seed: int | None) -> torch.Generator:
    """The sampling generator: seeded, or from fresh entropy."""
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def generate_batch(model: MoEModel, prompts: Sequence[Sequence[int]], opts: GenerationOptions,
                   warn: Callable[[str], None] | None = None) -> list[list[int]]:
    """Generate for several prompts together. Every step feeds each unfinished sequence its next
    tokens: up to prefill_chunk prompt tokens while it is prefilling (long prompts in chunks), then
    one new token; all in one forward step. Returns the new token ids of each (stop token excluded).
    Prompts past the context are refused or truncated (fit_context); no sequence outgrows it."""
    if any(len(p) == 0 for p in prompts):
        raise ValueError("generate: a prompt is empty")
    warn = warn or _warn
    prompts = [fit_context(model, p, opts, warn) for p in prompts]
    limits = [new_token_limit(model, len(p), opts) for p in prompts]
    stops = set(opts.stop_token_ids if opts.stop_token_ids is not None else eos_token_ids(model))
    generator = make_generator(opts.seed)
    caches = [model.new_cache() for _ in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    pending = [list(p) for p in prompts]            # tokens each sequence still has to feed
    live = [i for i in range(len(prompts)) if limits[i] > 0]
    while live:
        feed = {i: pending[i][:opts.prefill_chunk] for i in live}
        tokens = torch.tensor([t for i in live for t in feed[i]])
        logits = model.forward(tokens, [Segment(caches[i], len(feed[i])) for i in live], last_only=True)
        still_live = []
        for row, i in enumerate(live):
            pending[i] = pending[i][len(feed[i]):]
            if pending[i]:                          # still prefilling: its logits are not used yet
                still_live.append(i)
                continue
            token = next_token(logits[row], opts, generator)
            if token in stops:
                continue
            outputs[i].append(token)
            pending[i] = [token]
            if len(outputs[i]) < limits[i]:
                still_live.append(i)
            elif limits[i] < opts.max_new_tokens:
                warn(f"sequence {i} stopped at the model's context of {model.context_length} tokens")
        live = still_live
    return outputs


def stream_tokens(model: MoEModel, prompt_ids: Sequence[int], opts: GenerationOptions,
                  warn: Callable[[str], None] | None = None) -> Iterator[int]:
    """New token ids for one prompt, yielded as soon as each is chosen (prompt fed in chunks).
    A prompt past the context is refused or truncated (fit_context); generation ends at the context."""
    if len(prompt_ids) == 0:
        raise ValueError("generate: the prompt is empty")
    warn = warn or _warn
    prompt = fit_context(model, prompt_ids, opts, warn)
    limit = new_token_limit(model, len(prompt), opts)
    stops = set(opts.stop_token_ids if opts.stop_token_ids is not None else eos_token_ids(model))
    generator = make_generator(opts.seed)
    cache = model.new_cache()
    chunks = [prompt[i:i + opts.prefill_chunk] for i in range(0, len(prompt), opts.prefill_chunk)]
    step = chunks.pop()
    for chunk in chunks:
        model.logits(chunk, cache)
    for _ in range(limit):
        logits = model.logits(step, cache)[-1]
        token = next_token(logits, opts, generator)
        if token in stops:
            return
        yield token
        step = [token]
    if limit < opts.max_new_tokens:
        warn(f"stopped at the model's context of {model.context_length} tokens")


def _warn(message: str) -> None:
    warnings.warn(message, ContextWarning, stacklevel=3)


class ContextWarning(UserWarning):
    """A prompt cut to fit the context, or a generation that ended at it."""


def generate(model: MoEModel, prompt: str | Sequence[int], on_text: Callable[[str], None] | None = None,
             on_warning: Callable[[str], None] | None = None, token_stream=None, **options) -> str:
    """Generated text for `prompt`; `on_text` receives each piece as soon as it is decoded. Text that
    could be the start of a stop string is held back until it is known not to be one. on_warning
    receives a truncated prompt's or a context-ended generation's notice (default: warnings.warn).
    token_stream(prompt_ids, opts, warn) yields the new token ids (default: stream_tokens on
    `model`; edgemoe.speculative.Speculator.stream decodes speculatively)."""
    if model.tokenizer is None:
        raise ValueError("generate: this model has no tokenizer")
    opts = GenerationOptions(**{**defaults_from(model.generation_config), **options})
    prompt_ids = model.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    emit = on_text or (lambda piece: None)
    stream = StopStringStream(model.tokenizer, opts.stop_strings)
    tokens = (token_stream(prompt_ids, opts, on_warning) if token_stream is not None
              else stream_tokens(model, prompt_ids, opts, on_warning))
    for token in tokens:
        model.timings.first_token_chosen()
        piece = stream.push(token)
        if piece:
            emit(piece)
        if stream.stopped:
            break
    model.timings.first_token_chosen()   # no token came (a stop token first): every step was prefill
    piece = stream.finish()
    if piece:
        emit(piece)
    return stream.text


class StopStringStream:
    """Generated token ids -> text pieces safe to show: decoded as they come (StreamDecoder), cut
    before the first stop string, with text that could be the start of a stop string held back until
    it is known not to be one. Used by generate() and by the serving engine (edgemoe/engine.py)."""

    def __init__(self, tokenizer, stop_strings: Sequence[str] = ()):
        self.decoder = StreamDecoder(tokenizer)
        self.stop_strings = tuple(stop_strings)
        self.longest_stop = max((len(x) for x in self.stop_strings), default=0)
        self.text = ""        # all the text so far (cut before the stop string once stopped)
        self.emitted = 0      # text[:emitted] has been returned
        self.stopped = False  # a stop string appeared: push no more tokens

    def push(self, token: int) -> str:
        """The new text that is safe to show after `token`."""
        piece = self.decoder.push(token)
        self.text += piece
        # A stop string can only end in the new piece: search just the tail (linear, not quadratic).
        tail_start = max(0, len(self.text) - len(piece) - self.longest_stop)
        stop_at = _first_stop(self.text[tail_start:], self.stop_strings)
        if stop_at is not None:
            self.text = self.text[:tail_start + stop_at]
            self.stopped = True
            return self._release(len(self.text))
        tail = self.text[-self.longest_stop:] if self.longest_stop else ""
        return self._release(len(self.text) - _stop_prefix_length(tail, self.stop_strings))

    def finish(self) -> str:
        """The text still held back, once generation has ended."""
        if not self.stopped:
            self.text += self.decoder.flush()
        return self._release(len(self.text))

    def _release(self, end: int) -> str:
        if end <= self.emitted:
            return ""
        piece, self.emitted = self.text[self.emitted:end], end
        return piece


def _first_stop(text: str, stop_strings: Sequence[str]) -> int | None:
    hits = [text.find(s) for s in stop_strings if s and s in text]
    return min(hits) if hits else None


def _stop_prefix_length(text: str, stop_strings: Sequence[str]) -> int:
    """Length of the longest end of `text` that is the beginning of a stop string."""
    return max((n for s in stop_strings for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
