"""Server-sent event streams of completions and chat: OpenAI's chunks from a request's
outputs as they come, then an error event if it failed, the usage, and `[DONE]`.

The engine's text only grows (an incomplete character, and the characters that could start
a stop string, are held back there), so the deltas a client adds up are the text of the
same request without `stream`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

from fastapi.responses import StreamingResponse

from ..engine.async_llm import RequestStream
from ..errors import describe
from ..outputs import RequestOutput
from .logprobs import (TextOffsets, chat_logprobs, completion_logprobs, completion_pieces,
                       echoed, joined_logprobs, scored_only)
from .protocol import error_body, usage
from .tools import marker


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data)}\n\n"


class EventStream(StreamingResponse):
    """Server-sent events whose generator is closed however the response ends (a client
    gone mid-send included), so its requests are always aborted."""

    def __init__(self, events, streams: list[RequestStream]):
        super().__init__(events, media_type="text/event-stream")
        self._events, self._streams = events, streams

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            for stream in self._streams:
                stream.abort()
            await self._events.aclose()


class _Deltas:
    """What each choice of a stream has been sent: tokens, characters, and whether its end.
    (The engine's text already leaves out what could start a stop string.)"""

    def __init__(self, hold: int = 0, spaces: bool = False):
        """hold: characters to hold back until the end (a tool-call marker's start);
        spaces: trailing whitespace too, until text follows it (content before a tool call
        ends without it)."""
        self.hold, self.spaces = hold, spaces
        self.sent: dict[int, list] = {}

    def next(self, index: int, c) -> tuple[int, str] | None:
        """(first token not sent, new text) for choice `index`, or None if nothing is new."""
        state = self.sent.setdefault(index, [0, 0, False])
        tokens, chars, done = state
        if done or (len(c.token_ids) == tokens and not c.finished):
            return None
        visible = len(c.text)
        if not c.finished:
            visible = max(visible - self.hold, 0)
            if self.spaces:
                visible = len(c.text[:visible].rstrip())
            visible = max(chars, visible)
        state[:] = [len(c.token_ids), visible, c.finished]
        return tokens, c.text[chars:visible]


async def _merged(streams: list[RequestStream]):
    """(index, output) of several streams as they come. A bounded queue keeps the readers
    in step with the client: a client that stops reading leaves the engine's per-request
    buffers to fill, and those requests are aborted."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))

    async def pump(i, stream):
        try:
            async for out in stream:
                await queue.put((i, out))
        except Exception as err:  # noqa: BLE001 (reported in the stream)
            await queue.put((i, err))
        await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        live = len(streams)
        while live:
            i, out = await queue.get()
            if out is None:
                live -= 1
            else:
                yield i, out
    finally:
        for task in tasks:
            task.cancel()


async def completion_events(server, body, rid, streams, echo=None):
    """echo: per prompt, its Echo, sent (with its logprobs) before a choice's first text."""
    created, n = int(time.time()), body.n
    deltas = _Deltas()
    scoring = body.max_tokens == 0  # the prompt alone: the sampled token is dropped
    offsets: dict[int, TextOffsets] = {}  # per choice, its tokens' text offsets so far
    prompt_tokens = completion_tokens = cached = 0
    errors = []
    async with contextlib.aclosing(_merged(streams)) as merged:
        async for i, out in merged:
            if isinstance(out, BaseException):
                errors.append(describe(out))
                continue
            for c in out.outputs:
                index = i * n + c.index
                first = index not in deltas.sent
                if scoring:  # one chunk per choice, once its request ends
                    if not (c.finished and first):
                        continue
                    deltas.sent[index] = [0, 0, True]
                    c = scored_only(c)
                    start, text = 0, ""
                else:
                    delta = deltas.next(index, c)
                    if delta is None:
                        continue
                    start, text = delta
                head, head_lps = echoed(out, echo[i], server.pieces, body.logprobs) \
                    if echo is not None and first else ("", None)
                lps = None
                if c.logprobs is not None:  # text offsets go on from the last chunk's
                    at = offsets.setdefault(index, TextOffsets(
                        len(echo[i].text) if echo is not None else 0))
                    lps = completion_logprobs(c, start, completion_pieces(
                        server.pieces, c, body.skip_special_tokens,
                        body.include_stop_str_in_output), at)
                choice = {"index": index, "text": head + text, "finish_reason": c.finish_reason,
                          "stop_reason": c.stop_reason, "logprobs": joined_logprobs(head_lps, lps)}
                yield _sse({"id": rid, "object": "text_completion", "created": created,
                            "model": body.model, "choices": [choice]})
            if out.finished:
                prompt_tokens += len(out.prompt_token_ids)
                completion_tokens += 0 if scoring else sum(len(c.token_ids) for c in out.outputs)
                cached += out.num_cached_tokens
                if out.error:
                    errors.append(out.error if len(streams) == 1 else f"prompt {i}: {out.error}")
    if errors:
        yield _sse({"error": error_body("; ".join(errors))})
    if body.include_usage:
        yield _sse({"id": rid, "object": "text_completion", "created": created,
                    "model": body.model, "choices": [],
                    "usage": usage(prompt_tokens, completion_tokens, cached)})
    yield "data: [DONE]\n\n"


def _tool_choice(server, pieces, tools, c, sent: list, top: int) -> dict:
    """The last chunk of a held answer: what is left of its content, then its calls, with
    the logprobs of the tokens held (as a response without streaming has them)."""
    content, calls = tools.answer(c, server.llm.tokenizer)
    delta: dict = {}
    rest = (content or "")[sent[1]:] if calls else c.text[sent[1]:]
    if rest:
        delta["content"] = rest
    if calls:
        delta["tool_calls"] = [call.as_openai(i) for i, call in enumerate(calls)]
    logprobs = None if c.logprobs is None else chat_logprobs(c, sent[0], pieces, top)
    sent[:] = [len(c.token_ids), len(c.text), True]
    return {"index": c.index, "delta": delta, "logprobs": logprobs,
            "finish_reason": tools.finish_reason(c, calls),
            "stop_reason": c.stop_reason}


async def chat_events(server, body, rid, stream, top, tools=None):
    """tools (a ToolMode): an answer that turns out to be a tool call is held back once
    its marker shows, and sent as `tool_calls` deltas when it ends. What `echo` puts
    before an answer comes with its role."""
    head = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": body.model}
    deltas = _Deltas(len(marker(tools.parser)) - 1 if tools is not None else 0,
                     tools is not None)
    held: set[int] = set()  # choices whose answer may be a tool call
    pieces = server.pieces.reading(body.skip_special_tokens)
    last: RequestOutput | None = None
    error = None
    try:
        async for out in stream:
            last = out
            for c in out.outputs:
                if c.index not in deltas.sent and c.index not in held:  # the role first
                    yield _sse(dict(head, choices=[{"index": c.index, "delta": {
                        "role": "assistant", "content": body.echoed()}, "logprobs": None,
                        "finish_reason": None}]))
                    deltas.sent.setdefault(c.index, [0, 0, False])
                if tools is not None and (c.index in held or tools.holds(c, server.llm.tokenizer)):
                    held.add(c.index)
                    if c.finished and not deltas.sent[c.index][2]:  # (once: with n > 1,
                        # later outputs still show a choice that has ended)
                        yield _sse(dict(head, choices=[_tool_choice(
                            server, pieces, tools, c, deltas.sent[c.index], top)]))
                    continue
                delta = deltas.next(c.index, c)
                if delta is None:
                    continue
                start, text = delta
                choice = {"index": c.index, "delta": {"content": text},
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                          "logprobs": None if c.logprobs is None
                          else chat_logprobs(c, start, pieces, top)}
                yield _sse(dict(head, choices=[choice]))
    except Exception as err:  # noqa: BLE001 (reported in the stream)
        error = describe(err)
    if last is not None and last.finished:
        error = error or last.error
    if error:
        yield _sse({"error": error_body(error)})
    if body.include_usage and last is not None:
        yield _sse(dict(head, choices=[], usage=usage(
            len(last.prompt_token_ids), sum(len(c.token_ids) for c in last.outputs),
            last.num_cached_tokens)))
    yield "data: [DONE]\n\n"
