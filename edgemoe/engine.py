"""Continuous batching: one thread owns the model and runs every active request in one forward step.

Each step is one step of the generation loop (generate.step) over the active requests' Generations:
a prefill chunk (up to its prefill_chunk prompt tokens) while it is prefilling, then the one token it
sampled last, all in a single forward step, so each expert is read once per step for all requests
(prompt chunks up to `step_prompt_tokens` in all, so that a step's activations stay one chunk's);
sampling, stop tokens and strings and the token limit are the loop's. Requests join (submit)
and leave (finish, cancel) between steps; each keeps its own KV cache, random generator, sampling
options and stop strings, so its output does not depend on which others share its steps (on a
store, bit for bit: docs/architecture.md, "Sequences decoded together").

The engine knows nothing of HTTP: `submit` returns a Request whose `events()` yield Events (new
token ids and the text that is safe to show, then a final one with the finish reason).

Requests join in the order submitted, while fewer than `max_batch` are active and, but for the
first, while what they will take next fits in memory (MemoryAdmission): a request waits rather than
grow the process past its memory limit. Where the active ones' next growth no longer fits, the one
that joined last is paused: its KV cache dropped, it waits again at the head of the queue and
recomputes its cache from its prompt and output when it rejoins.

Shapes: T tokens in a step (the sum over active requests), V vocab, B active requests.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from .generate import Event, Generation, GenerationOptions, step
from .kv_cache import KVCache
from .loader import kv_cache_bytes, step_row_bytes
from .model import MoEModel
from .store.memory import grown_margin, read_memory_facts, return_freed_memory

log = logging.getLogger(__name__)

# Prompt tokens a step feeds at most, all requests together (one default prefill chunk): a step's
# activations then stay those of one chunk whatever the batch, which the allocator otherwise keeps
# for the next step (docs/scheduling.md, "Serving inside a memory limit": 392-415 MiB against
# 597-653 for three 1,000-token prompts, in the same time).
STEP_PROMPT_TOKENS = 512

# Tokens past where a request is (prompt and output so far) that admission counts its KV cache to,
# where its final length is further (MemoryAdmission.committed_length). A request without max_tokens
# may run to the served context, but most end long before: counted there, it would keep others
# waiting for memory it may never take; counted this far ahead, pausing covers the rest.
ADMISSION_HORIZON = 512


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


def opened_kv_cache(generation: Generation) -> KVCache | None:
    """The generation's KV cache once opened; None before, or for a state that is not a KVCache."""
    state = generation.feed.state if generation.feed is not None else None
    return state if isinstance(state, KVCache) else None


class MemoryAdmission:
    """Whether one more request fits in memory beside the active ones (docs/architecture.md, "Admission
    by memory, and pausing for it"): what it will take next (need) against what the process may still
    take, read now, less the RAM tier's room not yet filled, what the active requests will still
    allocate, and a margin (room). Memory under `memory_root` (tests pass a fake tree)."""

    def __init__(self, model: MoEModel, memory_root: str | os.PathLike = "/"):
        self.model, self.memory_root = model, memory_root

    def need(self, generation: Generation) -> int:
        """Bytes the generation will take next: its KV cache at its committed length, at most twice that
        (the cache doubles) or the served context, as --ram auto reserves one; and its decoding
        token's rows of a step's activations (step_row_bytes). Its prompt chunks take no more room
        than the chunk a step feeds at most (Engine.step_prompt_tokens), which the first request's
        took already."""
        return (kv_cache_bytes(self.model.spec, self.committed_length(generation), self.model.kv_dtype,
                               self.model.context_length)
                + step_row_bytes(self.model.spec, 1))

    def future(self, generation: Generation) -> int:
        """Bytes an admitted generation will still allocate: its opened KV cache's growth to its
        committed length, all of `need` before its first step (or for a state that is not a KVCache)."""
        cache = opened_kv_cache(generation)
        return cache.growth_to(self.committed_length(generation)) if cache is not None else self.need(generation)

    def released_by_pausing(self, generation: Generation) -> int:
        """Room that pausing an active generation makes: its KV cache's bytes and its future."""
        cache = opened_kv_cache(generation)
        return (cache.nbytes if cache is not None else 0) + self.future(generation)

    def room(self, active: Sequence[Generation]) -> int | None:
        """Bytes one more request may take now (None: memory unknown, no limit applies)."""
        facts = read_memory_facts(self.memory_root)
        if facts.available is None:
            return None
        return facts.available - self._unfilled_tier() - sum(map(self.future, active)) - grown_margin(facts)

    @staticmethod
    def final_length(generation: Generation) -> int:
        return min(len(generation.prompt) + generation.opts.max_new_tokens, generation.context_length)

    @classmethod
    def committed_length(cls, generation: Generation) -> int:
        """The length its KV cache is counted at: its final length, or ADMISSION_HORIZON tokens past
        where it is now where that is nearer."""
        now = len(generation.prompt) + len(generation.output)
        return min(cls.final_length(generation), now + ADMISSION_HORIZON)

    def _unfilled_tier(self) -> int:
        """The RAM tier's capacity not yet taken by experts: it fills as they are read."""
        store = getattr(self.model, "store", None)
        if store is None:
            return 0
        cached, capacity = store.ram_filled()   # an unbounded tier: at most every expert
        return max(min(capacity, store.manifest.expert_bytes) - cached, 0)


class Engine:
    """Owns `model`: call step() yourself (tests), or run() the loop that steps whenever there is work
    on a thread until stop(), or start() that loop on a thread of its own. `max_batch` requests at most
    share a step, and only as many as fit in memory (MemoryAdmission, read under `memory_root`); the
    others wait in order of submission, and the last to join is paused where the active ones' growth
    no longer fits (_pause_for_memory).

    Run the loop on the thread that loaded the model where you can (run(); `edgemoe serve` does): the
    kernels' OpenMP runtimes keep a team of threads for each thread that calls them, and with a
    second team the runtime's threads stop spinning between parallel regions and sleep, so each of
    a step's hundreds of regions waits for a wake-up (docs/serving.md measures the cost)."""

    def __init__(self, model: MoEModel, max_batch: int = 16, memory_root: str | os.PathLike = "/",
                 step_prompt_tokens: int = STEP_PROMPT_TOKENS):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if step_prompt_tokens < 1:
            raise ValueError(f"step_prompt_tokens must be >= 1, got {step_prompt_tokens}")
        self.model = model
        self.max_batch = max_batch
        self.step_prompt_tokens = step_prompt_tokens
        self.memory = MemoryAdmission(model, memory_root)
        self.active: list[Request] = []
        self._waiting: queue.Queue[Request] = queue.Queue()   # submitted, not yet seen by the engine
        self._held: deque[Request] = deque()                  # seen, waiting to join (the engine's thread)
        self._told_waiting: set[int] = set()                  # ids already logged as waiting for memory
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

    def run(self) -> None:
        """Step whenever there is work, on this thread, until stop() or close() (from another thread)."""
        while not self._closing.is_set():
            if not self.step():
                # The model appends each step's timing; a server runs for days: start afresh when idle.
                self.model.timings.reset()
                self._wake.wait(timeout=1.0)
                self._wake.clear()

    def start(self) -> "Engine":
        """run() on a background thread until close()."""
        self._thread = threading.Thread(target=self.run, name="edgemoe-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Make run() return after its step (safe from any thread); requests stay as they are."""
        self._closing.set()
        self._wake.set()

    def close(self) -> None:
        """Stop the loop (and its thread, if start()ed); requests still active or waiting end with
        "cancelled"."""
        self.stop()
        if self._thread is not None:
            self._thread.join()
        for request in self.active + list(self._held) + self._drain_waiting():
            self._end(request, "cancelled")
        self.active = []
        self._held.clear()

    # ---- engine side (one thread) -------------------------------------------------------------------
    def step(self) -> bool:
        """One step of the generation loop over every active request. False if there was nothing to do."""
        self._admit()
        for request in [r for r in self.active if r.cancelled]:
            self._end(request, "cancelled")
        self.active = [r for r in self.active if r.finish_reason is None]
        if not self.active:
            return False
        self._pause_for_memory()
        try:
            running = self._this_step()
            prompted = any(len(r.generation.feed.pending) > 1 for r in running)
            events = step(self.model, [r.generation for r in running])
        except Exception as e:   # a failing store or device: fail the requests of this step, keep serving
            for request in self.active:
                self._end(request, "error", error=f"{type(e).__name__}: {e}")
        else:
            for request, event in zip(running, events):
                if event is not None:           # None: still prefilling
                    self._deliver(request, event)
            if prompted:   # a prompt chunk's activations, freed, go back to the system, not the heap
                return_freed_memory()
        self.active = [r for r in self.active if r.finish_reason is None]
        return True

    def _this_step(self) -> list[Request]:
        """The active requests this step feeds: every decoding one (a token each), and the prompt chunks
        of prefilling ones, in order, while they total at most step_prompt_tokens (the first always
        goes). A chunk is never cut to fit, so a prompt is fed in the chunks it is fed in alone."""
        budget, running, prompts = self.step_prompt_tokens, [], 0
        for request in self.active:
            feed = request.generation.open()
            tokens = min(len(feed.pending), feed.chunk)
            if tokens > 1:
                if prompts and tokens > budget:
                    continue                    # its chunk waits for a step with room for it
                budget, prompts = budget - tokens, prompts + 1
            running.append(request)
        return running

    def _admit(self) -> None:
        self._held.extend(self._drain_waiting())
        for request in [r for r in self._held if r.cancelled]:
            self._held.remove(request)
            self._end(request, "cancelled")
        while self._held and len(self.active) < self.max_batch:
            request = self._held[0]
            if request.finish_reason is not None:       # max_new_tokens 0: nothing to generate
                self._held.popleft()
                self._deliver(request, Event([], "", request.finish_reason))
                continue
            if self.active:
                need, room = self.memory.need(request.generation), self.memory.room([r.generation for r in self.active])
                if room is not None and need > room:
                    self._say_waiting(request, need, room)
                    return
            self._held.popleft()
            self._told_waiting.discard(request.id)
            self.active.append(request)

    def _pause_for_memory(self) -> None:
        """While more than one request is active and their next growth does not fit (room below zero),
        pause the one that joined last: its state dropped, it waits again at the head of the queue and
        rejoins by the admission rule, recomputing its state from its prompt and output. Only a KV
        cache is dropped: a request holding other state (an encoder-decoder's) is not paused."""
        room = self.memory.room([r.generation for r in self.active]) if len(self.active) > 1 else None
        paused = []
        while room is not None and room < 0 and len(self.active) > 1:
            pausable = [r for r in self.active[1:]
                        if r.generation.feed is None or opened_kv_cache(r.generation) is not None]
            if not pausable:
                break
            request = pausable[-1]
            room += self.memory.released_by_pausing(request.generation)
            paused.append(request)
            self.active.remove(request)
            self._held.appendleft(request)
            self._told_waiting.add(request.id)          # the line below says it waits
            log.info("request %d paused for memory after %d tokens (%d active left): it resumes, recomputing "
                     "its KV cache, when room is made", request.id, len(request.output_ids), len(self.active))
            request.generation.suspend()
        if paused:
            return_freed_memory()

    def _say_waiting(self, request: Request, need: int, room: int) -> None:
        if request.id not in self._told_waiting:
            self._told_waiting.add(request.id)
            log.info("request %d waits for memory: it needs %.1f MiB beside the %d active, %.1f MiB left",
                     request.id, need / 2**20, len(self.active), room / 2**20)

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

