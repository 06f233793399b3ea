"""`RequestStream`: the outputs of one `AsyncLLM` request on their way to its reader. The
stepping thread puts them in; the reader's event loop takes them out, in order; a reader
that falls behind is found by `check_reader` on its own loop."""

from __future__ import annotations

import asyncio
import collections
import contextlib
from typing import TYPE_CHECKING

from ..outputs import RequestOutput

if TYPE_CHECKING:
    from .async_llm import AsyncLLM

READER_GRACE_S = 1.0  # how long a reader over max_unread_outputs may take none


class RequestStream:
    """The outputs of one request, in order, as an async iterator (the last `finished`).
    `abort()` ends the request at the next step; iterating then yields its last output."""

    def __init__(self, llm: "AsyncLLM", request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self._llm, self._loop = llm, loop
        self._items: collections.deque = collections.deque()  # filled by the stepping thread
        self._ready = asyncio.Event()
        self._ended = False  # the last output (or an error) was taken
        self._aborted = False  # abort() was called
        self.aborting = False  # set by the stepping thread when the reader fell behind
        self.delta = False  # its outputs are deltas: one not delivered joins the next
        self.held = None  # the deltas not delivered (reader behind, or aborting), joined
        self.on_finished = None  # see AsyncLLM.submit
        self.taken = 0  # outputs the reader has taken
        self.checking = False  # the loop is looking at whether the reader takes any
        self.stalled = False  # it took none while the loop ran: its request is aborted

    @property
    def unread(self) -> int:
        return len(self._items)

    def _put(self, item) -> None:
        """From the stepping thread."""
        self._items.append(item)
        with contextlib.suppress(RuntimeError):  # (the reader's loop is closed)
            self._loop.call_soon_threadsafe(self._ready.set)

    def _supersede(self, item) -> None:
        """From the stepping thread: a cumulative output takes the place of the newest
        unread one (it says all that one says)."""
        try:
            self._items[-1] = item
        except IndexError:  # (the reader took them all meanwhile)
            self._items.append(item)

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self._ended and not self._items:
            raise StopAsyncIteration
        while not self._items:
            self._ready.clear()
            if self._items:
                break
            await self._ready.wait()
        item = self._items.popleft()
        self.taken += 1
        if isinstance(item, BaseException):
            self._ended = True
            raise item
        if item.finished:
            self._ended = True
        return item

    def check_reader(self) -> None:
        """From the stepping thread, once outputs pile up: after `READER_GRACE_S` seconds of
        the reader's loop, and two more of its iterations (a reader woken by an output
        runs in the first: after a loop held up, before this looks), the stream is marked
        stalled if the reader took none meanwhile and some still wait."""
        if self.checking:
            return
        self.checking, taken, loop = True, self.taken, self._loop

        def verdict():
            self.stalled = self.taken == taken and bool(self._items)
            self.checking = False

        try:
            loop.call_soon_threadsafe(loop.call_later, READER_GRACE_S, loop.call_soon,
                                      loop.call_soon, verdict)
        except RuntimeError:  # the reader's loop is closed: nobody reads
            self.stalled, self.checking = True, False

    def abort(self) -> None:
        """Ends the request (no-op once it has ended). The abort names this stream, not
        just its id: a request that ended meanwhile leaves a later one of the same id alone."""
        if not self._ended and not self._aborted:
            self._aborted = True
            self._llm._post("abort", (self.request_id, self))
