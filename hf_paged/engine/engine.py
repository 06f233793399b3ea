"""The continuous-batching engine: one KV pool, many requests, one forward per step.

A step is three calls: the scheduler plans it (`Scheduler.schedule`: decodes of running
sequences, then prompt chunks, under its budgets, with the block swaps, copy-on-write copies
and block-table entries they need), the model runner carries it out on the device
(`ModelRunner`: one packed forward per adapter, all tokens in one row, no padding), and the
output processor applies the sampled tokens (`OutputProcessor`: tokens, forks, stops).

One request's trouble stays with it. Settings that can be checked against the model are
checked when a request is added (`prepare_request`). What cannot be checked up front is
contained when it happens: a forward that raises is re-run on halves of its sequences until
the ones that fail alone are found; a sampling row that raises (or whose distribution is
not finite) is sampled apart with the noise already drawn for it (a seeded generator is
never drawn from twice); a request whose stop check or text fails ends alone, with
finish_reason "error" and the message in `error`; the others go on as they would have.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time

import torch

from ..core.prefix_cache import namespace
from ..core.scheduler import Scheduler, Step
from ..core.sequence import Sequence, SeqStatus
from ..distributed import tensor_parallel as tp
from ..errors import (HFPagedError, InvalidRequestError, IsolationError, ModelChangedError,
                      describe)
from ..outputs import CompletionOutput, RequestMetrics, RequestOutput
from ..sampling_params import SamplingParams, generation_defaults, model_eos_ids
from .debug import check_isolation
from .detokenizer import IncrementalText
from . import prompt_logprobs
from .adapters import BASE, RuntimeAdapters, default_adapter
from .output import InFlight, OutputProcessor
from .request import Deadlines, EngineRequest, prompt_ids, salted
from .logits import StepLogits
from .options import engine_generator, engine_options, step_budget
from .runner import DeviceStep, Forward, ModelRunner
from .sampler import Sampler, bad_word_ids
from .speculative import Speculator
from .stats import EngineStats
from .structured import Grammars

logger = logging.getLogger("hf_paged")

DEBUG_ENV_VAR = "HF_PAGED_DEBUG"  # "1": check every step's tables and slots (isolation)


class LLMEngine:
    """Continuous batching on the paged KV cache for a loaded model (or PEFT model).

    Engine options:
      block_size:        tokens per KV block (16)
      num_blocks / kv_cache_bytes: the KV budget; on CUDA, without either, the fraction
                         `gpu_memory_utilization` (0.9) of free device memory; on CPU, 1 GiB
                         or a quarter of physical memory, whichever is smaller
      max_num_seqs:      sequences running at once (64 on CPU, 256 on CUDA; unset, at most
                         max_num_batched_tokens)
      max_num_batched_tokens: tokens per step, decodes and prompt chunks (2048 / 8192)
      enable_prefix_caching: share cached full blocks of common prompt prefixes (True)
      preemption_mode:   "recompute" (default) or "swap" (to a CPU pool of
                         `swap_space_bytes`, by default the size of the KV pool, at
                         most a quarter of host memory shared by the ranks of a machine)
      admission_headroom: free blocks kept per running sequence when admitting another
                         (1.0); fewer preemptions under a tight KV budget, 0 to admit
                         while a prompt's first chunk fits
      max_model_len:     the longest sequence (the model's max_position_embeddings)
      backend:           attention backend, as `cache_config["backend"]`
      kv_cache_dtype:    "auto" (the model's dtype) or 8-bit blocks, "int8", "fp8_e4m3" or
                         "fp8_e5m2" (a bfloat16 scale per token and head: kv/quant.py)
      compile:           run the model's forward under torch.compile (fullgraph, dynamic
                         shapes; True: Inductor, or a torch.compile backend name): the same
                         tokens as eager, after a first compile of each kind of step
      cuda_graphs:       replay decode steps from CUDA graphs, one per batch-size bucket
                         (graphs.py); default: on with `compile` on a CUDA device
      onednn_linear:     a float32 CPU model's large linear layers run through oneDNN (True)
      async_scheduling:  plan and launch step N+1 before the host reads step N's sampled
                         tokens, which feed it on the device (False): the same tokens,
                         with outputs and stop checks a step later
      speculative_config: speculative decoding, as vLLM's dict (speculative.py): e.g.
                         {"method": "ngram", "num_speculative_tokens": 4}; the same tokens
                         (async_scheduling is then off: proposals follow each step's tokens)
      seed:              the generator that requests without a seed of their own sample
                         from (None: torch's default one)
    """

    def __init__(self, model, tokenizer=None, *, block_size: int = 16,
                 num_blocks: int | None = None, kv_cache_bytes: int | None = None,
                 gpu_memory_utilization: float = 0.9, max_num_seqs: int | None = None,
                 max_num_batched_tokens: int | None = None, enable_prefix_caching: bool = True,
                 preemption_mode: str = "recompute", swap_space_bytes: int | None = None,
                 max_model_len: int | None = None, backend: str = "auto",
                 compile: bool | str = False, admission_headroom: float = 1.0,
                 async_scheduling: bool = False, speculative_config=None,
                 kv_cache_dtype: str = "auto", cuda_graphs: bool | None = None,
                 onednn_linear: bool = True, seed: int | None = None):
        self.runner = runner = ModelRunner(
            model, block_size=block_size, num_blocks=num_blocks, kv_cache_bytes=kv_cache_bytes,
            gpu_memory_utilization=gpu_memory_utilization, max_num_seqs=max_num_seqs,
            max_model_len=max_model_len, preemption_mode=preemption_mode,
            swap_space_bytes=swap_space_bytes, backend=backend, compile=compile,
            kv_cache_dtype=kv_cache_dtype, cuda_graphs=cuda_graphs,
            max_num_batched_tokens=max_num_batched_tokens, onednn_linear=onednn_linear)
        base = runner.base
        self.model, self.adapters, self.tokenizer = runner.model, runner.adapters, tokenizer
        self.pool, self.cpu_pool = runner.pool, runner.cpu_pool
        self.device, self.dtype, self.tp_size = runner.device, runner.dtype, runner.tp_size
        self.block_size, self.max_model_len, self.max_num_seqs = (
            runner.block_size, runner.max_model_len, runner.max_num_seqs)
        self.max_num_batched_tokens = step_budget(runner, max_num_batched_tokens, preemption_mode,
                                                  admission_headroom, async_scheduling,
                                                  enable_prefix_caching)
        self.scheduler = Scheduler(self.pool.blocks, self.max_num_seqs,
                                   self.max_num_batched_tokens, self.max_model_len,
                                   None, enable_prefix_caching, preemption_mode,
                                   None if self.cpu_pool is None else self.cpu_pool.blocks,
                                   runner.groups, admission_headroom, runner.rope.switch)
        self.speculator = Speculator.build(speculative_config, runner, self.max_num_batched_tokens)
        if async_scheduling and self.speculator is not None:  # (proposals need the tokens)
            logger.warning("hf-paged: speculative decoding plans each step after the last "
                           "one's tokens reach the host; async_scheduling is off")
            async_scheduling = False
        self.async_scheduling = async_scheduling
        self._in_flight: InFlight | None = None  # the last step's tokens, not landed yet
        self.sampler = Sampler(tokenizer, engine_generator(seed, self.device))
        # incremental_text: decode every step (servers stream text), else only finished
        # completions; finished_only: outputs of finished requests only (LLM.generate).
        self.incremental_text = self.finished_only = False
        self.defaults = generation_defaults(getattr(base, "generation_config", None))
        self.requests: dict[str, EngineRequest] = {}
        self.output = OutputProcessor(self.scheduler, self.requests,
                                      model_eos_ids(base, self.vocab_size))
        self._aborts: dict[str, str | None] = {}  # request id -> why (None: asked to)
        self._deadlines, self._arrivals = Deadlines(), itertools.count()
        self.prompt_tokens, self._stopped = 0, False  # (_stopped: TP ranks were told to stop)
        self.debug = os.environ.get(DEBUG_ENV_VAR) == "1"
        self.lora = RuntimeAdapters(self)  # adapters loaded and unloaded at runtime
        self.grammars: Grammars | None = None  # structured outputs' compiled constraints
        self._grammars_lock = threading.Lock()

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | None = None, priority: int = 0,
                    adapter: str | None = None, cache_salt: str | None = None) -> None:
        """Queues a request. Raises InvalidRequestError (a ValueError) for malformed input
        and RequestRejectedError for a request that could never run; either way nothing
        else is affected.

        adapter: for a PEFT model, the name of one of its LoRA adapters, or BASE for the
        model without them; None runs the model as it is (its active adapter). Requests of
        different adapters run in separate forwards of a step and never share prefix-cache
        entries. cache_salt: the request's prefix-cache namespace (as SamplingParams'):
        requests with different salts never share cached blocks."""
        self.add_prepared(self.prepare_request(request_id, prompt, params, priority, adapter,
                                               cache_salt))

    def prepare_request(self, request_id: str, prompt: str | list[int],
                        params: SamplingParams | None = None, priority: int = 0,
                        adapter: str | None = None, cache_salt: str | None = None) -> EngineRequest:
        """Checks a request against the model and the pool and tokenizes it, changing no
        engine state (a server may call it on its own thread while the engine steps);
        `add_prepared` then queues it."""
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError(f"request ids are non-empty strings; got {request_id!r}.")
        if adapter is not None:
            self.lora.check_name(adapter)
        else:  # one naming none gets the adapter it runs by name: its cached blocks and its
            adapter = default_adapter(self.runner)  # hold on the adapter are that one's
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequestError(f"priority must be an integer; got {priority!r}.",
                                      "priority")
        params = (params or SamplingParams()).resolved(self.defaults)
        params.check_vocab(vocab := self.vocab_size)  # (read from the model: once a request)
        params = salted(params, prompt, cache_salt)
        text, prompt = prompt_ids(prompt, params, self.tokenizer, vocab,
                                  self.scheduler.max_model_len)
        self.scheduler.check_fits(len(prompt), params.max_tokens, params.n)
        bad_words = None
        if params.bad_words:
            bad_words = bad_word_ids(params.bad_words, self.tokenizer, vocab)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)
        generators = [None] * params.n
        if params.seed is not None:
            generators = [torch.Generator(self.device).manual_seed(params.generator_seed(i))
                          for i in range(params.n)]
        follow = (self.tokenizer is not None and params.detokenize
                  and (self.incremental_text or bool(params.stop)))
        arrival, logprobs, matchers = time.monotonic(), params.logprobs is not None, None
        if params.structured_outputs is not None:  # compiled here, not in the step loop
            grammars = self._grammars()
            compiled = grammars.compile(params.structured_outputs)
            matchers = [grammars.matcher(compiled, params.structured_outputs)
                        for _ in range(params.n)]
        return EngineRequest(
            request_id, text, prompt, params, priority, adapter,
            namespace(adapter, params.cache_salt, self.runner.rope.prompt_class(len(prompt))),
            [CompletionOutput(i, logprobs=[] if logprobs else None,
                              cumulative_logprob=0.0 if logprobs else None)
             for i in range(params.n)],
            generators, stop_ids, RequestMetrics(arrival),
            [IncrementalText(self.tokenizer, params.skip_special_tokens)
             for _ in range(params.n)] if follow else None,
            None if params.timeout is None else arrival + params.timeout, matchers=matchers,
            bad_words=bad_words)

    def compile_constraint(self, spec) -> None:
        """Compiles a StructuredOutputsParams now (thread-safe; cached for its requests)."""
        self._grammars().compile(spec)

    def _grammars(self) -> Grammars:
        with self._grammars_lock:  # made once, by the first request that needs it
            if self.grammars is None:
                self.grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_ids)
            return self.grammars

    def add_prepared(self, request: EngineRequest) -> None:
        """Queues a request made by `prepare_request`."""
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use.")
        if request.adapter not in (None, BASE, *self.runner.adapters):  # (deleted since)
            raise InvalidRequestError(f"the adapter {request.adapter!r} was unloaded after the "
                                      f"request was prepared; loaded: {self.lora.live}.", "model")
        params = request.params
        seq = Sequence(self.output.new_seq_id(), request.request_id, request.prompt_ids,
                       params.max_tokens, request.priority, next(self._arrivals),
                       salt=request.salt, forks=params.n - 1, adapter=request.adapter,
                       prompt_logits_from=prompt_logprobs.start(request))
        request.seqs = [seq]
        self.requests[request.request_id] = request
        if request.deadline is not None:
            self._deadlines.add(request, len(self.requests))
        self.scheduler.add(seq)

    def abort(self, request_id: str, error: str | None = None) -> None:
        """Ends the request at the next step boundary, freeing its blocks ("abort");
        `error`, if given, says why (in the output's `error`)."""
        if request_id in self.requests and not self.requests[request_id].finished:
            self._aborts[request_id] = error

    def remove_request(self, request_id: str) -> None:
        """Ends the request now, between steps, freeing its blocks; it yields no output."""
        request = self.requests.pop(request_id, None)
        self._aborts.pop(request_id, None)
        if request is not None:
            for seq in request.seqs:
                self.scheduler.abort(seq)

    vocab_size = property(lambda self: self.runner.vocab_size, doc="ModelRunner.vocab_size")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work or bool(self._aborts)

    def num_waiting_sequences(self) -> int:
        """Sequences queued, not started (n per request); safe to read from other threads."""
        return sum(1 + s.forks for s in list(self.scheduler.waiting))

    num_blocks = property(lambda self: self.pool.blocks.num_blocks, doc="blocks in the pool")

    @property
    def model_name(self) -> str:
        return str(getattr(self.runner.base.config, "name_or_path", "") or "model")

    eos_ids = property(lambda self: self.output.eos_ids,
                       lambda self, ids: setattr(self.output, "eos_ids", set(ids)),
                       doc="The model's end-of-sequence token ids (a request stops on them "
                           "unless ignore_eos).")

    generation_tokens = property(lambda self: self.output.generation_tokens,
                                 doc="tokens sampled so far")

    def stats(self) -> EngineStats:
        s, pool, cached = self.scheduler, self.pool.blocks, self.scheduler.prefix.num_evictable
        return EngineStats(
            running=len(s.running), waiting=self.num_waiting_sequences(),
            swapped=len(s.swapped), num_blocks=pool.num_blocks,
            num_preemptions=s.num_preemptions, recomputed_tokens=s.recomputed_tokens,
            blocks_used=pool.num_used - cached, blocks_cached=cached, blocks_free=pool.num_free,
            block_size=self.block_size, prefix_cache_queried_tokens=s.prefix.queried_tokens,
            prefix_cache_hit_tokens=s.prefix.hit_tokens, prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens, **(
                {} if self.speculator is None else self.speculator.counters()))

    # -- one step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one step; returns the outputs of the requests it changed (only those it
        finished while `finished_only` is set)."""
        if self.runner.check_model(admitting=bool(self.scheduler.waiting)):  # (before all)
            self.scheduler.forget_prefixes()  # cached K/V came from other weights
        touched: dict[str, EngineRequest] = {}
        in_flight, now = self._in_flight, time.monotonic()  # (it stays until it lands)
        # Ending requests keep their last token; a token forking n completions lands first.
        if in_flight is not None and (in_flight.forks or self._aborts
                                      or self._deadlines.due(now)):
            self.output.land(in_flight, touched)
        for request_id, error in self._aborts.items():
            request = self.requests[request_id]
            running = not request.finished  # (or its tokens that just landed ended it)
            self.output.end(request, "abort")
            if error is not None and running:
                logger.warning("hf-paged: request %s aborted: %s", request_id, error)
                request.error = error
            touched[request_id] = request
        self._aborts.clear()
        self._expire(touched, now)  # before scheduling: a request past its deadline never runs
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        plan = self.scheduler.schedule()
        if plan.scheduled:
            self._run(plan, touched, in_flight)
        elif in_flight is not None:
            self.output.land(in_flight, touched)  # (unless it landed above)
        elif self.scheduler.has_work and not touched:
            # Cannot happen (a lone request always fits; check_fits saw to it): never spin.
            raise HFPagedError("the scheduler could not run any waiting request; "
                               f"{self.stats()}")
        if self.speculator is not None:  # a draft model's rows of ended sequences: given back
            self.speculator.proposer.release(self.scheduler.running)
        if self._in_flight is in_flight:  # (landed; a step that raised left it to fail_all)
            self._in_flight = None
        return self.output.outputs(touched, self.tokenizer, self.finished_only)

    def _expire(self, touched: dict, now: float) -> None:
        for request in self._deadlines.expired(now):
            if self.requests.get(request.request_id) is request:
                self.output.end(request, "timeout")
                touched[request.request_id] = request

    def _run(self, plan: Step, touched: dict, in_flight: InFlight | None) -> None:
        scheduled = plan.scheduled
        adapters = list(dict.fromkeys([item.seq.adapter for item in scheduled]))
        groups = ({adapters[0]: scheduled} if len(adapters) == 1  # one forward per adapter
                  else {a: [i for i in scheduled if i.seq.adapter == a] for a in adapters})
        self.prompt_tokens += sum([min(i.count, len(i.seq.prompt) - i.start) for i in scheduled
                                   if i.start < len(i.seq.prompt)])
        work = DeviceStep(plan.swap_out, plan.swap_in, plan.copies, plan.entries,
                          [Forward.of(items, adapter, in_flight, bool(self.runner.rope))
                           for adapter, items in groups.items()])
        self.runner.broadcast(work)  # under tensor parallelism every rank runs the same step
        logits = StepLogits()
        parallel = self.tp_size > 1
        try:
            self.runner.prepare(work)
            if parallel:  # the other ranks run this step's collectives: no forward can be re-run
                for f, items in zip(work.forwards, groups.values()):
                    logits.add(items, self._forward(f, items))
        except BaseException:
            if parallel:
                tp.end_group()
            raise
        if not parallel:
            for f, (adapter, items) in zip(work.forwards, groups.items()):
                self._forward_isolated(f, items, adapter, logits, touched, in_flight)
        if in_flight is not None:  # the last step's tokens, while this step's forward runs
            self.output.land(in_flight, touched)  # (at most once)
        self.scheduler.after_step(plan)
        finished = SeqStatus.FINISHED
        sampling = [i for i in plan.scheduled if i.sample and i.seq.status is not finished]
        if sampling:
            rows, owners, index = self.output.sampling_rows(sampling)
            if self.speculator is not None and any([i.draft for i in sampling]):
                v = self.speculator.expand(sampling, rows, owners, index)
                result, errors = self.sampler.sample_isolated(
                    logits.rows(sampling, v.index, v.offsets), v.rows).collect()
                self.speculator.record(v, sampling, result, errors, self.output,
                                       self.scheduler, touched)
                return
            sampled = self.sampler.sample_isolated(logits.rows(sampling, index), rows)
            if self.async_scheduling:
                self._in_flight = self.output.hold(sampling, owners, sampled)
            else:
                self.output.record(sampling, owners, *sampled.collect(), touched)

    def _forward(self, f: Forward, items: list) -> torch.Tensor:
        """The logits [S, V] of the rows of `f` that sample (the debug checks first); the
        prompt log-probabilities its prompt rows give are recorded."""
        check = None if not self.debug else \
            lambda meta: check_isolation(self.scheduler, self.block_size, items, meta)
        logits = self.runner.forward(f, check)
        if f.prompt_spans:
            prompt_logprobs.record(f.prompt_spans, logits[len(f.last):], self.requests,
                                   self.tokenizer)
            logits = logits[:len(f.last)]
        return logits

    def _forward_isolated(self, f: Forward, items: list, adapter, logits: StepLogits,
                          touched: dict, in_flight: InFlight | None, first=True) -> None:
        """Runs one forward; if it raises, runs each half apart (bisection) until the
        sequences that fail alone are found, and fails their requests alone. Re-running
        writes the same K/V into the same slots, so the others are as if nothing happened.
        A forward that failed after the model was changed (a layer replaced while requests
        decode: an eager engine looks at admission only) first runs anew on it as it is."""
        try:
            logits.add(items, self._forward(f, items))
            return
        except IsolationError:
            raise  # an engine bug, never a request's
        except Exception as err:  # noqa: BLE001
            error, every = f"the model's forward failed on it: {describe(err)}", False
            try:
                if first and self.runner.model_changed():
                    self.scheduler.forget_prefixes()
                    return self._forward_isolated(f, items, adapter, logits, touched,
                                                  in_flight, first=False)
            except ModelChangedError as changed:  # (a layer beyond the pool's: for all)
                error, every = str(changed), True
            if len(items) == 1 or every:
                if in_flight is not None:  # they keep their last token, as without async
                    self.output.land(in_flight, touched)
                # (one its landed token stopped computed a token too many: it ended anyway)
                for request_id in dict.fromkeys([i.seq.request_id for i in items
                                                 if not i.seq.finished]):
                    self.output.fail(self.requests[request_id], error, touched)
                return
        half = len(items) // 2
        for part in (items[:half], items[half:]):
            part = [i for i in part if not i.seq.finished]  # a sibling may have failed
            if part:
                self._forward_isolated(Forward.of(part, adapter, in_flight, bool(self.runner.rope)),
                                       part, adapter, logits, touched, in_flight, first=False)

    def fail_all(self, error: str) -> list[RequestOutput]:
        """Ends every request with `error` (after a failure no single request caused, or at
        shutdown); the engine stays usable."""
        self._aborts.clear()
        in_flight, self._in_flight = self._in_flight, None
        return self.output.fail_all(error, self.tokenizer, in_flight)

    # -- tensor parallelism: rank 0 schedules, every rank runs the forwards ---------------------
    def heartbeat(self) -> None:
        """Rank 0, while idle: keeps the other ranks' wait from timing out."""
        self.runner.broadcast(tp.IDLE)

    def stop_workers(self) -> None:
        """Rank 0: ends the other ranks' `worker_loop` (once: they listen no more)."""
        if not self._stopped:
            self._stopped = True
            self.runner.broadcast(tp.STOP)

    def worker_loop(self) -> None:
        """Ranks above 0 (which need only a `ModelRunner`): run rank 0's steps."""
        self.runner.worker_loop()


__all__ = ["BASE", "EngineStats", "LLMEngine", "engine_options", "step_budget"]
