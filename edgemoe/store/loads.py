"""The background readers' work list: demand first, predictions only while the disk is free.

Two kinds of work, each kept in the order asked:
- urgent: experts the running layer needs (a layer's misses, submitted together, read by the pool
  of readers while its resident experts compute);
- predicted: preloads for a later layer.

A prediction is handed out only when no demand is pending: the running layer waits for no expert
from disk (`awaiting` is empty: the layer's experts not resident when it began, `await_layer`, and
not yet resident or served, `arrived`), and no caller is reading or waiting for an expert itself
(`demand`, held around TieredStore.get's read). A preload already under way is not cancelled, but
it reads in chunks and pauses between them while demand is pending (`wait_for_idle_disk`): on a
disk-bound step a preload would share the disk with the read the compute waits for and delay it;
this way preloads use the disk's idle time only.

Thread safety: one condition guards everything; `get` blocks until there is work it may hand out,
or returns None once closed. `join` waits until every item put is done (`task_done`).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import deque

from edgemoe.options import OptionError

Key = tuple[int, int]
# Reader threads. Measured on this project's disk (docs/scheduling.md, "Reads in flight and demand
# first"): raw O_DIRECT throughput does not grow with more reads in flight at any read size, and a
# layer's misses read through the store by 2 readers were as fast as by 4 or 8.
READERS = 2
READERS_ENV = "EDGEMOE_READERS"


def reader_count(readers: int | None) -> int:
    """The reader threads asked for: `readers`, else $EDGEMOE_READERS, else READERS."""
    if readers is None:
        value = os.environ.get(READERS_ENV)
        if not value:
            return READERS
        if not value.isdigit() or int(value) < 1:
            raise OptionError(READERS_ENV, value, "a whole number of reader threads, at least 1")
        return int(value)
    if isinstance(readers, bool) or not isinstance(readers, int) or readers < 1:
        raise OptionError("readers=", readers, "a whole number of reader threads, at least 1")
    return readers


class LoadQueue:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._cond = threading.Condition()
        self._urgent: deque[Key] = deque()
        self._predicted: deque[Key] = deque()
        self._awaiting: set[Key] = set()
        self._demanded: list[Key] = []   # experts callers are reading, or waiting for, because they need them now
        self._unfinished = 0
        self._closed = False

    def put(self, key: Key, urgent: bool) -> bool:
        """Queue a read; False (and nothing queued) when the queue is full: loading is best effort."""
        with self._cond:
            if len(self._urgent) + len(self._predicted) >= self.capacity:
                return False
            (self._urgent if urgent else self._predicted).append(key)
            self._unfinished += 1
            self._cond.notify_all()
            return True

    def cancel(self, layer: int) -> int:
        """Drop the queued predictions for `layer` (not reads under way); how many were dropped."""
        with self._cond:
            kept = deque(k for k in self._predicted if k[0] != layer)
            dropped = len(self._predicted) - len(kept)
            self._predicted = kept
            self._finish(dropped)
            return dropped

    def await_layer(self, missing) -> None:
        """The running layer needs these experts from disk: hold predictions until they arrive."""
        missing = set(missing)
        with self._cond:
            released = self._awaiting and not missing
            self._awaiting = missing
            # Held predictions may go, or a paused preload may read one of `missing`; otherwise waking
            # the readers only costs GIL handovers.
            if released or missing:
                self._cond.notify_all()

    def arrived(self, keys: list[Key]) -> None:
        """These keys are resident or were served: the running layer no longer waits for them."""
        if not self._awaiting:   # (a decode step with every expert resident: no lock)
            return
        with self._cond:
            if not self._awaiting.isdisjoint(keys):
                self._awaiting.difference_update(keys)
                self._cond.notify_all()

    @contextlib.contextmanager
    def demand(self, key: Key):
        """Around a read of `key`, or a wait for one, that a caller needs now: no preload starts
        meanwhile, and one under way pauses unless it reads `key`."""
        with self._cond:
            self._demanded.append(key)
            self._cond.notify_all()    # a preload of `key` paused between its chunks goes on
        try:
            yield
        finally:
            with self._cond:
                self._demanded.remove(key)
                self._cond.notify_all()

    def wait_for_idle_disk(self, key: Key) -> None:
        """A preload of `key` pauses here between its chunks while demand is pending, unless the
        demand is for `key` itself (then the preload is what the caller waits for)."""
        with self._cond:
            while (self._demand_pending() and key not in self._awaiting and key not in self._demanded
                   and not self._closed):
                self._cond.wait()

    def get(self) -> tuple[Key, bool] | None:
        """The next (key, urgent) to read, waiting until one may go; None once closed."""
        with self._cond:
            while True:
                if self._closed:
                    return None
                if self._urgent:
                    return self._urgent.popleft(), True
                if self._predicted and not self._demand_pending():
                    return self._predicted.popleft(), False
                self._cond.wait()

    def _demand_pending(self) -> bool:
        """The running layer awaits a read, or a caller reads or waits for one. (Queued urgent reads
        go first anyway; a paused preload holds a reader, so it must not wait for them to be taken.)"""
        return bool(self._awaiting or self._demanded)

    def task_done(self) -> None:
        with self._cond:
            self._finish(1)

    def join(self) -> None:
        """Wait until every queued read is done or cancelled. Held predictions are released: a
        caller draining the queue is not running a layer."""
        with self._cond:
            self._awaiting.clear()
            self._cond.notify_all()
            while self._unfinished:
                self._cond.wait()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._urgent) + len(self._predicted)

    def _finish(self, n: int) -> None:
        self._unfinished -= n
        if not self._unfinished:
            self._cond.notify_all()


class ReadChoice:
    """Who reads a layer's misses, chosen by measurement: submitted together to the reader threads
    (several in flight, overlapped with the layer's resident experts' compute), or read one by one
    by the caller's thread as it needs them. Which is faster depends on the machine: on an idle
    machine the readers overlap checksums and compute with reads; on a machine whose cores are
    taken by other work, every hand-over to a reader thread waits for a core (docs/scheduling.md,
    "Reads in flight and demand first"). So both are timed: over windows of `window_layers` layers,
    the seconds callers waited for reads per byte read; the cheaper way is kept, the other tried
    again for one window every `probe_every` windows (and first, before it has a figure)."""

    def __init__(self, window_layers: int, probe_every: int = 8, smoothing: float = 0.5):
        self.window_layers, self.probe_every, self.smoothing = window_layers, probe_every, smoothing
        self.submit = True                                   # the readers first
        self.seconds_per_byte: dict[bool, float | None] = {True: None, False: None}
        self._layers = self._windows = 0
        self._wait = 0.0
        self._bytes = 0

    def observe_layer(self, wait_seconds: float, read_bytes: int) -> None:
        """A layer's wait for reads and bytes read (demand and urgent reads; preloads use idle time)."""
        self._wait += wait_seconds
        self._bytes += read_bytes
        self._layers += 1
        if self._layers >= self.window_layers:
            self._judge()

    def _judge(self) -> None:
        if self._bytes:
            measured = self._wait / self._bytes
            old = self.seconds_per_byte[self.submit]
            self.seconds_per_byte[self.submit] = measured if old is None else (
                (1 - self.smoothing) * old + self.smoothing * measured)
        self._layers, self._wait, self._bytes = 0, 0.0, 0
        self._windows += 1
        mine, other = self.seconds_per_byte[self.submit], self.seconds_per_byte[not self.submit]
        if mine is None:
            return                                           # nothing read on demand yet: keep timing this way
        if other is None or self._windows % self.probe_every == 0 or other < mine:
            self.submit = not self.submit                    # time the other way (again), or take the cheaper
