"""An OpenAI-compatible HTTP server on the engine (FastAPI; `pip install 'hf-paged[serve]'`).

A thin layer: it validates requests (`protocol.py`), hands them to an `AsyncLLM`, and turns
its outputs into OpenAI responses or server-sent events. `build_app` makes the ASGI app from
a loaded model (a notebook or a training script can serve the model it just trained);
`hf-paged serve` (`serve.py`) loads a folder and runs it with uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .async_llm import AsyncLLM, EngineDeadError
from .engine import BASE
from .metrics import ServerMetrics
from .outputs import RequestOutput
from .protocol import (
    APIError, ChatCompletionRequest, CompletionRequest, TokenText, chat_logprobs,
    chat_response, completion_logprobs, completion_response, new_id, usage,
)
from .scheduler import RequestRejectedError


class _Server:
    """What the endpoints share: the engine, model names, limits and metrics."""

    def __init__(self, llm: AsyncLLM, model_name: str, adapters: list[str],
                 api_key: str | None, max_waiting: int):
        self.llm, self.model_name, self.adapters = llm, model_name, list(adapters)
        self.api_key, self.max_waiting = api_key, max_waiting
        self.metrics = ServerMetrics(llm.stats, model_name)
        self.text = TokenText(llm.tokenizer)
        self.started = int(time.time())

    def adapter_for(self, model: str) -> str | None:
        """The engine adapter of a request's `model`; APIError 404 for an unknown one."""
        if model == self.model_name:
            return BASE if self.adapters else None
        if model in self.adapters:
            return model
        raise APIError(404, f"The model `{model}` does not exist; this server has "
                       f"{[self.model_name] + self.adapters}.", "model", "not_found_error",
                       "model_not_found")

    def admit(self) -> None:
        """503 with Retry-After past the bound of waiting sequences (no unbounded growth)."""
        stats = self.llm.stats()
        if stats.waiting >= self.max_waiting:
            self.metrics.rejected.labels(self.model_name, "503").inc()
            raise APIError(503, f"The server has {stats.waiting} requests waiting (the limit is "
                           f"{self.max_waiting}); retry shortly.", None, "server_busy",
                           headers={"Retry-After": "1"})

    def tokens(self, prompt, param: str) -> list[int]:
        if isinstance(prompt, str):
            if self.llm.tokenizer is None:
                raise APIError(400, "This server has no tokenizer; send token ids.", param)
            return self.llm.tokenizer(prompt)["input_ids"]
        return list(prompt)

    def chat_tokens(self, request: ChatCompletionRequest) -> list[int]:
        tokenizer = self.llm.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise APIError(400, "The model's tokenizer has no chat template, so chat completions "
                           "cannot be formatted; use /v1/completions.", "messages")
        messages = [m.as_template_input() for m in request.messages]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def default_max_tokens(self, prompt_len: int) -> int:
        """Chat without max_tokens: as much as the context and the pool leave."""
        engine = self.llm.engine
        room = engine.scheduler.pool.num_blocks * engine.block_size
        return max(1, min(engine.max_model_len, room) - prompt_len - engine.block_size)

    async def run(self, prompt: list[int], params, adapter, priority, request: Request):
        """The final output of one request; aborted if the client leaves first."""
        stream = self.llm.generate(prompt, params, new_id("req"), priority, adapter)
        task = asyncio.ensure_future(_last(stream))
        while not task.done():
            await asyncio.wait([task], timeout=0.5)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                await stream.aclose()
                raise asyncio.CancelledError
        out = task.result()
        self.metrics.finished(out)
        return out


async def _last(stream):
    out = None
    async with contextlib.aclosing(stream):
        async for out in stream:
            pass
    return out


def _error(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data)}\n\n"


def build_app(model=None, tokenizer=None, *, llm: AsyncLLM | None = None,
              served_model_name: str | None = None, api_key: str | None = None,
              max_waiting_requests: int = 512, **engine_options) -> FastAPI:
    """The ASGI app serving `model` (a loaded model, a PEFT model with LoRA adapters, or a
    folder), or an existing `llm` (which the app then does not shut down). Adapters of a
    PEFT model are served under their names, the base model under `served_model_name` (by
    default the model's name_or_path). `engine_options` are `LLMEngine`'s."""
    owned = llm is None
    if owned:
        llm = AsyncLLM(model, tokenizer, **engine_options)
    engine = llm.engine
    name = served_model_name or str(getattr(engine._base.config, "name_or_path", "") or "model")
    server = _Server(llm, name, engine.adapters, api_key, max_waiting_requests)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        if owned:  # in-flight requests end with an error; their streams close
            llm.shutdown()

    app = FastAPI(title="hf-paged", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(APIError)
    async def api_error(request, err: APIError):
        return _error(err)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {}
        loc = [str(x) for x in first.get("loc", []) if x != "body"]
        message = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            message, loc = "The request body is not valid JSON.", []
        # The field is the top-level name; the path (with union members) goes in the message.
        return _error(APIError(400, f"{'.'.join(loc) + ': ' if loc else ''}{message}",
                               loc[0] if loc else None))

    @app.middleware("http")
    async def auth(request: Request, call_next):
        if server.api_key and request.url.path.startswith("/v1"):
            if request.headers.get("authorization") != f"Bearer {server.api_key}":
                return _error(APIError(401, "Missing or wrong API key (Authorization: Bearer).",
                                       None, "authentication_error", "invalid_api_key"))
        return await call_next(request)

    @app.get("/health")
    async def health():
        if not llm._thread.is_alive():
            return JSONResponse({"status": "dead"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        entry = dict(object="model", created=server.started, owned_by="hf-paged")
        data = [dict(entry, id=server.model_name, root=server.model_name, parent=None)]
        data += [dict(entry, id=a, root=a, parent=server.model_name) for a in server.adapters]
        return {"object": "list", "data": data}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        adapter = server.adapter_for(body.model)
        prompts = [server.tokens(p, "prompt") for p in body.prompts()]
        params = body.sampling_params(body.max_tokens or 16, body.logprobs)
        for p in prompts:
            _check(server, p, params)
        server.admit()
        rid = new_id("cmpl")
        if body.stream:
            return StreamingResponse(_stream_completions(server, body, rid, prompts, params,
                                                         adapter), media_type="text/event-stream")
        results = await asyncio.gather(*(server.run(p, params, adapter, body.priority, request)
                                         for p in prompts))
        return completion_response(rid, body.model, results, body.n, server.text)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        adapter = server.adapter_for(body.model)
        prompt = server.chat_tokens(body)
        max_tokens = body.max_completion_tokens or body.max_tokens or \
            server.default_max_tokens(len(prompt))
        top = body.logprob_count()
        params = body.sampling_params(max_tokens, top)
        _check(server, prompt, params, "messages")
        server.admit()
        rid = new_id("chatcmpl")
        if body.stream:
            return StreamingResponse(_stream_chat(server, body, rid, prompt, params, adapter,
                                                  top or 0), media_type="text/event-stream")
        result = await server.run(prompt, params, adapter, body.priority, request)
        return chat_response(rid, body.model, result, server.text, top or 0)

    return app


def _check(server: _Server, prompt: list[int], params, field: str = "prompt") -> None:
    """The engine's own checks, as 400s naming the field, before anything runs."""
    engine = server.llm.engine
    bad = [t for t in prompt if not 0 <= t < engine.vocab_size]
    if bad:
        raise APIError(400, f"prompt token ids must be in [0, {engine.vocab_size}); got "
                       f"{bad[:5]}.", field)
    resolved = params.resolved(engine.defaults)
    try:
        engine.scheduler.check_fits(len(prompt), resolved.max_tokens, resolved.n)
    except RequestRejectedError as err:
        server.metrics.rejected.labels(server.model_name, "400").inc()
        raise APIError(400, str(err), field, code="context_length_exceeded") from err


async def _outputs(server: _Server, prompt, params, adapter, priority):
    """The request's outputs as they come; the last one is observed in the metrics."""
    stream = server.llm.generate(prompt, params, new_id("req"), priority, adapter)
    async with contextlib.aclosing(stream):
        async for out in stream:
            if out.finished:
                server.metrics.finished(out)
            yield out


class _Deltas:
    """What each choice of a stream has been sent: tokens, characters, and whether its end.
    While a completion may still end on a stop string, the last characters that could be
    the start of one are held back (the final text is cut before the stop string)."""

    def __init__(self, params):
        self.hold = max((len(s) for s in params.stop), default=1) - 1
        self.sent: dict[int, list] = {}

    def next(self, index: int, c) -> tuple[int, str] | None:
        """(first token not sent, new text) for choice `index`, or None if nothing is new."""
        state = self.sent.setdefault(index, [0, 0, False])
        tokens, chars, done = state
        if done or (len(c.token_ids) == tokens and not c.finished):
            return None
        visible = len(c.text) if c.finished else max(chars, len(c.text) - self.hold)
        state[:] = [len(c.token_ids), visible, c.finished]
        return tokens, c.text[chars:visible]


async def _stream_completions(server, body, rid, prompts, params, adapter):
    created, n = int(time.time()), body.n
    deltas = _Deltas(params)
    prompt_tokens = completion_tokens = 0
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, prompt):
        try:
            async for out in _outputs(server, prompt, params, adapter, body.priority):
                await queue.put((i, out))
        except Exception as err:  # noqa: BLE001 (reported in the stream)
            await queue.put((i, err))
        await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, p)) for i, p in enumerate(prompts)]
    try:
        live = len(prompts)
        while live:
            i, out = await queue.get()
            if out is None:
                live -= 1
                continue
            if isinstance(out, Exception):
                yield _sse(APIError(500, f"{type(out).__name__}: {out}", None,
                                    "server_error").body())
                continue
            for c in out.outputs:
                index = i * n + c.index
                chars_before = deltas.sent.get(index, [0, 0, False])[1]
                delta = deltas.next(index, c)
                if delta is None:
                    continue
                start, text = delta
                choice = {"index": index, "text": text, "finish_reason": c.finish_reason,
                          "logprobs": None if c.logprobs is None else
                          completion_logprobs(c, start, server.text, chars_before)}
                yield _sse({"id": rid, "object": "text_completion", "created": created,
                            "model": body.model, "choices": [choice]})
            if out.finished:
                prompt_tokens += len(out.prompt_token_ids)
                completion_tokens += sum(len(c.token_ids) for c in out.outputs)
        if body.include_usage:
            yield _sse({"id": rid, "object": "text_completion", "created": created,
                        "model": body.model, "choices": [],
                        "usage": usage(prompt_tokens, completion_tokens)})
        yield "data: [DONE]\n\n"
    finally:
        for task in tasks:
            task.cancel()


async def _stream_chat(server, body, rid, prompt, params, adapter, top):
    head = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": body.model}
    deltas = _Deltas(params)
    last: RequestOutput | None = None
    try:
        async for out in _outputs(server, prompt, params, adapter, body.priority):
            last = out
            for c in out.outputs:
                if c.index not in deltas.sent:  # the role first, as OpenAI streams it
                    yield _sse(dict(head, choices=[{"index": c.index, "delta": {
                        "role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None}]))
                delta = deltas.next(c.index, c)
                if delta is None:
                    continue
                start, text = delta
                choice = {"index": c.index, "delta": {"content": text},
                          "finish_reason": c.finish_reason, "logprobs": None if c.logprobs
                          is None else chat_logprobs(c, start, server.text, top)}
                yield _sse(dict(head, choices=[choice]))
    except (EngineDeadError, RequestRejectedError) as err:
        yield _sse(APIError(500, str(err), None, "server_error").body())
    if body.include_usage and last is not None:
        yield _sse(dict(head, choices=[], usage=usage(
            len(last.prompt_token_ids), sum(len(c.token_ids) for c in last.outputs))))
    yield "data: [DONE]\n\n"
