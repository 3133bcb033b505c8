"""The background loader's work list: urgent reads first, predictions only while the disk is free.

Two kinds of work, each kept in the order asked:
- urgent: experts the running layer needs (fetched while its first expert computes);
- predicted: preloads for a later layer.

A prediction is handed out only when the running layer waits for no expert from disk (`awaiting`
is empty): the layer's experts not resident when it began (`await_layer`) and not yet resident or
served (`arrived`). On a disk-bound step a preload started earlier would share the disk with the
read the compute is waiting for and delay it; this way preloads use the disk's idle time only.

Thread safety: one condition guards everything; `get` blocks until there is work it may hand out,
or returns None once closed. `join` waits until every item put is done (`task_done`).
"""

from __future__ import annotations

import threading
from collections import deque

Key = tuple[int, int]


class LoadQueue:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._cond = threading.Condition()
        self._urgent: deque[Key] = deque()
        self._predicted: deque[Key] = deque()
        self._awaiting: set[Key] = set()
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
            if released:   # held predictions may go; otherwise waking the loader only costs a GIL handover
                self._cond.notify_all()

    def arrived(self, key: Key) -> None:
        """`key` is resident or was served: the running layer no longer waits for it."""
        with self._cond:
            if key in self._awaiting:
                self._awaiting.discard(key)
                self._cond.notify_all()

    def get(self) -> tuple[Key, bool] | None:
        """The next (key, urgent) to read, waiting until one may go; None once closed."""
        with self._cond:
            while True:
                if self._closed:
                    return None
                if self._urgent:
                    return self._urgent.popleft(), True
                if self._predicted and not self._awaiting:
                    return self._predicted.popleft(), False
                self._cond.wait()

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
