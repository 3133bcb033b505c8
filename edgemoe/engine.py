"""Continuous batching: one thread owns the model and runs every active request in one forward step.

Each step is one step of the generation loop (generate.step) over every active request's Generation:
a prefill chunk (up to its prefill_chunk prompt tokens) while it is prefilling, then the one token it
sampled last, all in a single forward step, so each expert is read once per step for all requests;
sampling, stop tokens and strings and the token limit are the loop's. Requests join (submit)
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

from .generate import Event, Generation, GenerationOptions, step
from .model import MoEModel


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
    generation: Generation                       # its place in the loop: prompt, output, stops, limit
    _events: queue.Queue = field(default_factory=queue.Queue)
    _cancelled: threading.Event = field(default_factory=threading.Event)

    @property
    def prompt_ids(self) -> list[int]:
        return self.generation.prompt

    @property
    def output_ids(self) -> list[int]:
        return self.generation.output

    @property
    def finish_reason(self) -> str | None:
        return self.generation.finish_reason

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
        # A truncated prompt is not reported here: the server has no channel for notices.
        generation = Generation(self.model, list(prompt_ids), opts, warn=lambda message: None, text=True)
        request = Request(next(self._ids), generation)
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
            self._end(request, "cancelled")
        self.active = []

    # ---- engine side (one thread) -------------------------------------------------------------------
    def step(self) -> bool:
        """One step of the generation loop over every active request. False if there was nothing to do."""
        self._admit()
        for request in [r for r in self.active if r.cancelled]:
            self._end(request, "cancelled")
        self.active = [r for r in self.active if r.finish_reason is None]
        if not self.active:
            return False
        try:
            events = step(self.model, [r.generation for r in self.active])
        except Exception as e:   # a failing store or device: fail the requests of this step, keep serving
            for request in self.active:
                self._end(request, "error", error=f"{type(e).__name__}: {e}")
        else:
            for request, event in zip(self.active, events):
                if event is not None:           # None: still prefilling
                    self._deliver(request, event)
        self.active = [r for r in self.active if r.finish_reason is None]
        return True

    def _admit(self) -> None:
        while len(self.active) < self.max_batch:
            try:
                request = self._waiting.get_nowait()
            except queue.Empty:
                return
            if request.cancelled:
                self._end(request, "cancelled")
            elif request.finish_reason is not None:     # max_new_tokens 0: nothing to generate
                self._deliver(request, Event([], "", request.finish_reason))
            else:
                self.active.append(request)

    def _end(self, request: Request, reason: str, error: str | None = None) -> None:
        """End a request for the engine's reasons (cancelled, error): its state is freed now."""
        request.generation.end(reason)
        self._deliver(request, Event([], "", reason, error))

    @staticmethod
    def _deliver(request: Request, event: Event) -> None:
        """Every event a request gets, the loop's and the engine's own, goes to its caller here."""
        request._events.put(event)

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
