"""`AsyncLLM`: the engine for servers. Requests are added from an asyncio event loop and
their outputs streamed back as the engine produces them; the engine steps in a thread of
its own.

    llm = hf_paged.AsyncLLM(model, tokenizer)
    async for out in llm.generate("a prompt", SamplingParams(max_tokens=32), "req-1"):
        print(out.outputs[0].text)       # the text so far, then finish_reason on the last
    llm.abort("req-1")                   # or close the iterator: its blocks are freed
    llm.shutdown()

The event loop never waits for a step: a request is checked on the caller's thread
(`LLMEngine.prepare_request` reads only what does not change), then handed to the stepping
thread through an inbox, as are aborts; outputs come back through a bounded buffer per
request. Once `max_unread_outputs` outputs wait for a reader, the buffer stops growing (a
new output takes the place of the newest unread one, or a delta joins the next), and if the
reader takes none for a second while its event loop runs on, the request is aborted (its
blocks freed). A loop held up a moment, by a large body say, is not its readers' fault: the
check runs on the loop, so it waits for it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import os
import sys
import threading
import time
from typing import AsyncIterator

import torch

from .adapters import LoRARequest, load_requested
from .beam_search import BeamSearchParams, beam_search_async
from .engine import LLMEngine
from .request import prompt_ids
from .stream import RequestStream
from ..distributed import tensor_parallel as tp
from ..errors import EngineDeadError, InvalidRequestError, describe
from ..outputs import RequestOutput
from ..sampling_params import RequestOutputKind, SamplingParams

_ids = itertools.count()
logger = logging.getLogger("hf_paged")


def _settle(future: asyncio.Future, result, error) -> None:
    if not future.done():  # (its caller may have gone)
        future.set_exception(error) if error is not None else future.set_result(result)


class _Posted:
    """Awaitable at once (what `AsyncLLM.abort` returns)."""

    def __await__(self):
        return iter(())


class AsyncLLM:
    """Engine options as `LLMEngine`'s. Outputs carry the text so far at every step.

    max_unread_outputs: outputs a request may have waiting for its reader; past it, new
    outputs take the place of unread ones, and if the reader takes none for a second
    while its event loop runs on, the request is aborted with an error saying so (a
    client that stopped reading)."""

    def __init__(self, model, tokenizer=None, *, max_unread_outputs: int = 256,
                 dtype="auto", **engine_options):
        from .llm import model_and_tokenizer

        model, tokenizer = model_and_tokenizer("AsyncLLM", model, tokenizer, dtype,
                                               engine_options)
        if isinstance(max_unread_outputs, bool) or not isinstance(max_unread_outputs, int) \
                or max_unread_outputs < 1:
            raise ValueError(f"max_unread_outputs must be a positive integer; got "
                             f"{max_unread_outputs!r}.")
        self.engine = LLMEngine(model, tokenizer, **engine_options)
        self.engine.incremental_text = True
        self.max_unread_outputs = max_unread_outputs
        self._inbox: collections.deque = collections.deque()  # (kind, payload), in order
        self._inbox_lock = threading.Lock()  # held for a few operations, never for a step
        self._inbox_seqs = 0  # sequences of the requests in the inbox
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._dead = False
        self._thread = threading.Thread(target=self._run, name="hf-paged-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        """The served model's name_or_path ("model" when it has none)."""
        return self.engine.model_name

    @property
    def adapters(self) -> list[str]:
        """The LoRA adapters that take requests (empty for a plain model)."""
        return self.engine.lora.live

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the whole KV pool holds (blocks x block size)."""
        return self.engine.num_blocks * self.engine.block_size

    @property
    def block_size(self) -> int:
        return self.engine.block_size

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._dead

    # vLLM's AsyncLLM names
    is_running = is_alive

    @property
    def errored(self) -> bool:
        return not self.is_alive

    async def check_health(self) -> None:
        """Raises EngineDeadError once the engine has stopped."""
        if not self.is_alive:
            raise EngineDeadError("the engine has stopped.")

    async def get_tokenizer(self):
        return self.tokenizer

    async def reset_prefix_cache(self) -> bool:
        """Drops every cached prefix block between steps: True, or False while any request
        runs or waits."""
        from .llm import reset_prefix_cache

        return await self.call(reset_prefix_cache)

    def stats(self):
        """The engine's counters (read without waiting for a step; at most a step old)."""
        return self.engine.stats()

    def num_waiting_sequences(self) -> int:
        """Sequences added and not started yet, those still in the inbox included."""
        return self.engine.num_waiting_sequences() + self._inbox_seqs

    def add(self, prompt, sampling_params: SamplingParams | None = None,
            request_id: str | None = None, priority: int = 0, adapter: str | None = None,
            cache_salt: str | None = None) -> RequestStream:
        """Adds a request and returns its stream; call from the event loop. Raises
        InvalidRequestError / RequestRejectedError at once for a request that cannot run."""
        return self.submit(self.prepare(prompt, sampling_params, request_id, priority, adapter,
                                        cache_salt))

    def prepare(self, prompt, sampling_params: SamplingParams | None = None,
                request_id: str | None = None, priority: int = 0, adapter: str | None = None,
                cache_salt: str | None = None):
        """Checks a request (raising as `add` does) without queueing it: a caller adding
        several requests checks them all first, then `submit`s them, all or none."""
        request_id = request_id or f"async-{next(_ids)}"
        return self.engine.prepare_request(request_id, prompt, sampling_params, priority,
                                           adapter, cache_salt)

    def submit(self, request, on_finished=None) -> RequestStream:
        """Queues a request made by `prepare`; returns its stream. on_finished(output):
        called on the stepping thread with the request's last output, whether or not the
        stream is read to its end (a server's metrics)."""
        request_id = request.request_id
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use.")
        stream = RequestStream(self, request_id, asyncio.get_running_loop())
        stream.delta = request.params.output_kind is RequestOutputKind.DELTA
        stream.on_finished = on_finished
        with self._inbox_lock:
            self._check_alive()  # (under the lock: shutdown's last drain sees it, or it fails)
            self._streams[request_id] = stream
            self._inbox.append(("add", request))
            self._inbox_seqs += request.params.n
        self._wake.set()
        return stream

    async def generate(self, prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0,
                       adapter: str | None = None, cache_salt: str | None = None, *,
                       lora_request: LoRARequest | None = None,
                       ) -> AsyncIterator[RequestOutput]:
        """Adds a request and yields its outputs as they come (the last one `finished`).
        Raises InvalidRequestError / RequestRejectedError at once for a request that cannot
        run. Leaving the iteration early aborts the request. The adapter is named by
        `adapter`, or as vLLM names it, by `lora_request` (loaded first if it is not)."""
        if lora_request is not None:
            if adapter is not None:
                raise ValueError("Name the adapter with `adapter` or `lora_request`, not both.")
            if lora_request.lora_name not in self.adapters:  # (else no wait for a step)
                await self.add_lora(lora_request)
            adapter = lora_request.lora_name
        if request_id is not None:
            await self._released(request_id)
        stream = self.add(prompt, sampling_params, request_id, priority, adapter, cache_salt)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    async def beam_search(self, prompt, request_id: str, params: BeamSearchParams,
                          adapter: str | None = None, cache_salt: str | None = None,
                          run=None) -> AsyncIterator[RequestOutput]:
        """vLLM's engine-client beam search: yields one finished RequestOutput, a completion
        per beam, best first (`hf_paged.engine.beam_search`). Its steps run as requests
        `{request_id}-{step}-{beam}`, or through `run(prompts, sampling_params)`."""
        _, ids = prompt_ids(prompt, SamplingParams(), self.tokenizer, self.vocab_size,
                            self.max_model_len)
        yield await beam_search_async(self, ids, request_id, params, adapter, cache_salt,
                                      run)

    def abort(self, request_id: str | list[str]) -> "_Posted":
        """Ends the request (or each of a list) at the next step boundary; its stream gets
        a last output with finish_reason "abort". Safe from any thread. What it returns
        may be awaited, as vLLM's `await llm.abort(id)` does: the abort is posted already."""
        for one in [request_id] if isinstance(request_id, str) else list(request_id):
            stream = self._streams.get(one)
            if stream is not None:
                stream.abort()  # (marked: `generate` may take its id over)
            else:
                self._post("abort", (one, None))
        return _Posted()

    async def _released(self, request_id: str) -> None:
        """Waits until an aborted request of `request_id` has ended (the next step boundary
        ends it): vLLM frees an aborted id at once, so a caller may reuse it right away."""
        for _ in range(4):  # a loop left by `break` has its generator closed (aborting its
            old = self._streams.get(request_id)  # request) two turns of the event loop later
            if old is None or old._aborted:
                break
            await asyncio.sleep(0)
        while (old := self._streams.get(request_id)) is not None and old._aborted \
                and self.is_alive:
            await asyncio.sleep(0.002)

    def abort_all(self, message: str) -> None:
        """Ends every request now in the engine with finish_reason "error" and `message`
        (a server shutting down). Safe from any thread."""
        self._post("fail_all", message)

    def compile_constraint(self, spec) -> None:
        """Compiles a structured-output constraint ahead of `prepare` (any thread: a server
        runs it off its event loop, and `prepare` then finds it compiled)."""
        self.engine.compile_constraint(spec)

    async def call(self, fn):
        """fn(engine) on the stepping thread, between steps; its result (or exception)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._post("call", (fn, future, loop), alive=True)
        return await future

    async def load_adapter(self, name: str, path: str) -> None:
        """Loads the LoRA adapter in folder `path` as `name` between steps (the folder is
        read on the stepping thread: keep adapters small, or load them at start)."""
        await self.call(lambda engine: engine.lora.load(name, path))

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """vLLM's name: loads `lora_request`'s adapter unless one of its name is loaded
        (True once it is; a folder that does not load raises)."""
        await self.call(lambda engine: load_requested(engine, lora_request))
        return True

    async def unload_adapter(self, name: str, poll_s: float = 0.05) -> None:
        """Stops `name` taking requests, waits for the ones it has, then deletes it."""
        await self.call(lambda engine: engine.lora.begin_unload(name))
        while not await self.call(lambda engine: engine.lora.finish_unload(name)):
            await asyncio.sleep(poll_s)

    def _post(self, kind: str, payload, alive: bool = False) -> None:
        """alive: raise EngineDeadError rather than post what a dead engine would never
        answer."""
        with self._inbox_lock:
            if alive:
                self._check_alive()
            self._inbox.append((kind, payload))
        self._wake.set()

    def _check_alive(self) -> None:
        if self._dead:
            raise EngineDeadError("the engine was shut down.")

    def shutdown(self) -> None:
        with self._inbox_lock:  # nothing is posted after the stepping thread's last drain
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
    HEARTBEAT_S = tp.HEARTBEAT_S  # under tensor parallelism, idle rank 0 pings this often

    def _run(self) -> None:
        reason = "the engine was shut down"
        try:
            self._step_until_shutdown()
        except BaseException as err:  # noqa: BLE001 (a fault of the loop itself, no request's)
            logger.exception("hf-paged: the stepping thread failed; ending every request")
            with self._inbox_lock:  # (later requests raise EngineDeadError, none hangs)
                self._dead = True
            reason = f"the engine's stepping thread failed: {describe(err)}"
        self._drain_inbox()
        outputs = self.engine.fail_all(reason)
        if self.engine.tp_size > 1:
            self.engine.stop_workers()
        self._deliver(outputs)

    def _step_until_shutdown(self) -> None:
        engine = self.engine
        tp = engine.tp_size > 1
        if engine.device.type == "cuda":  # a new thread starts on device 0
            torch.cuda.set_device(engine.device)
        last = time.monotonic()  # when the other ranks last heard from this one (about)
        while not self._dead:
            self._wake.wait(max(0.0, last + self.HEARTBEAT_S - time.monotonic()) if tp else None)
            self._wake.clear()
            if tp and time.monotonic() - last >= self.HEARTBEAT_S:  # (wakes that run no
                engine.heartbeat()  # step do not put it off)
                last = time.monotonic()
            while not self._dead:
                self._drain_inbox()
                if not engine.has_unfinished_requests():
                    break
                try:
                    outputs = engine.step()
                except Exception as err:  # noqa: BLE001 (no single request caused it)
                    logger.exception("hf-paged: an engine step failed; ending its requests")
                    outputs = engine.fail_all(f"the engine step failed: {describe(err)}")
                last = time.monotonic()
                self._deliver(outputs)

    def _drain_inbox(self) -> None:
        while True:
            with self._inbox_lock:
                if not self._inbox:
                    return
                kind, payload = self._inbox.popleft()
                if kind == "add":
                    self._inbox_seqs -= payload.params.n
            if kind == "add":
                try:
                    self.engine.add_prepared(payload)
                except Exception as err:  # noqa: BLE001 (reported to its stream alone)
                    stream = self._streams.pop(payload.request_id, None)
                    if stream is not None:
                        stream._put(err)
            elif kind == "abort":
                request_id, stream = payload  # (a stream's: only while it is the id's)
                if stream is None or self._streams.get(request_id) is stream:
                    self.engine.abort(request_id)
            elif kind == "fail_all":
                self._deliver(self.engine.fail_all(payload))
            elif kind == "call":
                fn, future, loop = payload
                try:
                    result, error = fn(self.engine), None
                except BaseException as err:  # noqa: BLE001 (the caller's to handle)
                    result, error = None, err
                with contextlib.suppress(RuntimeError):  # (its caller's loop is closed)
                    loop.call_soon_threadsafe(_settle, future, result, error)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if stream.held is not None:
                out, stream.held = stream.held.add(out), None
            if out.finished:
                del self._streams[out.request_id]
                if stream.on_finished is not None:
                    try:
                        stream.on_finished(out)
                    except Exception:  # noqa: BLE001 (the caller's bug: never the engine's)
                        logger.exception("hf-paged: on_finished of %s failed", out.request_id)
            elif stream.aborting or stream.unread >= self.max_unread_outputs:
                if not stream.aborting and not stream.stalled:
                    stream.check_reader()  # is the reader reading at all?
                    if stream.delta:  # meanwhile the buffer does not grow: a delta joins
                        stream.held = out  # the next one, and a whole output stands for
                    else:  # the unread one before it
                        stream._supersede(out)
                    continue
                if not stream.aborting:
                    stream.aborting = True
                    self.engine.abort(out.request_id, f"the client did not read its stream "
                                                      f"({stream.unread} outputs unread)")
                if stream.delta:  # (its last output, on the way, brings it)
                    stream.held = out
                continue
            stream._put(out)
