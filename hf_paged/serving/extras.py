"""The server's endpoints around generation, in vLLM's shapes: /tokenize, /detokenize and
/tokenizer_info (clients count tokens against the context; lm-evaluation-harness tokenizes
through them), and /v1/load_lora_adapter, /v1/unload_lora_adapter (adapters at runtime,
served only when the server was started to allow it)."""

from __future__ import annotations

import functools
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..errors import APIError, InvalidRequestError
from ..utils import out_of_vocab
from .bodies import body_of, parse
from .protocol import ChatMessage, ChatTemplateOptions, UnicodeBody
from .tools import check_tools


class TokenizeRequest(UnicodeBody, ChatTemplateOptions):
    """vLLM's /tokenize: a prompt, or chat messages rendered by the chat template."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # (default: True for a prompt, False for messages)
    return_token_strs: bool = False
    tools: list[dict[str, Any]] | None = None  # rendered with the messages

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "Give either prompt or messages.", "prompt")
        check_tools(self.tools, None)  # (as chat checks them)
        return self


class LoraAdapterRequest(UnicodeBody):
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter body."""

    model_config = ConfigDict(extra="ignore")
    lora_name: str = Field(min_length=1)
    lora_path: str | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]


EXTRA_BODIES = [TokenizeRequest, DetokenizeRequest, LoraAdapterRequest]  # (for /docs)


def _check_runtime_lora(server) -> None:
    if not server.runtime_lora:
        raise APIError(404, "Loading adapters at runtime is off; start the server with "
                       "--enable-runtime-lora.", None, "not_found_error")


async def _lora(change) -> None:
    """Awaits an adapter change; its InvalidRequestError is the client's 400."""
    try:
        await change
    except InvalidRequestError as err:
        raise APIError(400, str(err), err.param) from err


def add_routes(app: FastAPI, server) -> None:
    """The endpoints, on `server` (the app's `_Server`)."""
    llm = server.llm

    @app.post("/v1/load_lora_adapter", openapi_extra=body_of(LoraAdapterRequest))
    async def load_lora_adapter(request: Request):
        _check_runtime_lora(server)
        body = await parse(server, LoraAdapterRequest, request)
        if body.lora_path is None:
            raise APIError(400, "lora_path: the adapter's folder is needed.", "lora_path")
        if body.lora_name == server.model_name:  # (that name always means the base model)
            raise APIError(400, f"lora_name: {body.lora_name!r} is the served model's name.",
                           "lora_name")
        await _lora(llm.load_adapter(body.lora_name, body.lora_path))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added "
                                 "successfully.")

    @app.post("/v1/unload_lora_adapter", openapi_extra=body_of(LoraAdapterRequest))
    async def unload_lora_adapter(request: Request):
        _check_runtime_lora(server)
        body = await parse(server, LoraAdapterRequest, request)
        await _lora(llm.unload_adapter(body.lora_name))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed "
                                 "successfully.")

    @app.get("/version")
    async def version():
        from importlib.metadata import version as installed

        return {"version": installed("hf-paged")}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        """vLLM's: what a client needs to tokenize as the server does (lm-evaluation-harness
        reads it, then calls /tokenize and /detokenize)."""
        tokenizer = server.need_tokenizer("tokenizer")
        info = {name: getattr(tokenizer, name, None) for name in (
            "eos_token", "bos_token", "pad_token", "unk_token", "chat_template")}
        info["tokenizer_class"] = type(tokenizer).__name__
        info["model_max_length"] = llm.max_model_len
        return {k: v if v is None or isinstance(v, (str, int)) else str(v)
                for k, v in info.items()}

    @functools.cache
    def vocabulary_strs() -> list[str]:
        """Every token's string: /tokenize reads a million of them from here (as many calls
        into the tokenizer take a second, and hold up every other thread)."""
        return llm.tokenizer.convert_ids_to_tokens(list(range(len(llm.tokenizer))))

    @app.post("/tokenize", openapi_extra=body_of(TokenizeRequest))
    async def tokenize(request: Request):
        body = await parse(server, TokenizeRequest, request)
        if body.model is not None:
            server.adapter_for(body.model)
        if body.messages is not None:
            ids = await server.chat_tokens(body.messages, body, bool(body.add_special_tokens),
                                           body.tools)
        else:
            tokenizer = server.need_tokenizer("prompt")
            special = body.add_special_tokens is not False
            ids = (await server.off_loop(
                lambda: tokenizer(body.prompt, add_special_tokens=special)))["input_ids"]

        def response() -> dict:  # (a million tokens and their strings: on a worker)
            strs = [vocabulary_strs()[i] for i in ids] if body.return_token_strs else None
            return {"count": len(ids), "max_model_len": llm.max_model_len,
                    "tokens": list(ids), "token_strs": strs}
        return await server.respond(response)

    @app.post("/detokenize", openapi_extra=body_of(DetokenizeRequest))
    async def detokenize(request: Request):
        body = await parse(server, DetokenizeRequest, request)
        if body.model is not None:
            server.adapter_for(body.model)
        tokenizer = server.need_tokenizer("tokens")
        bad = out_of_vocab(body.tokens, llm.vocab_size)
        if bad:
            raise APIError(400, f"tokens must be token ids in [0, {llm.vocab_size}); got "
                           f"{bad}.", "tokens")
        return {"prompt": await server.off_loop(tokenizer.decode, body.tokens)}
