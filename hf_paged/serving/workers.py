"""The server's worker threads: the work that must not run on the event loop (parsing
bodies, tokenizing, chat templates, encoding responses) and, in a pool of their own,
structured-output compiles. A compile can take minutes and cannot be stopped; on the shared
workers a few of them would hold up every other request, so compiles wait only for
compiles.

The threads are daemons: at exit nothing waits for a compile still running. `fail` ends
what callers still await (queued or running) with an error of the server's, so that their
clients get it as a response rather than a dropped connection.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from concurrent.futures import Future, InvalidStateError


class Workers:
    """Up to `size` daemon threads, started as work comes."""

    def __init__(self, size: int, name: str):
        self.size, self.name = size, name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._open: set[Future] = set()  # queued or running
        self._lock = threading.Lock()
        self._error: BaseException | None = None  # set by fail(): no new work

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        with self._lock:
            if self._error is not None:
                future.set_exception(self._error)
                return future
            self._open.add(future)
            if len(self._threads) < self.size:
                thread = threading.Thread(target=self._work, daemon=True,
                                          name=f"{self.name}-{len(self._threads)}")
                self._threads.append(thread)
                thread.start()
        self._jobs.put((future, fn, args))
        return future

    async def run(self, fn, *args):
        """fn(*args) on a worker; awaiting it from the event loop."""
        return await asyncio.wrap_future(self.submit(fn, *args))

    @property
    def closed(self) -> bool:
        """Whether `fail` ended them (they take no work)."""
        return self._error is not None

    def fail(self, error: BaseException) -> None:
        """Ends every open future with `error`, refuses new work and lets the threads end
        (a running call goes on to its end, unheard)."""
        with self._lock:  # (so that a worker never starts a future failed here)
            self._error = error
            for future in self._open:
                _settle(future, None, error)
            self._open.clear()
            threads = len(self._threads)
        for _ in range(threads):
            self._jobs.put(None)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, fn, args = job
            with self._lock:
                if future.done() or not future.set_running_or_notify_cancel():
                    self._open.discard(future)  # failed by fail(), or its caller went away
                    continue
            try:
                result, error = fn(*args), None
            except BaseException as err:  # noqa: BLE001 (the caller's to handle)
                result, error = None, err
            with self._lock:
                self._open.discard(future)
            _settle(future, result, error)


def _settle(future: Future, result, error) -> None:
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:  # failed by fail() meanwhile, or cancelled
        pass
