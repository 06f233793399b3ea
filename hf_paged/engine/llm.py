"""`LLM`: offline batch generation on the continuous-batching engine, as vLLM users know it.

    llm = hf_paged.LLM(model, tokenizer)          # a loaded model (or PEFT model) or a folder
    outputs = llm.generate(["a prompt", [3, 4, 5]], hf_paged.SamplingParams(max_tokens=32))
    outputs[0].outputs[0].text
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import weakref
from collections.abc import Mapping
from dataclasses import replace

from .engine import LLMEngine
from .adapters import LoRARequest, load_requested
from .beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from .request import prompt_ids, prompt_list
from ..distributed import tensor_parallel as tp
from ..errors import HFPagedError
from ..outputs import CompletionOutput, RequestOutput
from ..sampling_params import RequestOutputKind, SamplingParams
from ..core.scheduler import RequestRejectedError

_batches = itertools.count()
logger = logging.getLogger("hf_paged")


def load_model(path, dtype="auto", device=None, tensor_parallel: bool = False,
               device_map=None):
    """A model and its tokenizer (None if the folder has none) from a local folder.
    tensor_parallel: under torchrun, split the model over the ranks (tp_plan="auto").
    device_map: spread its layers over devices ("auto", "balanced", or a dict, as
    Transformers takes it); the KV cache follows the layers."""
    from transformers import AutoModelForCausalLM, DistributedConfig

    if folder_missing(path):
        raise FileNotFoundError(f"no model folder at {str(path)!r}.")
    given = [n for n, v in (("device", device), ("device_map", device_map),
                            ("tensor_parallel", tensor_parallel)) if v]
    if len(given) > 1:
        raise ValueError(f"give one of device, device_map and tensor_parallel; got {given}.")
    if tensor_parallel:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, distributed_config=DistributedConfig(tp_plan="auto"))
    elif device_map is not None:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=device_map)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    if device is not None:
        model = model.to(device)
    return model.eval(), load_tokenizer(path, required=False)


def folder_missing(path) -> bool:
    """`path` is written as a local path (/, ./, ../, ~) and no folder is there: told
    apart before from_pretrained would take it for a Hub id."""
    local = os.path.expanduser(str(path))
    return local.startswith(("/", "./", "../", "~")) and not os.path.isdir(local)


def load_tokenizer(path, required: bool = True):
    """The tokenizer saved in folder `path`; None where there is none and it is not
    `required` (requests must then send token ids)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as err:
        if required or any(os.path.exists(os.path.join(str(path), name))
                           for name in _TOKENIZER_FILES):
            raise ValueError(f"The tokenizer in {path} could not be loaded: {err}") from err
        logger.warning("hf-paged: %s has no tokenizer; requests must send token ids.", path)
        return None


def check_option_names(front_end: str, options: dict) -> None:
    """TypeError naming the options LLMEngine does not take (`front_end`: who was given
    them)."""
    import inspect

    parameters = inspect.signature(LLMEngine.__init__).parameters
    known = [n for n, p in parameters.items() if n not in ("self", "model", "tokenizer")
             and p.kind is p.KEYWORD_ONLY]
    unknown = sorted(set(options) - set(known))
    if unknown and not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        raise TypeError(f"{front_end}() got unknown options {unknown}; the engine takes "
                        f"{known} (and dtype, for a model loaded from a folder).")


def model_and_tokenizer(front_end: str, model, tokenizer, dtype, options: dict):
    """What `LLM` and `AsyncLLM` serve: `model` and `tokenizer` as given, each loaded if it
    is a folder (the model in `dtype`, "auto": as saved). Options the engine does not take
    are refused first, before anything loads."""
    check_option_names(front_end, options)
    if isinstance(model, (str, os.PathLike)):
        model, found = load_model(model, dtype=dtype)
        tokenizer = tokenizer if tokenizer is not None else found
    elif dtype != "auto":
        raise ValueError("dtype applies to a model loaded from a folder; convert a loaded "
                         "model with model.to(dtype).")
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_tokenizer(tokenizer)
    return model, tokenizer


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class LLM:
    """Offline generation: `generate()` runs a list of prompts through the engine together
    and returns one `RequestOutput` per prompt, in order.

    model: a loaded causal LM (or a PEFT LoRA model on one), or the path of a local folder
    to load it (and its tokenizer) from, in `dtype`; tokenizer: one, or its folder.
    Engine options: see
    `LLMEngine` (block_size, num_blocks / kv_cache_bytes, max_num_seqs,
    max_num_batched_tokens, enable_prefix_caching, preemption_mode, swap_space_bytes, ...).
    """

    def __init__(self, model, tokenizer=None, *, dtype="auto", **engine_options):
        model, tokenizer = model_and_tokenizer("LLM", model, tokenizer, dtype, engine_options)
        self.engine = LLMEngine(model, tokenizer, **engine_options)
        self._lock = threading.Lock()  # one call steps the engine at a time
        self._end = _keep_workers(self) if self.engine.tp_size > 1 else None

    HEARTBEAT_S = tp.HEARTBEAT_S  # under tensor parallelism, idle rank 0 pings this often

    def shutdown(self) -> None:
        """Under tensor parallelism (rank 0): ends the other ranks' `worker_loop` (also
        done when the LLM is collected or the process exits). Elsewhere nothing to do."""
        if self._end is not None:
            self._end()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def stats(self):
        return self.engine.stats()

    llm_engine = property(lambda self: self.engine, doc="vLLM's name for `engine`")

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The settings of a request that sets none: the model's generation_config, then
        vLLM's defaults. (Yours to change: each request takes a copy of it as it is then.)"""
        return replace(SamplingParams().resolved(self.engine.defaults), _resolved=False)

    def reset_prefix_cache(self) -> bool:
        """Drops every cached prefix block (to time runs from cold): True, or False while a
        call runs (its requests hold blocks)."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            return reset_prefix_cache(self.engine)
        finally:
            self._lock.release()

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: list[int] | None = None,
                 adapter: str | list[str | None] | None = None,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None,
                 ) -> list[RequestOutput]:
        """prompts: a string, a list (or 1-D tensor or array) of token ids, a prompt dict
        ({"prompt": text} or {"prompt_token_ids": ids}, optionally with "cache_salt"), or a
        list of these.
        adapter: the LoRA adapter of every prompt, or one per prompt (see
        `LLMEngine.add_request`); or, as vLLM names them, `lora_request` (adapters not yet
        loaded are loaded from their folders first). A request that can never run (too long
        for the model or the pool) comes back with finish_reason "error" and `error` set, as
        does one that fails while running; the others run normally. Malformed input raises
        InvalidRequestError before anything runs. If the call raises (or is interrupted),
        none of its requests stays queued: the `LLM` serves the next call as if this one
        had not happened. Calls from several threads run one after another."""
        prompts = prompt_list(prompts)
        if lora_request is not None:
            if adapter is not None:
                raise ValueError("Name the adapters with `adapter` or `lora_request`, not both.")
            adapter = self._loaded(_per_prompt("LoRA requests", lora_request, prompts))
        params = _per_prompt("sampling params", sampling_params, prompts)
        priority = _per_prompt("priorities", priority, prompts)
        adapters = _per_prompt("adapters", adapter, prompts)
        batch = next(_batches)
        ids = [f"llm-{batch}-{i}" for i in range(len(prompts))]
        results: dict[str, RequestOutput] = {}
        engine = self.engine
        once: dict[int, SamplingParams] = {}  # a resolved copy per distinct settings object
        params = [once.get(id(p)) or once.setdefault(id(p), _whole((p or SamplingParams())
                                                                   .resolved(engine.defaults)))
                  for p in params]
        prepared = []
        for rid, prompt, p, rank, name in zip(ids, prompts, params, priority, adapters):
            try:  # every request checked before any is queued
                prepared.append(engine.prepare_request(rid, prompt, p,
                                                       0 if rank is None else rank, name))
            except RequestRejectedError as err:
                results[rid] = _rejected(engine, rid, prompt, p, str(err))
        with self._lock:
            return self._run(ids, prepared, results, use_tqdm)

    def beam_search(self, prompts, params: BeamSearchParams,
                    lora_request: LoRARequest | list[LoRARequest | None] | None = None,
                    use_tqdm: bool = False, concurrency_limit: int | None = None
                    ) -> list[BeamSearchOutput]:
        """vLLM's offline beam search (`hf_paged.engine.beam_search`): for each prompt (as
        `generate` takes them), the best `params.beam_width` sequences, best first."""
        return beam_search(self, prompts, params, lora_request, use_tqdm, concurrency_limit)

    def _loaded(self, requests: list[LoRARequest | None]) -> list[str | None]:
        """The adapter names of vLLM's `lora_request`s, each loaded first if it is not."""
        with self._lock:  # (not while another thread's call runs)
            return [load_requested(self.engine, r) for r in requests]

    def chat(self, messages: list, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, *, adapter: str | list[str | None] | None = None,
             tools: list[dict] | None = None, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Generates for one conversation (a list of {"role": ..., "content": ...} messages)
        or a list of them: each is rendered by the tokenizer's chat template (or
        `chat_template`, with `tools` and `chat_template_kwargs`), then runs as `generate`
        runs its prompts; one RequestOutput per conversation, its `prompt` the rendered
        text. continue_final_message: the last (assistant) message goes on, left open
        (with add_generation_prompt=False)."""
        if messages and isinstance(messages[0], Mapping):
            messages = [messages]
        options = dict(chat_template_kwargs or {}, add_generation_prompt=add_generation_prompt,
                       continue_final_message=continue_final_message)
        prompts = []
        for conversation in messages:
            text, ids = render_chat(self.tokenizer, conversation, tools,
                                    chat_template=chat_template, **options)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm, adapter=adapter)

    def _run(self, ids: list[str], prepared: list, results: dict,
             use_tqdm: bool) -> list[RequestOutput]:
        """Queues the prepared requests and steps the engine until all of this call's
        have finished (`results` holds those that never ran)."""
        engine = self.engine
        bar = _progress(len(ids), use_tqdm)
        bar.update(len(results))
        before, engine.finished_only = engine.finished_only, True
        try:
            for request in prepared:
                engine.add_prepared(request)
            mine = set(ids) - set(results)
            with engine.runner.attention_held():
                while mine:
                    if not engine.has_unfinished_requests():
                        raise HFPagedError(f"the engine lost {len(mine)} request(s) of this "
                                           "call.")
                    for out in engine.step():
                        if out.finished and out.request_id in mine:
                            mine.discard(out.request_id)
                            results[out.request_id] = out
                            bar.update(1)
        except BaseException:
            for rid in ids:  # nothing of this call stays queued
                engine.remove_request(rid)
            raise
        finally:
            engine.finished_only = before
            bar.close()
        return [results[rid] for rid in ids]


def _keep_workers(llm: LLM):
    """Rank 0 of a tensor-parallel group: while no call runs, pings the other ranks every
    `HEARTBEAT_S` (they wait for its step plans under the group's timeout); the finalizer
    returned stops them, once."""
    engine, lock, stop, period = llm.engine, llm._lock, threading.Event(), llm.HEARTBEAT_S

    def ping() -> None:  # (holds no reference to `llm`, which may then be collected)
        while not stop.wait(period):
            if lock.acquire(blocking=False):  # (a call running sends steps of its own)
                try:
                    if not stop.is_set():
                        engine.heartbeat()
                finally:
                    lock.release()

    def end() -> None:
        stop.set()
        with lock:
            try:
                engine.stop_workers()
            except Exception as err:  # noqa: BLE001 (the group is gone already, at exit)
                logger.warning("hf-paged: could not stop the other ranks: %s", err)

    threading.Thread(target=ping, name="hf-paged-heartbeat", daemon=True).start()
    return weakref.finalize(llm, end)


def reset_prefix_cache(engine: LLMEngine) -> bool:
    """Drops the engine's cached prefix blocks: True, or False (nothing dropped) while any
    request runs or waits."""
    scheduler = engine.scheduler
    if scheduler.has_work:
        return False
    scheduler.prefix.clear()
    return True


def render_chat(tokenizer, messages: list, tools: list | None = None,
                add_special_tokens: bool = False, chat_template: str | None = None,
                **template_kwargs) -> tuple[str, list[int]]:
    """Chat messages as the tokenizer's chat template (or `chat_template`) renders them ->
    (text, token ids). The template writes the special tokens (BOS) itself, so tokenizing
    adds none. A message's content given as OpenAI's text parts is joined into one string."""
    if tokenizer is None or not (chat_template or getattr(tokenizer, "chat_template", None)):
        raise ValueError("chat needs a tokenizer with a chat template (or a chat_template); "
                         "the model's has none.")
    text = tokenizer.apply_chat_template([_text_parts_joined(m) for m in messages], tools=tools,
                                         chat_template=chat_template, tokenize=False,
                                         **template_kwargs)
    return text, tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]


def _text_parts_joined(message):
    content = message.get("content") if isinstance(message, Mapping) else None
    if isinstance(content, list) and content and all(
            isinstance(p, Mapping) and p.get("type") == "text" for p in content):
        return dict(message, content="".join(str(p.get("text", "")) for p in content))
    return message


def _per_prompt(what: str, value, prompts: list) -> list:
    """`value` for each prompt: a list of one per prompt, or one for all."""
    if not isinstance(value, (list, tuple)):
        return [value] * len(prompts)
    if len(value) != len(prompts):
        raise ValueError(f"{len(value)} {what} for {len(prompts)} prompts.")
    return value


def _rejected(engine, request_id, prompt, params, error) -> RequestOutput:
    """The output of a request that can never run: its prompt as the checks read it (token
    ids as ints, text tokenized, truncated as asked)."""
    text, ids = prompt_ids(prompt, params, engine.tokenizer, engine.vocab_size,
                           engine.scheduler.max_model_len)
    return RequestOutput(request_id, text, ids,
                         [CompletionOutput(i, finish_reason="error") for i in range(params.n)],
                         finished=True, error=error)


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Processed prompts", disable=not enabled or total == 0)


def _whole(params: SamplingParams) -> SamplingParams:
    """`params` with cumulative outputs (`generate` returns each request whole)."""
    if params.output_kind is RequestOutputKind.CUMULATIVE:
        return params
    return replace(params, output_kind=RequestOutputKind.CUMULATIVE)
