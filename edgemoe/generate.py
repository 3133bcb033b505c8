"""Token generation: one loop for every driver. Greedy or sampled (temperature, top-k, top-p,
seeded), stop tokens and strings, streaming, and several sequences decoded together.

The loop, lowest first:
- forward_step(model, feeds): one forward step for several sequences, each feeding a prompt chunk (at
  most prefill_chunk tokens) or its last token; the only place a prompt is cut into chunks.
- Generation: one sequence's rules, written once: the prompt fitted to the context, the stop tokens,
  the token limit, the seeded sampler, the stop strings and the text safe to show; `accept(token)`
  decides when it ends and returns an Event.
- step(model, generations): forward_step, then each generation whose prompt is fed chooses its next
  token (next_token) and accepts it.
Drivers: decode (plain decoding of one sequence: stream_tokens, generate, chat), generate_batch, the
serving engine (edgemoe/engine.py: requests joining and leaving between steps), speculative decoding
(edgemoe/speculative.py: the prompt through decode, then draft-verify rounds whose tokens the
Generation accepts), beam search (edgemoe/beam.py: a Generation's prompt, context, limit and stop
tokens, beams fed through forward_step). A model takes part through two methods: open_sequence(prompt,
output) -> (state, first tokens to feed) and next_logits(runs, states); an encoder-decoder model's open
its encoder output and feed the decoder's start token (edgemoe/seq2seq.py), each followed by the
output already chosen where a suspended sequence opens again.

Sampling applies temperature, then top-k, then top-p, as transformers' logits warpers do.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Sequence

import torch

from .errors import ContextLengthError, EdgeMoEError
from .model import MoEModel
from .ram_growth import RamGrowth
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
        which = (f"the model's context is {limit} (max_position_embeddings)"
                 if limit == model.spec.max_position_embeddings else f"the served context is {limit} (--context)")
        raise ContextLengthError(f"the prompt has {n} tokens and {which}: shorten it, or truncate it from the left "
                                 f"(--truncate, truncate=True)")
    keep = limit - min(max(opts.max_new_tokens, 1), limit // 2)
    warn(f"prompt truncated from the left to its last {keep} of {n} tokens (the model's context is {limit})")
    return list(prompt_ids[n - keep:])


def make_generator(seed: int | None) -> torch.Generator:
    """The sampling generator: seeded, or from fresh entropy."""
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def stop_tokens(model: MoEModel, opts: GenerationOptions) -> frozenset[int]:
    """The token ids that end a sequence: opts.stop_token_ids, else the model's eos tokens."""
    return frozenset(opts.stop_token_ids if opts.stop_token_ids is not None else eos_token_ids(model))


# ---- the generation loop --------------------------------------------------------------------------
@dataclass
class Event:
    """What the loop produced for one sequence at one token: the new token ids (none for a stop token)
    and the text that is safe to show. `finish_reason` is set on the sequence's last event: "stop" (a
    stop token or string), "length" (max_new_tokens or the context), or, from the serving engine,
    "cancelled" or "error" (then `error` says what failed)."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    error: str | None = None


@dataclass(eq=False)
class Feed:
    """One sequence's place in the forward loop: its decoding state (a KV cache, or an encoder-decoder's
    DecoderState) and the tokens it still has to feed, at most `chunk` per step."""

    state: object
    pending: list[int]
    chunk: int


def forward_step(model, feeds: Sequence[Feed]) -> list[torch.Tensor | None]:
    """One forward step of `model` for every feed at once: each feeds its next tokens (up to `chunk` of
    a prompt, long prompts in chunks, or the one token chosen last), continuing its state. Returns,
    per feed, its next-token float32 logits [V] once it has fed every pending token, else None (still
    prefilling). The one place a prompt is cut into chunks: plain, batched and served decoding, a
    speculative draft and beam search all feed through it."""
    runs = [feed.pending[:feed.chunk] for feed in feeds]
    logits = model.next_logits(runs, [feed.state for feed in feeds])     # [len(feeds), V]
    ready = []
    for row, (feed, run) in enumerate(zip(feeds, runs)):
        feed.pending = feed.pending[len(run):]
        ready.append(None if feed.pending else logits[row])
    return ready


def last_logits(model, feed: Feed) -> torch.Tensor:
    """Forward steps of one feed until it has fed every pending token: its next-token logits [V]."""
    while True:
        (logits,) = forward_step(model, [feed])
        if logits is not None:
            return logits


class Generation:
    """One sequence through the generation loop: the prompt fitted to the context (fit_context), the
    stop tokens (stop_tokens), the token limit (max_new_tokens, or fewer where the context ends
    first), the seeded sampler, and with `text` (or stop strings) the text safe to show
    (StopStringStream). Drivers step it (step: plain, batched and served decoding) or hand it tokens
    they chose otherwise (accept: speculative decoding); either way `accept` decides when it ends.

    Its decoding state is opened at its first step (`open`, by the model: a KV cache with the prompt to
    feed, or an encoder-decoder's encoder output with the decoder's start token) and dropped when it
    ends."""

    def __init__(self, model, prompt_ids: Sequence[int], opts: GenerationOptions,
                 warn: Callable[[str], None] | None = None, text: bool = False):
        if len(prompt_ids) == 0:
            raise ValueError("prompt: empty (the prompt is empty; generation needs a token to continue)")
        if (text or opts.stop_strings) and model.tokenizer is None:
            raise ValueError("this model has no tokenizer, so its output cannot be decoded into text")
        self.model, self.opts = model, opts
        self.warn = warn or _warn
        self.prompt = fit_context(model, prompt_ids, opts, self.warn)
        self.context_length = model.context_length
        self.stops = stop_tokens(model, opts)
        self.generator = make_generator(opts.seed)
        self.text_stream = (StopStringStream(model.tokenizer, opts.stop_strings) if text or opts.stop_strings
                            else None)
        self.output: list[int] = []
        self.feed: Feed | None = None
        self.limit: int | None = None           # new tokens it may get, known once opened
        self.finish_reason: str | None = "length" if opts.max_new_tokens == 0 else None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def bound_context(self, context_length: int) -> None:
        """Also end at this context (a driver running a second model, a speculative draft, with its
        own); before the first step."""
        self.context_length = min(self.context_length, context_length)

    def open(self) -> Feed:
        """Its feed, opened by the model on first use, and again after `suspend`: the state recomputed
        from the prompt and the output so far, fed as a prompt is."""
        if self.feed is None:
            state, first = self.model.open_sequence(self.prompt, self.output)
            self.feed = Feed(state, first, self.opts.prefill_chunk)
            if self.limit is None:
                self.limit = min(self.opts.max_new_tokens, self.context_length - len(first))
        return self.feed

    def suspend(self) -> None:
        """Drop its decoding state to free its memory (the serving engine pausing it); its next step
        opens it again. Its sampler, text stream and limit carry on, so it goes on where it stopped."""
        self.feed = None

    def accept(self, token: int) -> Event:
        """Take the next token, however it was chosen: a stop token ends the sequence unseen, a token
        that completes a stop string or reaches the limit ends it after being taken."""
        if token in self.stops:
            return self._finish("stop", [], "")
        self.output.append(token)
        self.feed.pending = [token]
        text = self.text_stream.push(token) if self.text_stream is not None else ""
        if self.text_stream is not None and self.text_stream.stopped:
            return self._finish("stop", [token], text)
        if len(self.output) >= self.limit:
            if self.limit < self.opts.max_new_tokens:
                self.warn(f"stopped at the context of {self.context_length} tokens")
            return self._finish("length", [token], text)
        return Event([token], text)

    def end(self, reason: str) -> None:
        """End it now (also for a reason of the caller's: cancelled, error); its state is freed."""
        self.finish_reason = reason
        self.feed = None

    def _finish(self, reason: str, token_ids: list[int], text: str) -> Event:
        if self.text_stream is not None:
            text += self.text_stream.finish()
        self.end(reason)
        return Event(token_ids, text, reason)


def step(model, generations: Sequence[Generation]) -> list[Event | None]:
    """One step of the loop for unfinished generations of `model`: one forward step for all of them
    (forward_step), then each whose prompt is fed chooses its next token (next_token) and accepts it.
    Returns each one's Event, None for one still prefilling. Tokens are chosen for all before any is
    accepted, so a failure (non-finite logits) leaves every generation as it was."""
    ready = forward_step(model, [g.open() for g in generations])
    chosen = [None if logits is None else next_token(logits, g.opts, g.generator)
              for g, logits in zip(generations, ready)]
    return [None if token is None else g.accept(token) for g, token in zip(generations, chosen)]


def decode(generation: Generation) -> Iterator[Event]:
    """Plain decoding of one generation: its events, one forward step per new token (the prompt first,
    in chunks). A store opened with ram="auto" may grow its RAM tier once on the way, for the rest of
    this sequence (RamGrowth)."""
    growth = RamGrowth.for_store(getattr(generation.model, "store", None))
    try:
        while not generation.finished:
            yield from (event for event in step(generation.model, [generation]) if event is not None)
            if growth is not None and generation.output and not generation.finished:   # prompt fed, going on
                growth.after_step(len(generation.output), generation.feed.state,
                                  len(generation.prompt) + generation.limit)
    finally:
        if growth is not None:
            growth.end()


def token_ids(events: Iterable[Event]) -> Iterator[int]:
    for event in events:
        yield from event.token_ids


def generate_batch(model: MoEModel, prompts: Sequence[Sequence[int]], opts: GenerationOptions,
                   warn: Callable[[str], None] | None = None) -> list[list[int]]:
    """Generate for several prompts together: each step feeds every unfinished sequence its next tokens
    (a prompt chunk, or its last token) in one forward step (step). Returns the new token ids of each
    (stop token excluded). Prompts past the context are refused or truncated (fit_context); no sequence
    outgrows it; a notice names its sequence."""
    warn = warn or _warn
    generations = [Generation(model, p, opts, lambda message, i=i: warn(f"sequence {i}: {message}"))
                   for i, p in enumerate(prompts)]
    live = [g for g in generations if not g.finished]
    while live:
        step(model, live)
        live = [g for g in live if not g.finished]
    return [g.output for g in generations]


def stream_tokens(model: MoEModel, prompt_ids: Sequence[int], opts: GenerationOptions,
                  warn: Callable[[str], None] | None = None) -> Iterator[int]:
    """New token ids for one prompt, yielded as soon as each is chosen (plain decoding: decode). A
    prompt past the context is refused or truncated (fit_context); generation ends at the context."""
    yield from token_ids(decode(Generation(model, prompt_ids, opts, warn)))


def _warn(message: str) -> None:
    warnings.warn(message, ContextWarning, stacklevel=3)


class ContextWarning(UserWarning):
    """A prompt cut to fit the context, or a generation that ended at it."""


def generate(model: MoEModel, prompt: str | Sequence[int], on_text: Callable[[str], None] | None = None,
             on_warning: Callable[[str], None] | None = None,
             decoder: Callable[[Generation], Iterable[Event]] = decode, **options) -> str:
    """Generated text for `prompt`; `on_text` receives each piece as soon as it is decoded. Text that
    could be the start of a stop string is held back until it is known not to be one. on_warning
    receives a truncated prompt's or a context-ended generation's notice (default: warnings.warn).
    decoder(generation) drives the loop: decode (plain decoding, the default) or
    edgemoe.speculative.Speculator.decode."""
    if model.tokenizer is None:
        raise ValueError("generate: this model has no tokenizer")
    opts = GenerationOptions(**{**defaults_from(model.generation_config), **options})
    prompt_ids = model.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    emit = on_text or (lambda piece: None)
    generation = Generation(model, prompt_ids, opts, on_warning, text=True)
    for event in decoder(generation):
        model.timings.first_token_chosen()
        if event.text:
            emit(event.text)
    model.timings.first_token_chosen()   # no token came (max_new_tokens 0): every step was prefill
    return generation.text_stream.text


class StopStringStream:
    """Generated token ids -> text pieces safe to show: decoded as they come (StreamDecoder), cut
    before the first stop string, with text that could be the start of a stop string held back until
    it is known not to be one. Held by a Generation that shows text or has stop strings."""

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
