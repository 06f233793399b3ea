"""The continuous-batching engine: one KV pool, many requests, one forward per step.

Each `step()`: the scheduler picks this step's tokens (decodes of running sequences, then
prompt chunks) under its budgets; the engine carries out the plan's swaps, copy-on-write
copies and block-table entries on the device, runs the model once on all tokens packed in
one row ([1, N], no padding; `StepCache` hands the step's metadata to the "paged"
attention), samples each sequence that reached its last token with its request's own
settings, and records tokens, stops and finished requests.

One request's trouble stays with it. Settings that can be checked against the model are
checked when a request is added (`prepare_request`). What cannot be checked up front is
contained when it happens: a forward that raises is re-run on halves of its sequences until
the ones that fail alone are found; a sampling row that raises (or whose distribution is
not finite) is sampled apart with the noise already drawn for it (a seeded generator is
never drawn from twice); a request whose stop check or text fails ends alone. Those requests end with finish_reason "error" and the
message in `error`; every other request goes on with the tokens it would have produced.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import sys
import time
from dataclasses import dataclass, field, replace

import torch
from transformers.cache_utils import Cache

from ..hf import attention
from ..core.block_table import FREED
from .detokenizer import IncrementalText
from ..errors import HFPagedError, InvalidRequestError, UnsupportedModelError, describe
from ..kv.pool import KVPool, block_bytes
from ..kv.metadata import DeviceBlockTable, build_metadata, to_device
from ..hf.architectures import attention_tp_size, kv_layout, tp_heads
from ..distributed.placement import input_device, logits_index_device, model_placement
from ..outputs import CompletionOutput, RequestMetrics, RequestOutput
from ..kernels.dispatch import PoolAccess
from ..core.prefix_cache import namespace
from .request import EngineRequest
from .sampler import SampleResult, Sampler, SampleRow
from ..sampling_params import SamplingParams, generation_defaults
from ..core.scheduler import RequestRejectedError, Scheduler, Step
from ..core.sequence import Sequence

logger = logging.getLogger("hf_paged")

DEBUG_ENV_VAR = "HF_PAGED_DEBUG"  # "1": check every step's tables and slots (isolation)
BASE = "__base__"  # the adapter name of a PEFT model's base model (PEFT's own name for it)


def _end_group() -> None:
    """Ends this process after a step failed on rank 0 once the other ranks had started it:
    they wait in its collectives, so no later step could pair up with theirs. torchrun then
    takes the whole group down, naming this rank."""
    logger.critical("hf-paged: a tensor-parallel step failed on rank 0 after the other ranks "
                    "started it; ending the process group", exc_info=True)
    sys.stderr.flush()
    os._exit(1)


class IsolationError(HFPagedError, AssertionError):
    """A step would read or write a block its sequence does not hold (debug mode)."""


class StepCache(PoolAccess, Cache):
    """The `past_key_values` of one engine forward: writes go to the slots of the step's
    metadata, attention reads each sequence's own blocks."""

    def __init__(self, pool: KVPool, backend: str, num_heads: int, sliding_window: int | None):
        """backend: the attention backend's name (one instance per pool shard)."""
        Cache.__init__(self, layers=[])
        self.num_layers, self.num_kv_heads, self.head_dim = (pool.num_layers, pool.num_kv_heads,
                                                             pool.head_dim)
        self.num_heads = num_heads
        self.sliding_window = sliding_window
        self._bind_backends(backend, pool)
        self.pool = pool
        self._refresh_views()

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if layer_idx == 0:
            attention.claim()  # this forward's mask announcement is used up
        return self.write(key_states, value_states, layer_idx)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions come with each forward; nothing is sliced by length

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        attention.announce(self, query_length)
        return query_length, 0

    def adopt_mask(self, attention_mask) -> None:
        pass  # the step's metadata says everything; the engine passes no padding mask


class _Rows:
    """A view of some rows of the device block table (what build_metadata reads)."""

    def __init__(self, table: torch.Tensor, device: torch.device):
        self.table, self.device = table, device


@dataclass
class Forward:
    """The host-side inputs of one packed forward: token ids and positions of the scheduled
    sequences back to back, their block-table rows, cached lengths and new-token counts, and
    the indices (in `ids`) of the last token of each sequence that samples."""

    adapter: str | None
    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    context: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    last: list[int] = field(default_factory=list)


@dataclass
class DeviceStep:
    """What every rank does for one step: block swaps and copies, block-table entries, then
    the forwards (plain lists; rank 0 broadcasts it under tensor parallelism)."""

    swap_out: list
    swap_in: list
    copies: list
    entries: list
    forwards: list[Forward]


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's state and counters."""

    running: int
    waiting: int
    swapped: int
    num_preemptions: int
    num_blocks: int
    blocks_used: int  # held by running sequences
    blocks_cached: int  # kept by the prefix cache, held by nobody (reused or evicted later)
    blocks_free: int
    block_size: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    prompt_tokens: int  # prompt tokens computed (prefix-cache hits excluded)
    generation_tokens: int  # tokens sampled

    @property
    def kv_usage(self) -> float:
        return self.blocks_used / self.num_blocks if self.num_blocks else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.prefix_cache_queried_tokens
        return self.prefix_cache_hit_tokens / q if q else 0.0


def _unwrap(model):
    """(model to call, the Transformers model under it, its PEFT adapter names)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(model, "peft_config", None) or {}
    for name, adapter in config.items():
        if getattr(adapter, "is_prompt_learning", False):
            raise UnsupportedModelError(
                f"The engine serves LoRA-style PEFT adapters; adapter {name!r} is "
                f"{adapter.peft_type} (prompt learning), which changes the inputs of generate "
                "itself. Use model.generate(..., cache_implementation='paged') for it."
            )
    return model, base, list(config)


class LLMEngine:
    """Continuous batching on the paged KV cache for a loaded model (or PEFT model).

    Engine options:
      block_size:        tokens per KV block (16)
      num_blocks / kv_cache_bytes: the KV budget; on CUDA, without either, the fraction
                         `gpu_memory_utilization` (0.9) of free device memory; on CPU, 1 GiB
                         or a quarter of physical memory, whichever is smaller
      max_num_seqs:      sequences running at once (64 on CPU, 256 on CUDA)
      max_num_batched_tokens: tokens per step, decodes and prompt chunks (2048 / 8192)
      enable_prefix_caching: share cached full blocks of common prompt prefixes (True)
      preemption_mode:   "recompute" (default) or "swap" (to a CPU pool of
                         `swap_space_bytes`, by default the size of the KV pool, at
                         most a quarter of host memory shared by the ranks of a machine)
      max_model_len:     the longest sequence (the model's max_position_embeddings)
      backend:           attention backend, as `cache_config["backend"]`
    """

    def __init__(self, model, tokenizer=None, *, block_size: int = 16,
                 num_blocks: int | None = None, kv_cache_bytes: int | None = None,
                 gpu_memory_utilization: float = 0.9, max_num_seqs: int | None = None,
                 max_num_batched_tokens: int | None = None, enable_prefix_caching: bool = True,
                 preemption_mode: str = "recompute", swap_space_bytes: int | None = None,
                 max_model_len: int | None = None, backend: str = "auto"):
        from ..generate.patches import is_supported, SUPPORTED_ARCHITECTURES

        self.model, base, self.adapters = _unwrap(model)
        if not is_supported(base):
            raise UnsupportedModelError(
                f"The engine runs {', '.join(SUPPORTED_ARCHITECTURES)}; got {type(base).__name__}.")
        self.tokenizer = tokenizer
        self.model.eval()
        self._base = base
        text_config = base.config.get_text_config(decoder=True)
        self.device, self.dtype = input_device(base), base.dtype  # the model's inputs' device
        self.tp_size = getattr(base, "tp_size", None) or 1
        self.rank = torch.distributed.get_rank() if self.tp_size > 1 else 0
        num_layers, _, head_dim = kv_layout(text_config)
        num_heads, kv_heads = tp_heads(text_config, attention_tp_size(base))  # this rank's
        # A model spread by device_map keeps each layer's KV on that layer's device.
        placement = model_placement(base, num_layers)
        self.kv_device = placement.primary  # where block tables and metadata are built
        self._index_device = logits_index_device(base)  # for logits_to_keep
        cuda = any(d.type == "cuda" for d in placement.devices)
        self.block_size = _positive("block_size", block_size)
        self.max_model_len = _positive("max_model_len", max_model_len
                                       or getattr(text_config, "max_position_embeddings", 2048))
        self.max_num_seqs = _positive("max_num_seqs", max_num_seqs or (256 if cuda else 64))
        self.max_num_batched_tokens = _positive(
            "max_num_batched_tokens", max_num_batched_tokens or (8192 if cuda else 2048))
        per_layer = block_bytes(1, kv_heads, head_dim, self.block_size, self.dtype)
        per_block = num_layers * per_layer
        blocks = self._pool_blocks(num_blocks, kv_cache_bytes, gpu_memory_utilization,
                                   per_layer, placement)
        self._control = None
        if self.tp_size > 1:  # every rank must hold the same blocks: the smallest pool wins
            agreed = torch.tensor([blocks], device=self.device)
            torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
            blocks = int(agreed)
            # Step plans travel over a CPU (gloo) group: an idle worker then waits in a
            # socket, not in a GPU collective, and pickled plans skip the device.
            self._control = torch.distributed.new_group(backend="gloo")
        self.pool = KVPool(num_layers, kv_heads, head_dim, self.block_size, blocks, self.dtype,
                           placement, growable=False)
        logger.info("hf-paged engine: KV pool of %d blocks x %d tokens (%s)", blocks,
                    self.block_size, ", ".join(
                        f"{blocks * per_layer * len(layers) / 2**20:.1f} MiB on {device}"
                        for device, layers in zip(placement.devices, placement.layers)))
        cpu_pool = None
        if preemption_mode == "swap":
            if swap_space_bytes is None:  # the pool's size, within a share of host memory
                physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
                ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
                swap_blocks = min(blocks, physical // 4 // ranks_here // per_block)
            else:
                swap_blocks = swap_space_bytes // per_block
            self.cpu_pool = KVPool(num_layers, kv_heads, head_dim, self.block_size,
                                   swap_blocks, self.dtype, placement.on("cpu"), growable=False)
            if torch.cuda.is_available() and any(d.type == "cuda" for d in placement.devices):
                self.cpu_pool.pin_memory()
            cpu_pool = self.cpu_pool.blocks
        else:
            self.cpu_pool = None
        self.sliding_window = getattr(text_config, "sliding_window", None)
        self.scheduler = Scheduler(self.pool.blocks, self.max_num_seqs,
                                   self.max_num_batched_tokens, self.max_model_len,
                                   self.sliding_window, enable_prefix_caching, preemption_mode,
                                   cpu_pool)
        self.cache = StepCache(self.pool, backend, num_heads, self.sliding_window)
        self.device_table = DeviceBlockTable(self.max_num_seqs,
                                             -(-self.max_model_len // self.block_size),
                                             self.kv_device)
        self.sampler = Sampler()
        self.vocab_size = base.get_output_embeddings().weight.shape[0]
        # Decode every step (servers stream text); otherwise only finished completions.
        self.incremental_text = False
        self.defaults = generation_defaults(getattr(base, "generation_config", None))
        eos = getattr(getattr(base, "generation_config", None), "eos_token_id", None)
        if eos is None:
            eos = getattr(text_config, "eos_token_id", None)
        eos = eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else []
        self.eos_ids = {e for e in eos if isinstance(e, int) and 0 <= e < self.vocab_size}
        self.requests: dict[str, EngineRequest] = {}
        self._aborts: dict[str, str | None] = {}  # request id -> why (None: asked to)
        self._deadlines: list = []  # heap of (deadline, tie-break, request)
        self._seq_ids = itertools.count(1)
        self._arrivals = itertools.count()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.debug = os.environ.get(DEBUG_ENV_VAR) == "1"

    def _pool_blocks(self, num_blocks, kv_cache_bytes, utilization, per_layer,
                     placement) -> int:
        """Blocks of the pool. per_layer: bytes of one block of one layer. kv_cache_bytes
        bounds all devices together; a CUDA budget from free memory holds on every device."""
        if num_blocks is not None and kv_cache_bytes is not None:
            raise ValueError("Give one of num_blocks and kv_cache_bytes, not both.")
        if num_blocks is not None:
            return _positive("num_blocks", num_blocks)
        per_block = per_layer * placement.num_layers
        if kv_cache_bytes is None:
            budgets = []
            for device, layers in zip(placement.devices, placement.layers):
                if device.type == "cuda":
                    free, _ = torch.cuda.mem_get_info(device)
                    budgets.append(int(free * utilization) // len(layers) * placement.num_layers)
                else:
                    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
                    budgets.append(min(2**30, physical // 4) // len(layers) * placement.num_layers)
            kv_cache_bytes = min(budgets)
        blocks = _positive("kv_cache_bytes", kv_cache_bytes) // per_block
        if blocks == 0:
            raise ValueError(f"kv_cache_bytes={kv_cache_bytes} is smaller than one KV block "
                             f"({per_block} bytes).")
        most = self.max_num_seqs * (-(-self.max_model_len // self.block_size) + 1)
        return min(blocks, most)  # never more than every sequence at full length

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
                        adapter: str | None = None,
                        cache_salt: str | None = None) -> EngineRequest:
        """Checks a request against the model and the pool and tokenizes it, changing no
        engine state (a server may call it on its own thread while the engine steps);
        `add_prepared` then queues it."""
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError(f"request ids are non-empty strings; got {request_id!r}.")
        if adapter is not None and adapter not in self.adapters + [BASE]:
            raise InvalidRequestError(f"unknown adapter {adapter!r}; the model has "
                                      f"{self.adapters}.", "model")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequestError(f"priority must be an integer; got {priority!r}.",
                                      "priority")
        params = (params or SamplingParams()).resolved(self.defaults)
        params.check_vocab(self.vocab_size)
        if cache_salt is not None:
            if params.cache_salt not in (None, cache_salt):
                raise InvalidRequestError("cache_salt is given twice, with different values.",
                                          "cache_salt")
            params = replace(params, cache_salt=cache_salt)  # checked as SamplingParams'
        text = None
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("A text prompt needs a tokenizer; pass token ids, or "
                                          "give the engine a tokenizer.", "prompt")
            text, prompt = prompt, self.tokenizer(prompt)["input_ids"]
        prompt = list(prompt)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise InvalidRequestError("prompt token ids must be integers.", "prompt")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt token ids must be in [0, {self.vocab_size}); "
                                      f"got {bad[:5]}.", "prompt")
        self.scheduler.check_fits(len(prompt), params.max_tokens, params.n)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)
        generators = [None] * params.n
        if params.seed is not None:
            generators = [torch.Generator(self.device).manual_seed(params.generator_seed(i))
                          for i in range(params.n)]
        follow = self.tokenizer is not None and (self.incremental_text or bool(params.stop))
        arrival = time.monotonic()
        logprobs = params.logprobs is not None
        return EngineRequest(
            request_id, text, prompt, params, priority, adapter,
            namespace(adapter, params.cache_salt),
            [CompletionOutput(i, logprobs=[] if logprobs else None,
                              cumulative_logprob=0.0 if logprobs else None)
             for i in range(params.n)],
            generators, stop_ids, RequestMetrics(arrival),
            [IncrementalText(self.tokenizer) for _ in range(params.n)] if follow else None,
            None if params.timeout is None else arrival + params.timeout)

    def add_prepared(self, request: EngineRequest) -> None:
        """Queues a request made by `prepare_request`."""
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use.")
        params = request.params
        seq = Sequence(next(self._seq_ids), request.request_id, request.prompt_ids,
                       params.max_tokens, request.priority, next(self._arrivals),
                       salt=request.salt, forks=params.n - 1, adapter=request.adapter)
        request.seqs = [seq]
        self.requests[request.request_id] = request
        if request.deadline is not None:
            heapq.heappush(self._deadlines, (request.deadline, next(self._arrivals), request))
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

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work or bool(self._aborts)

    def num_waiting_sequences(self) -> int:
        """Sequences queued and not started (a waiting request of n completions counts n).
        Safe to read from another thread while the engine steps."""
        return sum(1 + s.forks for s in list(self.scheduler.waiting))

    @property
    def num_blocks(self) -> int:
        return self.pool.blocks.num_blocks

    @property
    def model_name(self) -> str:
        return str(getattr(self._base.config, "name_or_path", "") or "model")

    def stats(self) -> EngineStats:
        s, pool = self.scheduler, self.pool.blocks
        cached = s.prefix.num_evictable
        return EngineStats(
            running=len(s.running), waiting=len(s.waiting), swapped=len(s.swapped),
            num_preemptions=s.num_preemptions, num_blocks=pool.num_blocks,
            blocks_used=pool.num_used - cached, blocks_cached=cached, blocks_free=pool.num_free,
            block_size=self.block_size, prefix_cache_queried_tokens=s.prefix.queried_tokens,
            prefix_cache_hit_tokens=s.prefix.hit_tokens, prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens)

    # -- one step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one step; returns the outputs of the requests it changed."""
        touched: dict[str, EngineRequest] = {}
        for request_id, error in self._aborts.items():
            request = self.requests[request_id]
            self._end(request, "abort")
            if error is not None:
                logger.warning("hf-paged: request %s aborted: %s", request_id, error)
                request.error = error
            touched[request_id] = request
        self._aborts.clear()
        self._expire(touched)  # before scheduling: a request past its deadline never runs
        plan = self.scheduler.schedule()
        if plan.scheduled:
            self._run(plan, touched)
        elif self.scheduler.has_work and not touched:
            # Cannot happen (a lone request always fits; check_fits saw to it): never spin.
            raise HFPagedError("the scheduler could not run any waiting request; "
                               f"{self.stats()}")
        now = time.monotonic()
        outputs = []
        for request in touched.values():
            if request.finished:
                request.metrics.finished_time = now
            outputs.append(request.output(self.tokenizer))
        for request in touched.values():
            if request.finished:
                del self.requests[request.request_id]
        return outputs

    def _expire(self, touched: dict) -> None:
        now = time.monotonic()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, request = heapq.heappop(self._deadlines)
            if self.requests.get(request.request_id) is request and not request.finished:
                self._end(request, "timeout")
                touched[request.request_id] = request

    def _end(self, request: EngineRequest, reason: str) -> None:
        """Ends every unfinished completion of `request` with `reason`, freeing its blocks."""
        for seq in request.seqs:
            self.scheduler.finish(seq, reason)
        request.end(reason)

    def _fail(self, request: EngineRequest, message: str, touched: dict) -> None:
        """Ends `request` alone with finish_reason "error" and `message`."""
        logger.warning("hf-paged: request %s failed: %s", request.request_id, message)
        self._end(request, "error")
        request.error = message
        touched[request.request_id] = request

    def _run(self, plan: Step, touched: dict) -> None:
        groups: dict[str | None, list] = {}  # one forward per adapter
        for item in plan.scheduled:
            groups.setdefault(item.seq.adapter, []).append(item)
            seq = item.seq
            if item.start < len(seq.prompt):
                self.prompt_tokens += min(item.count, len(seq.prompt) - item.start)
        work = DeviceStep(plan.swap_out, plan.swap_in, plan.copies, plan.entries,
                          [self._forward_plan(items, adapter) for adapter, items in groups.items()])
        self._broadcast(work)  # under tensor parallelism every rank runs the same step
        logits: dict[int, torch.Tensor] = {}  # id(scheduled item) -> its logits [V]
        tp = self.tp_size > 1
        try:
            self._move_blocks(work)
            self.device_table.apply(work.entries)
            if tp:  # the other ranks run this step's collectives: no forward can be re-run
                for f, items in zip(work.forwards, groups.values()):
                    self._keep(logits, items, self._forward(f, items))
        except BaseException:
            if tp:
                _end_group()
            raise
        if not tp:
            for f, (adapter, items) in zip(work.forwards, groups.items()):
                self._forward_isolated(f, items, adapter, logits, touched)
        self.scheduler.after_step(plan)
        sampling = [i for i in plan.scheduled if i.sample and not i.seq.finished]
        if sampling:
            self._sample(sampling, torch.stack([logits[id(i)] for i in sampling]), touched)

    @staticmethod
    def _keep(logits: dict, items: list, rows: torch.Tensor) -> None:
        logits.update(zip((id(i) for i in items if i.sample), rows))

    def _forward_isolated(self, f: "Forward", items: list, adapter, logits: dict,
                          touched: dict) -> None:
        """Runs one forward; if it raises, runs each half apart (bisection) until the
        sequences that fail alone are found, and fails their requests alone. Re-running
        writes the same K/V into the same slots, so the others are as if nothing happened."""
        try:
            self._keep(logits, items, self._forward(f, items))
            return
        except IsolationError:
            raise  # an engine bug, never a request's
        except Exception as err:  # noqa: BLE001
            if len(items) == 1:
                request = self.requests[items[0].seq.request_id]
                self._fail(request, f"the model's forward failed on it: {describe(err)}",
                           touched)
                return
        half = len(items) // 2
        for part in (items[:half], items[half:]):
            part = [i for i in part if not i.seq.finished]  # a sibling may have failed
            if part:
                self._forward_isolated(self._forward_plan(part, adapter), part, adapter,
                                       logits, touched)

    def _forward_plan(self, items: list, adapter: str | None) -> "Forward":
        """The host-side inputs of one packed forward over `items` (scheduled sequences)."""
        f = Forward(adapter)
        for item in items:
            seq = item.seq
            f.ids += seq.tokens(item.start, item.start + item.count)
            f.positions += range(item.start, item.start + item.count)
            f.rows.append(seq.row)
            f.context.append(item.start)
            f.counts.append(item.count)
            if item.sample:
                f.last.append(len(f.ids) - 1)
        return f

    def _execute(self, work: "DeviceStep") -> list[torch.Tensor]:
        """The device side of a step on a rank other than 0: block moves, table entries,
        then each forward."""
        self._move_blocks(work)
        self.device_table.apply(work.entries)
        return [self._forward(f, None) for f in work.forwards]

    def _forward(self, f: "Forward", items: list | None) -> torch.Tensor:
        """Returns the logits [S, V] of the rows of `f` that sample.
        items: the scheduled sequences of the forward (rank 0), for the debug checks."""
        device = self.device
        meta = self._metadata(f.rows, f.context, f.counts)
        if 1 in f.counts and max(f.counts) > 1:
            meta.parts = self._parts(f.rows, f.context, f.counts)
        if self.debug and items is not None:
            self._check_isolation(items, meta)
        keep = to_device(f.last or [len(f.ids) - 1], self._index_device)
        extra = {}
        if f.adapter is not None:  # PEFT picks the adapter per batch row; the batch is one row
            extra["adapter_names"] = [f.adapter]
        from ..generate.patches import paged_attention

        self.cache.meta = meta
        try:
            with torch.inference_mode(), paged_attention(self._base):
                out = self.model(input_ids=to_device(f.ids, device)[None],
                                 position_ids=to_device(f.positions, device)[None],
                                 past_key_values=self.cache, use_cache=True, logits_to_keep=keep,
                                 **extra)
        finally:
            self.cache.meta = None
        return out.logits[0, :len(f.last)]

    # -- tensor parallelism: rank 0 schedules, every rank runs the forwards ---------------------
    def _broadcast(self, message) -> None:
        if self.tp_size > 1:
            torch.distributed.broadcast_object_list([message], src=0, group=self._control)

    def worker_loop(self) -> None:
        """On ranks other than 0: run the steps rank 0 broadcasts until it stops them."""
        while True:
            box = [None]
            torch.distributed.broadcast_object_list(box, src=0, group=self._control)
            if box[0] is None:
                return
            if isinstance(box[0], DeviceStep):
                self._execute(box[0])

    def heartbeat(self) -> None:
        """Rank 0, while idle: keeps the other ranks' wait from timing out."""
        self._broadcast("idle")

    def stop_workers(self) -> None:
        """Rank 0: ends the other ranks' `worker_loop`."""
        self._broadcast(None)

    def _metadata(self, rows: list[int], context: list[int], counts: list[int]):
        """Packed-forward metadata of `rows` (block-table rows), each with `context` tokens
        cached and `counts` new ones."""
        device = self.kv_device
        table = _Rows(self.device_table.table.index_select(0, to_device(rows, device)), device)
        lens = [c + n for c, n in zip(context, counts)]
        return build_metadata(table, to_device(context, device), counts, max(counts), max(lens),
                              self.block_size, packed=True, seq_lens_host=lens)

    def _parts(self, rows, context, counts):
        """Decode rows apart from prompt-chunk rows, so that attention does not pad every
        decode query to the longest chunk (see ForwardMetadata.parts)."""
        starts = [0]
        for n in counts:
            starts.append(starts[-1] + n)
        parts = []
        for decode in (True, False):
            members = [i for i, n in enumerate(counts) if (n == 1) == decode]
            where = [t for i in members for t in range(starts[i], starts[i + 1])]
            meta = self._metadata([rows[i] for i in members], [context[i] for i in members],
                                  [counts[i] for i in members])
            parts.append((meta, to_device(where, self.kv_device)))
        return parts

    def _move_blocks(self, plan) -> None:
        if plan.swap_out:
            gpu, cpu = zip(*plan.swap_out)
            self.pool.copy_to(self.cpu_pool, list(gpu), list(cpu))
        if plan.swap_in:
            cpu, gpu = zip(*plan.swap_in)
            self.cpu_pool.copy_to(self.pool, list(cpu), list(gpu))
        if plan.copies:
            self.cache.copy_blocks(plan.copies)

    def _sample(self, items: list, logits: torch.Tensor, touched: dict) -> None:
        """items: the scheduled sequences that sample; logits [S, V], one row each."""
        rows, owners, index = [], [], []
        for row_of_logits, item in enumerate(items):
            seq = item.seq
            request = self.requests[seq.request_id]
            targets = [seq] + [None] * seq.forks  # None: a sibling forked from this row
            for k, target in enumerate(targets):
                completion = k if target is None else request.seqs.index(seq)
                rows.append(self._sample_row(request, seq, completion))
                owners.append((request, seq, target, completion))
                index.append(row_of_logits)
        result, errors = self._sample_rows(logits[torch.tensor(index, device=logits.device)],
                                           rows)
        failed: dict[str, str] = {}
        for j, message in errors.items():
            failed.setdefault(owners[j][0].request_id, message)
        children: dict[int, list[Sequence]] = {}
        now = time.monotonic()
        for (request, seq, target, completion), token, lp, tlp in zip(
                owners, result.tokens, result.logprobs, result.token_logprobs):
            if request.request_id in failed:
                continue
            if target is None:
                child = Sequence(next(self._seq_ids), seq.request_id, seq.prompt,
                                 seq.max_tokens, seq.priority, seq.arrival, seq.salt,
                                 adapter=seq.adapter)
                request.seqs.append(child)
                children.setdefault(id(seq), []).append(child)
                target = child
            request.append(target, completion, token, lp, tlp, now)
            self.generation_tokens += 1
            touched[request.request_id] = request
        for request_id, message in failed.items():
            self._fail(self.requests[request_id], message, touched)
        for item in items:
            seq = item.seq
            if id(seq) in children:
                seq.forks = 0
                self.scheduler.fork(seq, children[id(seq)])
        for request in list(touched.values()):
            if request.finished:
                continue
            try:
                for k, seq in enumerate(request.seqs):
                    if not seq.finished:
                        reason = request.stop(seq, k, self.eos_ids)
                        if reason is not None:
                            self.scheduler.finish(seq, reason)
            except Exception as err:  # noqa: BLE001 (e.g. its tokens do not decode)
                self._fail(request, f"its stop check failed: {describe(err)}", touched)

    def _sample_rows(self, logits: torch.Tensor, rows: list[SampleRow]):
        """(SampleResult, {row: error message}) for logits [S, V]. If sampling the rows
        together raises, each row is sampled alone with the same noise (drawn once, before,
        so a seeded generator is never drawn from twice): one row's failure costs only its
        own request, and every other row gets the token it would have got."""
        noise = self.sampler.noise(logits.shape[0], logits.shape[1], rows, logits.device)
        try:
            result = self.sampler(logits, rows, noise)
        except Exception as err:  # noqa: BLE001
            logger.warning("hf-paged: sampling %d rows together failed (%s); sampling them "
                           "apart", len(rows), describe(err))
            tokens, lps, tlps, errors = [], [], [], {}
            for j, row in enumerate(rows):
                try:
                    one = self.sampler(logits[j:j + 1], [row],
                                       None if noise is None else noise[j:j + 1])
                    if one.failed:
                        errors[j] = _NOT_FINITE
                except Exception as row_err:  # noqa: BLE001
                    one, errors[j] = None, f"sampling failed: {describe(row_err)}"
                tokens.append(one.tokens[0] if one else 0)
                lps.append(one.logprobs[0] if one else None)
                tlps.append(one.token_logprobs[0] if one else None)
            return SampleResult(tokens, lps, tlps, sorted(errors)), errors
        return result, {j: _NOT_FINITE for j in result.failed}

    def _sample_row(self, request: EngineRequest, seq: Sequence, completion: int) -> SampleRow:
        params = request.params
        suppress = None
        if len(seq.output) < params.min_tokens and request.stop_ids:
            suppress = sorted(request.stop_ids)
        return SampleRow(params, seq.prompt, seq.output, request.generators[completion],
                         suppress)

    def fail_all(self, error: str) -> list[RequestOutput]:
        """Ends every request with `error` (after a failure no single request caused, or at
        shutdown); the engine stays usable."""
        outputs = []
        for request in list(self.requests.values()):
            self._end(request, "error")
            request.error = error
            request.metrics.finished_time = time.monotonic()
            outputs.append(request.output(self.tokenizer))
            del self.requests[request.request_id]
        self._aborts.clear()
        return outputs

    # -- checks ---------------------------------------------------------------------------------
    def _check_isolation(self, items: list, meta) -> None:
        """Debug mode: every block a forward touches belongs to the sequence touching it."""
        s = self.scheduler
        pool = self.pool.blocks
        holders: dict[int, int] = {}
        for table in s.tables.tables:
            for b in table:
                if b != FREED:
                    holders[b] = holders.get(b, 0) + 1
        free = set(pool.free_blocks())
        for b in range(pool.num_blocks):
            expected = holders.get(b, 0) + s.prefix.holds(b)
            if pool.refcount(b) != expected or (b in free) != (expected == 0):
                raise IsolationError(f"block {b}: refcount {pool.refcount(b)}, holders "
                                     f"{expected}, free {b in free}")
        slots = meta.slot_mapping.tolist()
        offset = 0
        for item in items:
            own = set(s.tables.tables[item.seq.row]) - {FREED}
            for slot in slots[offset:offset + item.count]:
                if slot // self.block_size not in own:
                    raise IsolationError(f"sequence {item.seq.seq_id} writes slot {slot} "
                                         f"outside its blocks {sorted(own)}")
                if pool.refcount(slot // self.block_size) > 1 + s.prefix.holds(slot // self.block_size):
                    raise IsolationError(f"sequence {item.seq.seq_id} writes into shared "
                                         f"block {slot // self.block_size}")
            offset += item.count
        for i, item in enumerate(items):
            table = meta.block_tables[i].tolist()
            row = s.tables.tables[item.seq.row]
            for col, block in enumerate(row):
                if block != FREED and col < len(table) and table[col] != block:
                    raise IsolationError(f"device table of sequence {item.seq.seq_id} has "
                                         f"{table[col]} at {col}, the scheduler {block}")


_NOT_FINITE = ("its next-token distribution is not finite (NaN or infinity from the model's "
               "logits or its sampling settings)")


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer; got {value!r}.")
    return value


__all__ = ["EngineStats", "IsolationError", "LLMEngine", "RequestRejectedError", "StepCache"]
