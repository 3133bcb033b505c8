"""Continuous batching: one thread owns the model and runs every active request in one forward step.

Each step feeds every active request its next tokens: a prefill chunk (up to its prefill_chunk prompt
tokens) while it is prefilling, then the one token it sampled last. All of them go through a single
`model.forward` call, so each expert is read once per step for all requests. Requests join (submit)
and leave (finish, cancel) between steps; each keeps its own KV cache, random generator, sampling
options and stop strings, so its output does not depend on which others share its steps.

The engine knows nothing of HTTP: `submit` returns a Request whose `events()` yield Events (new
token ids and the text that is safe to show, then a final one with the finish reason).

Shapes: T tokens in a step (the sum over active requests), V vocab, B active requests.
"""

from __future__ import annotations

import itertools
import queue
import threading
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from .cache import KVCache
from .generate import (GenerationOptions, StopStringStream, eos_token_ids, fit_context, make_generator,
                       new_token_limit, next_token)
from .model import MoEModel, Segment


@dataclass
class Event:
    """What one step produced for one request. `finish_reason` is set on the request's last event:
    "stop" (a stop token or string), "length" (max_new_tokens or the context limit), "cancelled",
    or "error" (then `error` says what failed)."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(eq=False)
class Request:
    """One generation. Created by Engine.submit; read by the caller through events() or next_event()."""

    id: int
    prompt_ids: list[int]
    opts: GenerationOptions
    max_new_tokens: int                          # opts.max_new_tokens, capped by the context left
    generator: torch.Generator
    stops: frozenset[int]
    text_stream: StopStringStream
    cache: KVCache | None = None                 # made when the request joins a step, dropped when it ends
    pending: list[int] = field(default_factory=list)   # tokens still to feed (prompt chunks, last sample)
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    _events: queue.Queue = field(default_factory=queue.Queue)
    _cancelled: threading.Event = field(default_factory=threading.Event)

    @property
    def usage(self) -> Usage:
        return Usage(len(self.prompt_ids), len(self.output_ids))

    def cancel(self) -> None:
        """Drop this request at the next step (safe from any thread; its last event says "cancelled")."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def next_event(self, timeout: float | None = None) -> Event | None:
        """The next event, or None if none came within `timeout` seconds."""
        try:
            return self._events.get(timeout=timeout)
        except queue.Empty:
            return None

    def events(self) -> Iterator[Event]:
        """Every event until the last one (blocking)."""
        while True:
            event = self._events.get()
            yield event
            if event.finish_reason is not None:
                return


class Engine:
    """Owns `model`: call step() yourself (tests) or start() a thread that steps whenever there is
    work. `max_batch` requests at most share a step; the others wait in order of submission."""

    def __init__(self, model: MoEModel, max_batch: int = 16):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.model = model
        self.max_batch = max_batch
        self.active: list[Request] = []
        self._waiting: queue.Queue[Request] = queue.Queue()
        self._ids = itertools.count()
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- caller side (any thread) -------------------------------------------------------------------
    def submit(self, prompt_ids: Sequence[int], opts: GenerationOptions) -> Request:
        """Queue a generation. Raises ContextLengthError if the prompt fills the model's context."""
        prompt_ids = list(prompt_ids)
        if not prompt_ids:
            raise ValueError("prompt: empty (no tokens to continue)")
        prompt_ids = fit_context(self.model, prompt_ids, opts, warn=lambda message: None)   # refused unless truncate
        if self.model.tokenizer is None:
            raise ValueError("this model has no tokenizer, so its output cannot be decoded into text")
        stops = opts.stop_token_ids if opts.stop_token_ids is not None else eos_token_ids(self.model)
        request = Request(
            id=next(self._ids), prompt_ids=prompt_ids, opts=opts,
            max_new_tokens=new_token_limit(self.model, len(prompt_ids), opts),
            generator=make_generator(opts.seed), stops=frozenset(stops),
            text_stream=StopStringStream(self.model.tokenizer, opts.stop_strings),
            pending=prompt_ids)
        self._waiting.put(request)
        self._wake.set()
        return request

    def start(self) -> "Engine":
        """Run steps on a background thread until close()."""
        self._thread = threading.Thread(target=self._loop, name="edgemoe-engine", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the thread; requests still active or waiting end with "cancelled"."""
        self._closing.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        for request in self.active + self._drain_waiting():
            self._finish(request, "cancelled")
        self.active = []

    # ---- engine side (one thread) -------------------------------------------------------------------
    def step(self) -> bool:
        """One forward step over every active request. False if there was nothing to do."""
        self._admit()
        for request in [r for r in self.active if r.cancelled]:
            self._finish(request, "cancelled")
        self.active = [r for r in self.active if r.finish_reason is None]
        if not self.active:
            return False
        feeds = [r.pending[:r.opts.prefill_chunk] for r in self.active]
        tokens = torch.tensor([t for feed in feeds for t in feed])
        try:
            logits = self.model.forward(tokens, [Segment(r.cache, len(f)) for r, f in zip(self.active, feeds)],
                                        last_only=True)                                      # [B, V]
            for row, (request, feed) in enumerate(zip(self.active, feeds)):
                request.pending = request.pending[len(feed):]
                if not request.pending:         # prefill done (or a decode step): sample the next token
                    self._accept(request, next_token(logits[row], request.opts, request.generator))
        except Exception as e:   # a failing store or device: fail the requests of this step, keep serving
            for request in self.active:
                if request.finish_reason is None:
                    self._finish(request, "error", error=f"{type(e).__name__}: {e}")
        self.active = [r for r in self.active if r.finish_reason is None]
        return True

    def _admit(self) -> None:
        while len(self.active) < self.max_batch:
            try:
                request = self._waiting.get_nowait()
            except queue.Empty:
                return
            if request.cancelled:
                self._finish(request, "cancelled")
                continue
            if request.max_new_tokens == 0:
                self._finish(request, "length")
                continue
            request.cache = self.model.new_cache()
            self.active.append(request)

    def _accept(self, request: Request, token: int) -> None:
        if token in request.stops:
            self._finish(request, "stop")
            return
        request.output_ids.append(token)
        request.pending = [token]
        text = request.text_stream.push(token)
        if request.text_stream.stopped:
            self._finish(request, "stop", [token], text)
        elif len(request.output_ids) >= request.max_new_tokens:
            self._finish(request, "length", [token], text)
        else:
            request._events.put(Event([token], text))

    def _finish(self, request: Request, reason: str, token_ids: list[int] | None = None, text: str = "",
                error: str | None = None) -> None:
        if reason in ("stop", "length"):
            text += request.text_stream.finish()
        request.finish_reason = reason
        request.cache = None                    # free the KV cache now, not when the caller lets go
        request._events.put(Event(token_ids or [], text, reason, error))

    def _drain_waiting(self) -> list[Request]:
        drained = []
        while True:
            try:
                drained.append(self._waiting.get_nowait())
            except queue.Empty:
                return drained

    def _loop(self) -> None:
        while not self._closing.is_set():
            if not self.step():
                # The model appends each step's timing; a server runs for days: start afresh when idle.
                self.model.timings.reset()
                self._wake.wait(timeout=1.0)
                self._wake.clear()
