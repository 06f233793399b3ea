"""An OpenAI-compatible HTTP server on the engine (FastAPI; `pip install 'hf-paged[serve]'`).

A thin layer: it validates requests (`protocol.py`), hands them to an `AsyncLLM`, and turns
its outputs into OpenAI responses or server-sent events. `build_app` makes the ASGI app from
a loaded model (a notebook or a training script can serve the model it just trained);
`hf-paged serve` (`serve.py`) loads a folder and runs it with uvicorn; streams are built
in `sse.py`.

One client cannot hold up or end another's requests: keys and body sizes are checked before
anything is parsed (`guard.py`); parsing bodies, tokenization and chat templating run on
worker threads (`bodies.py`, `workers.py`), not the event loop; every request is checked in
full, and admitted against the bound on waiting sequences, before any of its sequences is
queued; a request that fails while running ends alone with finish_reason "error" and the
message (in the body, or as a last error event of its stream); a stream its client does not
read is aborted; each tenant (API key) gets its own prefix-cache namespace.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import replace

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.async_llm import AsyncLLM, RequestStream
from ..engine.detokenizer import TokenPieces
from ..engine.llm import render_chat
from ..engine import BASE, truncate_prompt
from ..errors import InvalidRequestError, RequestRejectedError, describe
from ..sampling_params import StructuredOutputsParams
from .beam import beam_response
from .bodies import body_of, document, parse, validation_error
from .extras import EXTRA_BODIES, add_routes
from .guard import RequestGuard, ServerLimits
from .logprobs import Echo, echo_of
from .metrics import ServerMetrics
from .protocol import (APIError, ChatCompletionRequest, ChatTemplateOptions,
                       CompletionRequest, chat_response, completion_response, new_id)
from .sse import EventStream, chat_events, completion_events
from .tools import PARSERS, auto_parser, template_messages
from .workers import Workers

logger = logging.getLogger("hf_paged")
SHUTDOWN_MESSAGE = "the server is shutting down"


class _Server:
    """What the endpoints share: the engine, model names, tenants, limits and metrics."""

    def __init__(self, llm: AsyncLLM, model_name: str, limits: ServerLimits,
                 salt_by_api_key: bool, runtime_lora: bool = False):
        self.llm, self.model_name, self.runtime_lora = llm, model_name, runtime_lora
        self.limits, self.salt_by_api_key = limits, salt_by_api_key
        self.metrics = ServerMetrics(llm.stats, model_name)
        self.pieces = TokenPieces(llm.tokenizer)
        self.started = int(time.time())
        # Parsing a large body, tokenizing a long prompt or encoding a large response takes
        # long: never on the event loop. Constraint compiles have threads of their own.
        self.workers = Workers(4, "hf-paged-worker")
        self.compiles = Workers(4, "hf-paged-compile")
        self.draining = False
        self.loop: asyncio.AbstractEventLoop | None = None  # the serving loop, once started
        self.tool_parser = "hermes"  # the format of the model's own tool calls

    # -- checks, before anything is queued --------------------------------------------------
    def check_open(self) -> None:
        if self.draining:
            raise APIError(503, "The server is shutting down.", None, "server_busy",
                           headers={"Retry-After": "5"})

    @property
    def adapters(self) -> list[str]:
        """The LoRA adapters served under their names (those being unloaded excluded)."""
        return self.llm.adapters

    def adapter_for(self, model: str) -> str | None:
        """The engine adapter of a request's `model`; APIError 404 for an unknown one."""
        if model == self.model_name:  # the base model, whatever adapters come and go
            return BASE
        if model in self.adapters:
            return model
        raise APIError(404, f"The model `{model}` does not exist; this server has "
                       f"{[self.model_name] + self.adapters}.", "model", "not_found_error",
                       "model_not_found")

    def check_stops(self, stops: list[str], field: str = "stop") -> None:
        """The limits on stop strings (and on bad words, `field` "bad_words")."""
        limits = self.limits
        if len(stops) > limits.max_stop_strings:
            raise APIError(400, f"{field}: at most {limits.max_stop_strings} strings; got "
                           f"{len(stops)}.", field)
        total = sum(len(s) for s in stops)
        if total > limits.max_stop_chars:
            raise APIError(400, f"{field}: the strings may have {limits.max_stop_chars} "
                           f"characters in all; got {total}.", field)

    def truncated(self, ids: list[int], keep: int | None) -> list[int]:
        """A prompt's ids as `truncate_prompt_tokens` leaves them (cut here as the engine
        cuts them, so that the echo, the usage and the default max_tokens see it)."""
        return truncate_prompt(ids, keep, self.llm.max_model_len)

    def timeout_for(self, asked: float | None) -> float | None:
        limit = self.limits.request_timeout
        return limit if asked is None else asked if limit is None else min(asked, limit)

    def salt_for(self, tenant: str, asked: str | None) -> str | None:
        """The request's prefix-cache namespace: its tenant's (with API keys) and its own."""
        if not self.salt_by_api_key or tenant is None:
            return asked
        return json.dumps([tenant, asked])

    async def off_loop(self, fn, *args):
        return await self.workers.run(fn, *args)

    def need_tokenizer(self, param: str):
        if self.llm.tokenizer is None:
            raise APIError(400, "This server has no tokenizer; send token ids.", param)
        return self.llm.tokenizer

    async def tokens(self, prompt, param: str) -> list[int]:
        if isinstance(prompt, str):
            return (await self.off_loop(self.need_tokenizer(param), prompt))["input_ids"]
        return list(prompt)

    async def prompt_text(self, prompt, ids: list[int]) -> Echo:
        return await self.off_loop(echo_of, self.llm.tokenizer, prompt, ids)

    async def chat_tokens(self, messages: list, options: ChatTemplateOptions,
                          add_special_tokens: bool = False, tools: list | None = None
                          ) -> list[int]:
        """Chat messages (ChatMessage) rendered by the chat template (with `tools`, if
        any, and the request's template options), as token ids."""
        tokenizer = self.llm.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise APIError(400, "The model's tokenizer has no chat template, so chat completions "
                           "cannot be formatted; use /v1/completions.", "messages")
        messages = template_messages([m.as_template_input() for m in messages])

        def render():
            return render_chat(tokenizer, messages, tools, add_special_tokens,
                               **options.template_kwargs())[1]

        try:
            return await self.off_loop(render)
        except Exception as err:  # noqa: BLE001 (a template that rejects these messages)
            raise APIError(400, f"The chat template could not format these messages: "
                           f"{describe(err)}", "messages") from err

    def default_max_tokens(self, prompt_len: int) -> int:
        """Chat without max_tokens: as much as the context and the pool leave."""
        llm = self.llm
        return max(1, min(llm.max_model_len, llm.kv_capacity_tokens) - prompt_len
                   - llm.block_size)

    # -- running -----------------------------------------------------------------------------
    async def compile_constraint(self, params, field: str) -> None:
        """A request's structured-output constraint compiled on a worker thread (a large
        schema takes a while), so that `start` finds it ready."""
        if params.structured_outputs is not None:
            try:
                await self.compiles.run(self.llm.compile_constraint, params.structured_outputs)
            except InvalidRequestError as err:  # (named by the field the client used)
                message = str(err).removeprefix("structured_outputs: ")
                raise APIError(400, f"{field}: {message}", field) from err

    def check_count(self, prompts: int, n: int) -> None:
        """APIError 400 for a request of more sequences (prompts x n) than may wait; it names
        `n` where n > 1, else the prompts."""
        bound = self.limits.max_waiting_sequences
        if 0 < bound < prompts * n:
            self.metrics.rejected.labels(self.model_name, "400").inc()
            raise APIError(400, f"This request has {prompts * n} sequences (prompts x n); the "
                           f"server queues at most {bound} (--max-waiting-requests).",
                           "n" if n > 1 else "prompt")

    def start(self, prompts: list[list[int]], params, adapter, priority: int, tenant,
              cache_salt: str | None, field: str) -> list[RequestStream]:
        """Checks every prompt, admits them together, then queues them (no await between
        the admission and the queueing: concurrent requests cannot overshoot the bound).
        Each request is counted in the metrics when it ends, read to the end or not."""
        self.check_count(len(prompts), params.n)
        cache_salt = self.salt_for(tenant, cache_salt)
        prepared = []
        for prompt in prompts:
            try:
                prepared.append(self.llm.prepare(prompt, params, new_id("req"), priority,
                                                 adapter, cache_salt))
            except (RequestRejectedError, InvalidRequestError) as err:
                rejected = isinstance(err, RequestRejectedError)  # (never runs)
                if rejected:
                    self.metrics.rejected.labels(self.model_name, "400").inc()
                code = "context_length_exceeded" if rejected and err.param is None else None
                param = field if err.param in (None, "prompt") else err.param
                raise APIError(400, str(err), param, code=code) from err
        new, bound = len(prompts) * params.n, self.limits.max_waiting_sequences
        waiting = self.llm.num_waiting_sequences()
        if waiting + new > bound:
            self.metrics.rejected.labels(self.model_name, "503").inc()
            raise APIError(503, f"The server has {waiting} sequences waiting and this request "
                           f"adds {new} (the limit is {bound}); retry shortly.", None,
                           "server_busy", headers={"Retry-After": "1"})
        return [self.llm.submit(r, lambda out: self.metrics.finished(out, tenant))
                for r in prepared]

    async def respond(self, build, *args) -> Response:
        """The JSON response `build(*args)` makes, built and encoded on a worker thread
        (n choices with logprobs make tens of megabytes: seconds of work)."""
        def encode() -> bytes:
            return json.dumps(build(*args), ensure_ascii=False, allow_nan=False,
                              separators=(",", ":")).encode()
        try:
            body = await self.off_loop(encode)
        except APIError:
            if not self.workers.closed:
                raise
            body = encode()  # (at shutdown, with the workers gone: the request's own error)
        return Response(body, media_type="application/json")

    async def collect(self, streams: list[RequestStream], request: Request):
        """The final outputs of `streams`, or None if the client left first (then they are
        aborted, their blocks freed)."""
        tasks = [asyncio.ensure_future(_last(s)) for s in streams]
        try:
            while True:
                _, pending = await asyncio.wait(tasks, timeout=0.5)
                if not pending:
                    break
                if await request.is_disconnected():
                    return None
            results = [t.result() for t in tasks]
        finally:
            for stream in streams:
                stream.abort()
            for task in tasks:
                task.cancel()
        for result in results:
            if isinstance(result, BaseException):
                raise APIError(500, describe(result), None, "server_error")
        return results

    def begin_shutdown(self) -> None:
        """Safe from a signal handler or another thread: refuse new requests (503), give
        open ones `limits.shutdown_grace` seconds, then end them with an error (streams with
        an error event and [DONE])."""
        if self.draining or self.loop is None:
            return
        self.draining = True
        self.loop.call_soon_threadsafe(self.loop.call_later, self.limits.shutdown_grace,
                                       self.end_all)

    def end_all(self) -> None:
        """Ends every open request with an error: in the engine, and those still waiting
        for a worker (a compile may run for minutes)."""
        self.llm.abort_all(SHUTDOWN_MESSAGE)
        self.close_workers()

    def close_workers(self) -> None:
        """What still waits for a worker gets a 503; new work is refused."""
        for workers in (self.workers, self.compiles):
            workers.fail(APIError(503, "The server is shutting down.", None, "server_busy"))


async def _last(stream: RequestStream):
    out = None
    try:
        async for out in stream:
            pass
    except Exception as err:  # noqa: BLE001 (reported by the caller)
        return err
    return out


def _error(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def build_app(model=None, tokenizer=None, *, llm: AsyncLLM | None = None,
              served_model_name: str | None = None, api_key: str | list[str] | None = None,
              max_waiting_requests: int | None = None, limits: ServerLimits | None = None,
              salt_by_api_key: bool = True, metrics_without_auth: bool = False,
              max_unread_outputs: int = 256, tool_call_parser: str = "auto",
              runtime_lora: bool = False, **engine_options) -> FastAPI:
    """The ASGI app serving `model` (a loaded model, a PEFT model with LoRA adapters, or a
    folder), or an existing `llm` (which the app then does not shut down). Adapters of a
    PEFT model are served under their names, the base model under `served_model_name` (by
    default the model's name_or_path). `engine_options` are `LLMEngine`'s.

    api_key: one key or several (one tenant each); with keys, every path but /health needs
    one (/metrics too, unless `metrics_without_auth`), and each tenant's prompts are cached
    apart (`salt_by_api_key`). limits: see `ServerLimits` (`max_waiting_requests` sets its
    max_waiting_sequences). tool_call_parser: the format of the model's tool calls
    (hermes, llama3_json, mistral; auto: read from the chat template). runtime_lora:
    serve /v1/load_lora_adapter and /v1/unload_lora_adapter (off: loading files from a
    path a client names is a privilege)."""
    owned = llm is None
    if owned:
        llm = AsyncLLM(model, tokenizer, max_unread_outputs=max_unread_outputs, **engine_options)
    limits = limits or ServerLimits()
    if max_waiting_requests is not None:  # (a checked copy: the caller's limits stay theirs)
        limits = replace(limits, max_waiting_sequences=max_waiting_requests)
    keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    if any(not isinstance(k, str) or not k for k in keys):
        raise ValueError("API keys must be non-empty strings.")
    name = served_model_name or llm.model_name
    if tool_call_parser != "auto" and tool_call_parser not in PARSERS:
        raise ValueError(f"tool_call_parser must be 'auto' or one of {PARSERS}; got "
                         f"{tool_call_parser!r}.")
    server = _Server(llm, name, limits, salt_by_api_key and bool(keys), runtime_lora)
    server.tool_parser = tool_call_parser if tool_call_parser != "auto" else \
        auto_parser(getattr(llm.tokenizer, "chat_template", None))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.loop = asyncio.get_running_loop()
        yield
        server.close_workers()
        if owned:  # in-flight requests end with an error; their streams close
            llm.shutdown()

    app = FastAPI(title="hf-paged", lifespan=lifespan)
    app.state.server = server
    app.add_middleware(RequestGuard, api_keys=keys, max_request_bytes=limits.max_request_bytes,
                       metrics_without_auth=metrics_without_auth)

    @app.exception_handler(APIError)
    async def api_error(request, err: APIError):
        return _error(err)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, err: RequestValidationError):  # (a path's or query's)
        return _error(validation_error(err))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, err: StarletteHTTPException):
        if err.status_code == 400:  # FastAPI could not parse the body (bad UTF-8, too deep)
            message = "The request body could not be parsed as JSON (invalid UTF-8, or nested " \
                      "too deeply)."
        else:
            message = str(err.detail)
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return _error(APIError(err.status_code, message, None, kind,
                               headers=getattr(err, "headers", None)))

    @app.get("/health")
    async def health():
        if not llm.is_alive:
            return JSONResponse({"status": "dead"}, status_code=503)
        if server.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        entry = dict(object="model", created=server.started, owned_by="hf-paged",
                     max_model_len=llm.max_model_len)
        data = [dict(entry, id=server.model_name, root=server.model_name, parent=None)]
        data += [dict(entry, id=a, root=a, parent=server.model_name) for a in server.adapters]
        return {"object": "list", "data": data}

    @app.get("/v1/models/{model:path}")  # (a served name may hold slashes: org/model)
    async def model(model: str):
        server.adapter_for(model)  # the 404 of an unknown one
        return next(m for m in (await models())["data"] if m["id"] == model)

    add_routes(app, server)  # /tokenize, /detokenize, /tokenizer_info, runtime LoRA

    @app.post("/v1/completions", openapi_extra=body_of(CompletionRequest))
    async def completions(request: Request):
        server.check_open()
        body = await parse(server, CompletionRequest, request)
        adapter = server.adapter_for(body.model)
        server.check_stops(body.stops())
        server.check_stops(body.bad_words or [], "bad_words")
        params = body.sampling_params(body.engine_max_tokens, body.logprobs,
                                      server.timeout_for(body.timeout), body.echo_logprobs)
        raw = body.prompts()
        server.check_count(len(raw), params.n)  # (before any of them is tokenized)
        await server.compile_constraint(params, body.constraint_field)
        whole = [await server.tokens(p, "prompt") for p in raw]
        prompts = [server.truncated(p, body.truncate_prompt_tokens) for p in whole]
        echo = [await server.prompt_text(r if len(w) == len(p) else p, p)  # (as it is run)
                for r, w, p in zip(raw, whole, prompts)] if body.echo else None
        if body.use_beam_search:
            return await beam_response(server, request, body, prompts, adapter, params)
        tenant = request.state.tenant
        streams = server.start(prompts, params, adapter, body.priority, tenant,
                               body.cache_salt, "prompt")
        rid = new_id("cmpl")
        if body.stream:
            return EventStream(completion_events(server, body, rid, streams, echo),
                               streams)
        results = await server.collect(streams, request)
        if results is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        return await server.respond(completion_response, rid, body.model, results, body,
                                    server.pieces, echo)

    @app.post("/v1/chat/completions", openapi_extra=body_of(ChatCompletionRequest))
    async def chat(request: Request):
        server.check_open()
        body = await parse(server, ChatCompletionRequest, request)
        adapter = server.adapter_for(body.model)
        server.check_stops(body.stops())
        server.check_stops(body.bad_words or [], "bad_words")
        top = body.logprob_count()
        tools = body.tool_mode(server.tool_parser)
        forced = body.forced_tool_schema(tools)
        prompt = server.truncated(await server.chat_tokens(body.messages, body,
                                                           tools=body.tools),
                                  body.truncate_prompt_tokens)
        max_tokens = body.max_completion_tokens or body.max_tokens or \
            server.default_max_tokens(len(prompt))
        params = body.sampling_params(max_tokens, top, server.timeout_for(body.timeout),
                                      constraint=None if forced is None else
                                      StructuredOutputsParams(json=forced))
        await server.compile_constraint(params, body.constraint_field if forced is None
                                        else "tools")  # (a function's parameters)
        if body.use_beam_search:
            return await beam_response(server, request, body, [prompt], adapter, params)
        tenant = request.state.tenant
        streams = server.start([prompt], params, adapter, body.priority, tenant,
                               body.cache_salt, "messages")
        rid = new_id("chatcmpl")
        if body.stream:
            return EventStream(chat_events(server, body, rid, streams[0], top or 0, tools),
                               streams)
        results = await server.collect(streams, request)
        if results is None:
            return Response(status_code=499)
        return await server.respond(chat_response, rid, body.model, results[0],
                                    server.pieces.reading(body.skip_special_tokens), top or 0,
                                    tools, server.llm.tokenizer, body.echoed(),
                                    body.prompt_logprobs)

    document(app, [CompletionRequest, ChatCompletionRequest, *EXTRA_BODIES])
    return app
