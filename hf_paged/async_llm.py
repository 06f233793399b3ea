"""`AsyncLLM`: the engine for servers. Requests are added from an asyncio event loop and
their outputs streamed back as the engine produces them; the engine steps in a thread of
its own.

    llm = hf_paged.AsyncLLM(model, tokenizer)
    async for out in llm.generate("a prompt", SamplingParams(max_tokens=32), "req-1"):
        print(out.outputs[0].text)       # the text so far, then finish_reason on the last
    llm.abort("req-1")                   # or close the iterator: its blocks are freed
    llm.shutdown()
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import sys
import threading
from typing import AsyncIterator

import torch

from .engine import LLMEngine
from .errors import HFPagedError
from .outputs import RequestOutput
from .sampling_params import SamplingParams

_ids = itertools.count()
logger = logging.getLogger("hf_paged")


class EngineDeadError(HFPagedError, RuntimeError):
    """The engine was shut down."""


class AsyncLLM:
    """Engine options as `LLMEngine`'s. Outputs carry the text so far at every step."""

    def __init__(self, model, tokenizer=None, **engine_options):
        if isinstance(model, (str, os.PathLike)):
            from .llm import load_model

            model, found = load_model(model)
            tokenizer = tokenizer if tokenizer is not None else found
        self.engine = LLMEngine(model, tokenizer, **engine_options)
        self.engine.incremental_text = True
        self._lock = threading.Lock()  # the engine is touched by the loop and the stepper
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._dead = False
        self._thread = threading.Thread(target=self._run, name="hf-paged-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def stats(self):
        with self._lock:
            return self.engine.stats()

    async def generate(self, prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0,
                       adapter: str | None = None) -> AsyncIterator[RequestOutput]:
        """Adds a request and yields its outputs as they come (the last one `finished`).
        Raises ValueError / RequestRejectedError at once for a request that cannot run.
        Leaving the iteration early aborts the request."""
        if self._dead:
            raise EngineDeadError("the engine was shut down.")
        request_id = request_id or f"async-{next(_ids)}"
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self.engine.add_request(request_id, prompt, sampling_params, priority, adapter)
            self._streams[request_id] = (asyncio.get_running_loop(), queue)
        self._wake.set()
        finished = False
        try:
            while not finished:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Ends the request at the next step boundary; its stream gets a last output with
        finish_reason "abort"."""
        with self._lock:
            self.engine.abort(request_id)
        self._wake.set()

    def shutdown(self) -> None:
        self._dead = True
        self._wake.set()
        self._thread.join(timeout=60)
        if self._thread.is_alive() and self.engine.tp_size > 1:
            # A step is stuck, so the other ranks cannot be told to stop: end this process
            # (non-zero) and torchrun takes the group down instead of waiting on them.
            logger.critical("hf-paged: the engine did not stop within 60 s; ending the "
                            "process group")
            sys.stderr.flush()
            os._exit(1)

    # -- the stepping thread ------------------------------------------------------------------
    HEARTBEAT_S = 60.0  # under tensor parallelism, idle rank 0 pings the others this often

    def _run(self) -> None:
        tp = self.engine.tp_size > 1
        if self.engine.device.type == "cuda":  # a new thread starts on device 0
            torch.cuda.set_device(self.engine.device)
        while not self._dead:
            woken = self._wake.wait(self.HEARTBEAT_S if tp else None)
            self._wake.clear()
            if tp and not woken:
                with self._lock:
                    self.engine.heartbeat()
                continue
            while not self._dead:
                with self._lock:
                    if not self.engine.has_unfinished_requests():
                        break
                    try:
                        outputs = self.engine.step()
                    except Exception as err:  # noqa: BLE001 (a failed step ends its requests)
                        outputs = self.engine.fail_all(f"{type(err).__name__}: {err}")
                self._deliver(outputs)
        with self._lock:
            outputs = self.engine.fail_all("the engine was shut down")
            if tp:
                self.engine.stop_workers()
        self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            loop, queue = stream
            try:
                loop.call_soon_threadsafe(queue.put_nowait, out)
            except RuntimeError:  # the caller's loop is closed
                pass
