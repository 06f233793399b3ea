"""vLLM's `use_beam_search` on `/v1/completions` and `/v1/chat/completions`: `n` beams of
`AsyncLLM.beam_search` (`length_penalty`, `ignore_eos`, `max_tokens`), answered whole, the
beams best first as the choices. Each step's requests are admitted, salted by tenant,
counted and aborted when the client leaves, as any request's. A sampling setting the search
would ignore is a 400 naming it rather than dropped."""

from __future__ import annotations

import asyncio

from fastapi.responses import Response

from ..engine import BeamSearchParams
from ..errors import APIError, InvalidRequestError
from ..sampling_params import SamplingParams
from .protocol import ChatCompletionRequest, chat_response, completion_response, new_id

# Settings of a sampled request that beam search does not apply.
IGNORED = ("stop", "stop_token_ids", "logit_bias", "allowed_token_ids", "bad_words", "top_p",
           "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
           "min_tokens", "seed", "prompt_logprobs", "response_format", "structured_outputs",
           "guided_json", "guided_regex", "guided_choice", "guided_grammar", "tools",
           "include_stop_str_in_output", "echo", "suffix", "skip_special_tokens")


class _Gone(Exception):
    """The client left: the search ends."""


def beam_params(body, max_tokens: int) -> BeamSearchParams:
    """The request's BeamSearchParams; APIError 400 naming a field it cannot honour."""
    if body.stream:
        raise APIError(400, "use_beam_search answers whole: set stream to false.", "stream")
    if body.max_tokens == 0:
        raise APIError(400, "use_beam_search generates: max_tokens must be at least 1.",
                       "max_tokens")
    fields = type(body).model_fields
    given = [name for name in IGNORED if name in fields
             and getattr(body, name) not in (fields[name].default, None, [])]
    if given:
        raise APIError(400, f"use_beam_search does not apply {given}; leave them out.",
                       given[0])
    try:
        return BeamSearchParams(beam_width=body.n, max_tokens=max_tokens,
                                ignore_eos=body.ignore_eos,
                                temperature=body.temperature or 0.0,
                                length_penalty=body.length_penalty)
    except InvalidRequestError as err:
        param = {"beam_width": "n"}.get(err.param, err.param)
        raise APIError(400, f"use_beam_search: {err}", param) from err


async def beam_results(server, request, body, prompts: list[list[int]], adapter,
                       params: BeamSearchParams, field: str):
    """One finished RequestOutput per prompt (its beams as completions), or None if the
    client left first."""
    server.check_count(len(prompts), body.n)
    tenant = request.state.tenant

    async def run(step_prompts, step_params):
        streams = server.start(step_prompts, step_params, adapter, body.priority, tenant,
                               body.cache_salt, field)
        results = await server.collect(streams, request)
        if results is None:
            raise _Gone
        return results

    async def one(prompt):
        async for out in server.llm.beam_search(prompt, new_id("beam"), params, adapter,
                                                run=run):
            return out

    try:
        return await asyncio.gather(*[one(p) for p in prompts])
    except _Gone:
        return None


async def beam_response(server, request, body, prompts: list[list[int]], adapter,
                        sampled: SamplingParams):
    """The whole answer of a completions or chat request with use_beam_search. sampled:
    the request's settings as the handler resolved them for sampling (max_tokens, the
    number of top logprobs)."""
    chat = isinstance(body, ChatCompletionRequest)
    params = beam_params(body, sampled.max_tokens)
    results = await beam_results(server, request, body, prompts, adapter, params,
                                 "messages" if chat else "prompt")
    if results is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    count = sampled.logprobs  # (None: not asked for)
    for out in (out for result in results for out in result.outputs):
        out.logprobs = None if count is None else [  # (the chosen token and the best k)
            {t: v for t, v in step.items() if t == token or v.rank <= count}
            for token, step in zip(out.token_ids, out.logprobs)]
    if chat:
        return await server.respond(chat_response, new_id("chatcmpl"), body.model, results[0],
                                    server.pieces, count or 0, None, server.llm.tokenizer)
    return await server.respond(completion_response, new_id("cmpl"), body.model, results,
                                body, server.pieces)
