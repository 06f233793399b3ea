"""`LLM.beam_search`: vLLM's offline beam search, run as ordinary engine requests.

Each step asks the engine for one token of every live beam, with the log-probabilities of
its 2 * beam_width most likely next tokens (one `LLM.generate` call for all prompts' beams;
a beam's prompt and earlier tokens are found in the prefix cache, so a step computes about
one block per beam). Every candidate extends its beam's cumulative log-probability; one
ending in EOS is complete, the others compete, and the `beam_width` best by
`cum_logprob / length ** length_penalty` go on. After `max_tokens` steps (or once no beam
goes on) the best `beam_width` of the complete and the live ones are returned, best first.

As in vLLM, a sequence's `tokens` and `text` hold the prompt and the generated tokens, and
the length in the score counts both (less a final EOS). A beam that fills the model's
context is complete ("length"; vLLM drops it, and can return no sequence at all).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from numbers import Integral

from ..errors import HFPagedError, InvalidRequestError
from ..outputs import CompletionOutput, Logprob, RequestOutput
from ..sampling_params import MAX_LOGPROBS, SamplingParams, check_setting
from .adapters import LoRARequest
from .request import prompt_ids, prompt_list


@dataclass
class BeamSearchParams:
    """beam_width: beams kept (at most 10: each asks for 2 * beam_width candidates).
    max_tokens: tokens generated at most. ignore_eos: EOS does not complete a beam.
    temperature: of the one token each step samples, which joins the candidates (as in
    vLLM: with temperature > 0 a sampled EOS may complete a beam that wins; the candidates'
    log-probabilities do not depend on it). length_penalty: the score divides the cumulative
    log-probability by the length to this power (> 1 favours longer sequences).
    include_stop_str_in_output: kept for vLLM's signature (the text is the whole decode)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        widest = MAX_LOGPROBS // 2
        for name, kind, ok, allowed in (
                ("beam_width", int, lambda v: 1 <= v <= widest, f"an integer in [1, {widest}]"),
                ("max_tokens", int, lambda v: v >= 1, "an integer >= 1"),
                ("temperature", float, lambda v: v >= 0, "a number >= 0"),
                ("length_penalty", float, lambda v: True, "a finite number")):
            check_setting(getattr(self, name), name, kind, ok, allowed,
                          owner="BeamSearchParams")


@dataclass
class BeamSearchSequence:
    """tokens: the prompt's and the generated ones. logprobs: per generated token, the
    candidates its step offered ({token id: Logprob}). finish_reason: "stop" (ended in
    EOS) or "length"."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    lora_request: LoRARequest | None = None
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best `beam_width` sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_search(llm, prompts, params: BeamSearchParams, lora_request=None,
                use_tqdm: bool = False, concurrency_limit: int | None = None
                ) -> list[BeamSearchOutput]:
    """`LLM.beam_search` (see the module's docstring). concurrency_limit: search this many
    prompts at a time (all at once if None)."""
    prompts = prompt_list(prompts)
    loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else \
        [lora_request] * len(prompts)
    if len(loras) != len(prompts):
        raise ValueError(f"{len(loras)} LoRA requests for {len(prompts)} prompts.")
    if not all(lora is None or isinstance(lora, LoRARequest) for lora in loras):
        raise TypeError("lora_request must be a LoRARequest, a list of them (None for the "
                        f"base model) or None; got {lora_request!r:.100}.")
    if concurrency_limit is not None:
        if not isinstance(concurrency_limit, Integral) or concurrency_limit < 1:
            raise ValueError(f"concurrency_limit must be a positive integer or None; got "
                             f"{concurrency_limit!r}.")
        return [out for at in range(0, len(prompts), concurrency_limit)
                for out in _search(llm, prompts[at:at + concurrency_limit], params,
                                   loras[at:at + concurrency_limit], use_tqdm)]
    return _search(llm, prompts, params, loras, use_tqdm)


class _Search:
    """The beams of several prompts, extended one step at a time by whoever runs the
    steps' requests (`LLM.generate`, or `AsyncLLM` streams)."""

    def __init__(self, prompts: list[list[int]], owners: list, salts: list,
                 params: BeamSearchParams, eos_ids, context: int):
        """prompts: token ids; owners: each prompt's adapter (carried on its beams)."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be BeamSearchParams; got {type(params).__name__}.")
        for prompt in prompts:
            if not prompt:
                raise InvalidRequestError("a prompt is empty.", "prompt")
            if len(prompt) > context:
                raise InvalidRequestError(f"a prompt of {len(prompt)} tokens exceeds the "
                                          f"model's context of {context} tokens.", "prompt")
        self.params, self.context, self.salts = params, context, salts
        self.eos = frozenset() if params.ignore_eos else frozenset(eos_ids)
        self.score = _scorer(frozenset(eos_ids), params.length_penalty)  # (ignore_eos or
        self.live = [[BeamSearchSequence(list(p), lora_request=o)]  # not, as vLLM)
                     for p, o in zip(prompts, owners)]
        self.done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        self.steps = 0
        self.step = SamplingParams(max_tokens=1, logprobs=2 * params.beam_width,
                                   ignore_eos=True, temperature=params.temperature,
                                   detokenize=False)

    def steps_left(self) -> bool:
        self.steps += 1
        return self.steps <= self.params.max_tokens

    def pending(self) -> list[tuple[BeamSearchSequence, str | None]]:
        """The live beams, prompt by prompt, each with its prompt's cache salt (a beam that
        fills the model's context is complete)."""
        for i, group in enumerate(self.live):
            self.done[i] += [beam for beam in group if len(beam.tokens) >= self.context]
            self.live[i] = [beam for beam in group if len(beam.tokens) < self.context]
        return [(beam, salt) for group, salt in zip(self.live, self.salts) for beam in group]

    def extend(self, outputs: list) -> None:
        """outputs: the RequestOutput of each beam `pending` gave, in its order."""
        outputs = iter(outputs)
        for i, group in enumerate(self.live):
            grown = []
            for beam, out in zip(group, outputs):
                if out.error is not None:
                    raise HFPagedError(f"beam search: a beam's request failed: {out.error}")
                offered = out.outputs[0].logprobs[0]
                for token, value in offered.items():
                    child = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [offered],
                                               beam.lora_request,
                                               beam.cum_logprob + float(value))
                    (self.done[i] if token in self.eos else grown).append(child)
            self.live[i] = sorted(grown, key=self.score, reverse=True)[:self.params.beam_width]

    def best(self) -> list[list[BeamSearchSequence]]:
        """Per prompt, the best `beam_width` of the complete and live beams, best first."""
        results = []
        for finished, group in zip(self.done, self.live):
            best = sorted(finished + group, key=self.score, reverse=True)
            for beam in best[:self.params.beam_width]:
                beam.finish_reason = "stop" if beam.tokens[-1] in self.eos else "length"
            results.append(best[:self.params.beam_width])
        return results


def _search(llm, prompts: list, params: BeamSearchParams, loras: list,
            use_tqdm: bool) -> list[BeamSearchOutput]:
    engine = llm.engine
    context = engine.scheduler.max_model_len
    ids = [prompt_ids(p, SamplingParams(), engine.tokenizer, engine.vocab_size, context)[1]
           for p in prompts]
    salts = [p.get("cache_salt") if isinstance(p, Mapping) else None for p in prompts]
    search = _Search(ids, loras, salts, params, engine.eos_ids, context)
    bar = _progress(params.max_tokens, use_tqdm)
    while search.steps_left():
        beams = search.pending()
        if not beams:
            break
        asked = [{"prompt_token_ids": b.tokens} | (
            {} if salt is None else {"cache_salt": salt}) for b, salt in beams]
        search.extend(llm.generate(asked, search.step, use_tqdm=False,
                                   lora_request=[b.lora_request for b, _ in beams]))
        bar.update(1)
    bar.close()
    results = search.best()
    if llm.tokenizer is not None:
        for beam in (beam for best in results for beam in best):
            beam.text = llm.tokenizer.decode(beam.tokens)
    return [BeamSearchOutput(best) for best in results]


async def beam_search_async(llm, prompt: list[int], request_id: str,
                            params: BeamSearchParams, adapter: str | None = None,
                            cache_salt: str | None = None, run=None) -> RequestOutput:
    """`AsyncLLM.beam_search`: the search of one prompt as one finished RequestOutput, as
    vLLM's engine client gives it (one completion per beam, best first: generated tokens,
    text without a final EOS, cumulative log-probability, the candidates' logprobs).
    run(prompts, sampling_params): awaits the finished RequestOutputs of a step's requests
    (the server's admits them as any; by default `llm.generate`)."""
    async def generate(prompts, step_params):
        return await asyncio.gather(*[
            _final(llm.generate({"prompt_token_ids": p}, step_params,
                                f"{request_id}-{search.steps}-{j}", adapter=adapter,
                                cache_salt=cache_salt))
            for j, p in enumerate(prompts)])

    search = _Search([prompt], [adapter], [cache_salt], params, llm.engine.eos_ids,
                     llm.max_model_len)
    while search.steps_left():
        beams = search.pending()
        if not beams:
            break
        search.extend(await (run or generate)([b.tokens for b, _ in beams], search.step))
    outputs = []
    for i, beam in enumerate(search.best()[0]):
        tokens = beam.tokens[len(prompt):]
        shown = tokens[:-1] if beam.finish_reason == "stop" else tokens
        text = "" if llm.tokenizer is None else llm.tokenizer.decode(shown,
                                                                     skip_special_tokens=True)
        outputs.append(CompletionOutput(i, text, tokens, beam.cum_logprob, beam.logprobs,
                                        beam.finish_reason))
    return RequestOutput(request_id, None, list(prompt), outputs, finished=True)


async def _final(outputs):
    out = None
    async for out in outputs:
        pass
    return out


def _progress(steps: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=steps, desc="Beam search", unit="token", disable=not enabled)


def _scorer(eos: frozenset[int], length_penalty: float):
    def score(beam: BeamSearchSequence) -> float:
        length = len(beam.tokens) - (beam.tokens[-1] in eos)
        return beam.cum_logprob / length ** length_penalty
    return score
