"""The OpenAI API's request and response shapes, and their translation to the engine's.

Requests are validated with pydantic: a field of the wrong type or out of range is a 400
naming it (unknown fields are ignored, as OpenAI's own server does), and so is a string that
is not valid Unicode (a lone surrogate such as "\ud800"). Responses and stream chunks are
plain dicts in OpenAI's layout.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..engine.detokenizer import TokenPieces
from ..errors import APIError, InvalidRequestError
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams, StructuredOutputsParams
from .bodies import shown
from .logprobs import (Echo, chat_logprobs, completion_logprobs, completion_pieces, echoed,
                       joined_logprobs, ranked_prompt_logprobs, scored_only)
from .tools import ToolMode, check_tools, forced_schema


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


def _check_unicode(data: Any) -> None:
    """APIError 400 naming the top-level field of the first string that UTF-8 cannot
    encode (walked without recursion: a deeply nested body cannot exhaust the stack)."""
    if not isinstance(data, dict):
        return
    todo = [(key, value) for key, value in data.items()]
    while todo:
        field, value = todo.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise APIError(400, f"{field}: strings must be valid Unicode (no lone "
                               "surrogates such as \\ud800).", str(field)) from None
        elif isinstance(value, dict):
            todo += [(field, k) for k in value] + [(field, v) for v in value.values()]
        elif isinstance(value, list) and set(map(type, value)) - _PLAIN:  # (token ids: C speed)
            todo += [(field, v) for v in value if type(v) not in _PLAIN]


_PLAIN = {int, float, bool, type(None)}  # values without strings in them


def _token_ids(value) -> bool:
    return isinstance(value, list) and set(map(type, value)) <= {int}


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: "text", "json_object", or "json_schema" with a schema
    (always enforced; `strict` is accepted and changes nothing)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


# vLLM's older names of the structured_outputs fields, still sent by many clients.
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}


class UnicodeBody(BaseModel):
    """A request body whose strings must all be valid Unicode (a 400 naming the field)."""

    @model_validator(mode="before")
    @classmethod
    def _unicode(cls, data):
        _check_unicode(data)
        return data


class _Sampling(UnicodeBody):
    """Fields shared by completions and chat (OpenAI's, then the extras vLLM accepts)."""

    model_config = ConfigDict(extra="ignore")

    model: str
    n: int = Field(1, ge=1, le=64)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (a string) -> bias in [-100, 100]
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=20)  # vLLM's, in the response
    priority: int = 0
    cache_salt: str | None = Field(None, min_length=1)  # vLLM's: a prefix-cache namespace
    timeout: float | None = Field(None, gt=0)  # seconds until the request ends ("timeout")
    use_beam_search: bool = False  # vLLM's: n beams (serving/beam.py), with length_penalty
    length_penalty: float = Field(1.0, allow_inf_nan=False)
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's StructuredOutputsParams fields
    guided_json: Union[dict[str, Any], str, None] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def constraint_field(self) -> str:
        """The field the request's structured-output constraint came from."""
        return next((name for name in ("response_format", "structured_outputs", *GUIDED)
                     if getattr(self, name) is not None), "structured_outputs")

    def structured(self) -> StructuredOutputsParams | None:
        """The constraint of `response_format`, `structured_outputs` or a `guided_*` field
        (one of them at most); APIError 400 naming the field if it is malformed."""
        sources = {}
        fmt = self.response_format
        if fmt is not None and fmt.type != "text":
            if fmt.type == "json_object":
                sources["response_format"] = {"json_object": True}
            elif fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise APIError(400, "response_format: a json_schema response format needs "
                               "json_schema.schema.", "response_format")
            else:
                sources["response_format"] = {"json": fmt.json_schema.schema_}
        if self.structured_outputs is not None:
            sources["structured_outputs"] = self.structured_outputs
        for name, key in GUIDED.items():
            if getattr(self, name) is not None:
                sources[name] = {key: getattr(self, name)}
        if len(sources) > 1:
            raise APIError(400, f"Give one structured-output constraint; got {sorted(sources)}.",
                           sorted(sources)[0])
        if not sources:
            return None
        (field, fields), = sources.items()
        known = {"json", "regex", "choice", "grammar", "json_object"}
        if fields and not known.intersection(fields):  # (other vLLM fields are let pass)
            raise APIError(400, f"{field}: give one of {sorted(known)}; got {sorted(fields)}.",
                           field)
        try:
            return StructuredOutputsParams(**{k: v for k, v in fields.items() if k in known})
        except InvalidRequestError as err:
            raise APIError(400, f"{field}: {err}", field) from err

    def token_biases(self) -> dict[int, float] | None:
        """`logit_bias` with integer token ids; APIError 400 for a key that is not one or a
        bias outside OpenAI's [-100, 100]."""
        if not self.logit_bias:
            return None
        out = {}
        for key, bias in self.logit_bias.items():
            try:
                token = int(key)
            except ValueError:
                raise APIError(400, f"logit_bias: keys must be token ids; got {key!r:.50}.",
                               "logit_bias") from None
            if not -100 <= bias <= 100:
                raise APIError(400, f"logit_bias: biases must be in [-100, 100]; got {bias} "
                               f"for token {key}.", "logit_bias")
            out[token] = bias
        return out

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        timeout: float | None = None, prompt_logprobs: int | None = None,
                        constraint: StructuredOutputsParams | None = None) -> SamplingParams:
        """constraint: the structured output, when not the request's own (forced tools)."""
        bias = self.token_biases()
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream=true.",
                           "stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise APIError(400, "prompt_logprobs come in a response, not a stream (with "
                           "stream=true, ask completions for echo with logprobs).",
                           "prompt_logprobs")
        wanted = [k for k in (prompt_logprobs, self.prompt_logprobs) if k is not None]
        try:
            return SamplingParams(
                n=self.n, max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos, min_tokens=self.min_tokens, logit_bias=bias,
                allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
                truncate_prompt_tokens=self.truncate_prompt_tokens,
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs,
                prompt_logprobs=max(wanted, default=None),
                structured_outputs=constraint or self.structured(),
                timeout=timeout)
        except InvalidRequestError as err:
            raise APIError(400, str(err), err.param) from err

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: Union[str, list[int], list[Union[str, list[int]]]]
    max_tokens: int | None = Field(None, ge=0)  # 0: score the prompt (with echo), add nothing
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False  # the prompt comes back before the completion (with its logprobs)
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="plain")
    @classmethod
    def _prompt(cls, value):
        """Checked here rather than by pydantic's union, which takes most of a second over
        a million token ids and names a member type in its error."""
        if isinstance(value, str) or _token_ids(value) or isinstance(value, list) and all(
                isinstance(p, str) or _token_ids(p) for p in value):
            return value
        raise APIError(400, "prompt: expected a string, an array of token ids (integers), or "
                       f"an array of strings or of token-id arrays; got {shown(value)}.",
                       "prompt")

    @property
    def engine_max_tokens(self) -> int:
        """The engine samples at least one token; with max_tokens=0 it is dropped."""
        return 16 if self.max_tokens is None else max(self.max_tokens, 1)

    @property
    def echo_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None

    def prompts(self) -> list:
        if self.suffix:
            raise APIError(400, "suffix is not supported.", "suffix")
        if self.best_of not in (None, self.n):
            raise APIError(400, "best_of must equal n (or be left out).", "best_of")
        p = self.prompt
        if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], int)):
            p = [p]
        if not p or any(len(x) == 0 for x in p):
            raise APIError(400, "prompt must not be empty.", "prompt")
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[dict[str, Any]], None] = None

    def as_template_input(self) -> dict:
        """The message as chat templates read it (an assistant's `tool_calls`, a tool
        result's `tool_call_id` and `name` kept)."""
        content = self.content
        if isinstance(content, list):  # content parts: only text is understood
            texts = []
            for part in content:
                if part.get("type") != "text":
                    raise APIError(400, f"content parts of type {part.get('type')!r} are not "
                                   "supported (text only).", "messages")
                texts.append(str(part.get("text", "")))
            content = "".join(texts)
        message = {"role": self.role, "content": content or ""}
        for name in ("tool_calls", "tool_call_id", "name"):
            if (self.model_extra or {}).get(name) is not None:
                message[name] = self.model_extra[name]
        return message


# apply_chat_template's own arguments, which chat_template_kwargs may not set
_TEMPLATE_ARGUMENTS = frozenset({
    "messages", "conversation", "tools", "documents", "tokenize", "chat_template",
    "add_generation_prompt", "continue_final_message", "return_dict"})


class ChatTemplateOptions(BaseModel):
    """How chat messages become a prompt (vLLM's fields, also on /tokenize)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last (assistant) message goes on, left open
    chat_template_kwargs: dict[str, Any] | None = None  # variables for the template
    chat_template: str | None = None  # refused: the server renders its model's own

    @model_validator(mode="after")
    def _template_options(self):
        if self.chat_template is not None:
            raise APIError(400, "chat_template is not accepted: the server renders its "
                           "model's own chat template.", "chat_template")
        if self.add_generation_prompt and self.continue_final_message:
            raise APIError(400, "continue_final_message goes on with the last message; set "
                           "add_generation_prompt to false with it.", "continue_final_message")
        taken = _TEMPLATE_ARGUMENTS.intersection(self.chat_template_kwargs or {})
        if taken:
            raise APIError(400, f"chat_template_kwargs cannot set {sorted(taken)}.",
                           "chat_template_kwargs")
        return self

    def template_kwargs(self) -> dict:
        """Keywords of `apply_chat_template` besides the messages and tools."""
        return dict(self.chat_template_kwargs or {},
                    add_generation_prompt=self.add_generation_prompt,
                    continue_final_message=self.continue_final_message)


class ChatCompletionRequest(_Sampling, ChatTemplateOptions):
    messages: list[ChatMessage] = Field(min_length=1)
    echo: bool = False  # vLLM's: the answer goes on from the last (assistant) message
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool = True

    def tool_mode(self, parser: str) -> ToolMode | None:
        """How answers become tool calls (None: they do not); APIError 400 for bad tools."""
        check_tools(self.tools, self.tool_choice)
        choice = self.tool_choice or ("auto" if self.tools else "none")
        if choice == "none":
            return None
        return ToolMode(parser, choice, self.parallel_tool_calls, self.skip_special_tokens)

    def forced_tool_schema(self, mode: ToolMode | None) -> dict | None:
        if mode is None or not mode.forced:
            return None
        if self.constraint_field != "structured_outputs" or self.structured_outputs:
            raise APIError(400, f"tool_choice {mode.choice!r} constrains the answer already; "
                           f"drop {self.constraint_field}.", "tool_choice")
        return forced_schema(self.tools, mode.choice, mode.parallel)

    def echoed(self) -> str:
        """What `echo` puts before each answer: the last message's text when it is the
        assistant's (whose answer goes on from it, as with continue_final_message)."""
        last = self.messages[-1]
        return last.as_template_input()["content"] if self.echo and last.role == "assistant" \
            else ""

    def logprob_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true.", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


# -- responses ------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def error_body(message: str) -> dict:
    """The error object of a request that failed while running (finish_reason "error")."""
    return {"message": message, "type": "server_error", "param": None, "code": None}


def completion_response(request_id: str, model: str, results: list[RequestOutput],
                        body: "CompletionRequest", pieces: TokenPieces,
                        echo_texts: list[Echo] | None = None) -> dict:
    """echo_texts: per prompt, its text as echoed (with `echo`)."""
    choices, prompt_tokens, completion_tokens, cached = [], 0, 0, 0
    errors = []
    scoring = body.max_tokens == 0  # the prompt alone: the sampled token is dropped
    for i, result in enumerate(results):
        prompt_tokens += len(result.prompt_token_ids)
        cached += result.num_cached_tokens
        if result.error:
            errors.append(f"prompt {i}: {result.error}" if len(results) > 1 else result.error)
        head, head_lps = echoed(result, echo_texts[i], pieces, body.logprobs) \
            if body.echo else ("", None)
        scored = {} if body.prompt_logprobs is None else {
            "prompt_logprobs": ranked_prompt_logprobs(result, body.prompt_logprobs, pieces)}
        for out in result.outputs:
            text, lps = out.text, None
            if scoring:
                text, out = "", scored_only(out)
            if out.logprobs is not None:
                lps = completion_logprobs(out, 0, completion_pieces(
                    pieces, out, body.skip_special_tokens, body.include_stop_str_in_output),
                    len(head))
            completion_tokens += len(out.token_ids)
            choices.append({
                "index": i * body.n + out.index, "text": head + text,
                "logprobs": joined_logprobs(head_lps, lps),
                "finish_reason": out.finish_reason, "stop_reason": out.stop_reason, **scored})
    body = {"id": request_id, "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens, cached)}
    if errors:
        body["error"] = error_body("; ".join(errors))
    return body


def chat_response(request_id: str, model: str, result: RequestOutput, pieces: TokenPieces,
                  top: int, tools: ToolMode | None = None, tokenizer=None, echo: str = "",
                  prompt_logprobs: int | None = None) -> dict:
    """tools: how answers become tool calls (read with `tokenizer`); echo: text before
    each answer's content; prompt_logprobs: vLLM's field, asked for."""
    choices = []
    for out in result.outputs:
        message = {"role": "assistant", "content": echo + out.text}
        finish = out.finish_reason
        if tools is not None and out.finished:
            content, calls = tools.answer(out, tokenizer)
            if calls:
                message = {"role": "assistant",
                           "content": echo + (content or "") if echo else content,
                           "tool_calls": [c.as_openai() for c in calls]}
                finish = tools.finish_reason(out, calls)
        choices.append({
            "index": out.index, "message": message,
            "logprobs": chat_logprobs(out, 0, pieces, top) if out.logprobs is not None else None,
            "finish_reason": finish, "stop_reason": out.stop_reason})
    completion_tokens = sum(len(o.token_ids) for o in result.outputs)
    body = {"id": request_id, "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": choices,
            "usage": usage(len(result.prompt_token_ids), completion_tokens,
                           result.num_cached_tokens)}
    if prompt_logprobs is not None:
        body["prompt_logprobs"] = ranked_prompt_logprobs(result, prompt_logprobs, pieces)
    if result.error:
        body["error"] = error_body(result.error)
    return body
