"""The model runner: the device side of an engine step.

It owns the KV pool (and the CPU pool swaps go to), the device copy of the block tables and
the model. A step reaches it as a `DeviceStep` (plain lists: block swaps and copies,
block-table entries, then one packed forward per adapter); for each forward it builds the
`ForwardMetadata` once and runs the model with the forward's `PagedForward` as both its
`past_key_values` and its `paged_kv` keyword, which is how the attention gets it. Ranks
above 0 of a tensor-parallel group build only this (see distributed/tensor_parallel.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field

import torch

from ..config import flag, fraction, positive
from ..distributed import tensor_parallel as tp
from ..distributed.placement import input_device, logits_index_device, model_placement
from ..errors import UnsupportedModelError
from ..hf.architectures import (
    attention_features, attention_tp_size, kv_spec, tp_heads, unsupported_reason,
)
from ..hf.attention import KWARG
from ..hf.linear import onednn_linears, use_onednn_linears
from ..hf.probe import route_reason
from ..hf.register import register, switch_rotary
from ..hf.rope import TokenRope, use_token_rope
from ..hf.switch import paged_attention
from ..kernels.dispatch import PoolAccess
from ..kv.metadata import (DeviceBlockTable, ForwardMetadata, build_metadata,
                           decode_metadata, to_device)
from ..kv.placement import group_layers
from ..kv import quant
from ..kv.pool import KVPool, block_bytes
from ..utils import cdiv
from .adapters import drop_row_hooks, follow, forward_adapter
from .compiled import COMPILE_ERRORS, compile_forward, run_eagerly
from .graphs import DecodeGraphs, wants_graphs
from .model_watch import ModelWatch
from .options import pool_blocks

logger = logging.getLogger("hf_paged")


@dataclass
class Forward:
    """The host-side inputs of one packed forward: token ids and positions of the scheduled
    sequences back to back, their block-table rows, cached lengths and new-token counts, and
    the indices (in `ids`) of the last token of each sequence that samples. Under async
    scheduling a decode's token may not have reached the host yet: `ids[fill_at[i]]` is then
    read on the device from `previous[fill_from[i]]` (the last step's sampled tokens).
    `prompt_rows` index the tokens whose logits prompt log-probabilities need, one run of
    them per (sequence, first position, count) in `prompt_spans`."""

    adapter: str | None
    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    context: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    last: list[int] = field(default_factory=list)
    fill_at: list[int] = field(default_factory=list)
    fill_from: list[int] = field(default_factory=list)
    previous: torch.Tensor | None = None  # [R] long, on the sampler's device
    prompt_rows: list[int] = field(default_factory=list)
    prompt_spans: list[tuple] = field(default_factory=list)
    rope_lengths: list[int] | None = None  # the rows' rotary lengths, where the model needs them

    @classmethod
    def of(cls, items: list, adapter: str | None, in_flight=None,
           rope: bool = False) -> "Forward":
        """The inputs of one forward over `items` (scheduled sequences); in_flight: the
        last step's sampling whose tokens some of them wait for (engine.InFlight);
        rope: keep each row's rotary length (hf/rope.py)."""
        f = cls(adapter)
        seqs = [item.seq for item in items]
        if rope:
            f.rope_lengths = [seq.rope_length or len(seq.prompt) for seq in seqs]
        f.rows = [seq.row for seq in seqs]
        f.context = [item.start for item in items]
        f.counts = [item.count for item in items]
        if f.counts.count(1) == len(items):  # a token per row (decodes): no per-row appends
            f.ids = [s.output[k] if (k := c - len(s.prompt)) >= 0 and not s.pending else None
                     for s, c in zip(seqs, f.context)]
            f.positions = list(f.context)
            samples = [item.sample for item in items]
            f.last = list(range(len(items))) if all(samples) else \
                [j for j, sample in enumerate(samples) if sample]
            if None in f.ids:  # tokens still on the device, or one-token prompt chunks
                for j in [j for j, token in enumerate(f.ids) if token is None]:
                    f._add_token(j, seqs[j], f.context[j], in_flight)
                    f._want_prompt_logits(j, seqs[j], f.context[j], 1)
            return f
        ids, positions, last = f.ids, f.positions, f.last
        for item, seq in zip(items, seqs):
            start, count = item.start, item.count
            if count == 1 and start >= len(seq.prompt):  # a decode: the newest token
                ids.append(None)
                f._add_token(len(ids) - 1, seq, start, in_flight)
                positions.append(start)
            elif item.draft:  # the newest token and its drafts, all of whose logits count
                first = len(ids)
                ids.append(None)
                f._add_token(first, seq, start, in_flight)
                ids += item.draft
                positions += range(start, start + count)
                last += range(first, first + count - 1)
            else:
                f._want_prompt_logits(len(ids), seq, start, count)
                ids += seq.tokens(start, start + count)
                positions += range(start, start + count)
            if item.sample:
                last.append(len(ids) - 1)
        return f

    def fill_pending(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [N] int64 on the device (this forward's `ids`), with the tokens the host has
        not seen filled in from the last step's sampling; returned for chaining."""
        if self.fill_at:
            with torch.inference_mode():
                ids[to_device(self.fill_at, ids.device)] = self.previous[
                    to_device(self.fill_from, self.previous.device)].to(ids.device)
        return ids

    def _add_token(self, j: int, seq, start: int, in_flight) -> None:
        """ids[j]: `seq`'s token at position `start`, or read on the device from the last
        step's sampled tokens if it is pending there."""
        if seq.pending:
            self.fill_at.append(j)
            self.fill_from.append(in_flight.rows[seq.seq_id])
            self.ids[j] = 0
            self.previous = in_flight.sampled.tokens
        else:
            self.ids[j] = seq.tokens(start, start + 1)[0]

    def _want_prompt_logits(self, j: int, seq, start: int, count: int) -> None:
        """Tokens [start, start + count) of `seq` from ids[j] on: those whose logits give
        prompt log-probabilities (a position's logits score the next prompt token)."""
        first = seq.prompt_logits_from
        if first is None:
            return
        low, high = max(start, first), min(start + count, len(seq.prompt) - 1)
        if low < high:
            self.prompt_rows += range(j + low - start, j + high - start)
            self.prompt_spans.append((seq, low, high - low))


@dataclass
class DeviceStep:
    """What every rank does for one step: block swaps and copies, block-table entries, then
    the forwards (plain lists; rank 0 broadcasts it under tensor parallelism)."""

    swap_out: list
    swap_in: list
    copies: list
    entries: list
    forwards: list[Forward]


def unwrap(model):
    """(model to call, the Transformers model under it, its PEFT adapter names). Adapters
    Transformers put into the model itself (`model.load_adapter`) are not among the names:
    its forward runs the active ones on every row, as part of the model's weights."""
    peft = hasattr(model, "get_base_model")
    base = model.get_base_model() if peft else model
    config = (getattr(model, "peft_config", None) or {}) if peft else {}
    for name, adapter in config.items():
        if getattr(adapter, "is_prompt_learning", False):
            raise UnsupportedModelError(
                f"The engine serves LoRA-style PEFT adapters; adapter {name!r} is "
                f"{adapter.peft_type} (prompt learning), which changes the inputs of generate "
                "itself. Use model.generate(..., cache_implementation='paged') for it."
            )
    return model, base, list(config)


class ModelRunner:
    """The KV pools, the device block table and the model's forwards of one rank."""

    def __init__(self, model, *, block_size: int = 16, num_blocks: int | None = None,
                 kv_cache_bytes: int | None = None, gpu_memory_utilization: float = 0.9,
                 max_num_seqs: int | None = None, max_model_len: int | None = None,
                 preemption_mode: str = "recompute", swap_space_bytes: int | None = None,
                 backend: str = "auto", compile: bool | str = False,
                 kv_cache_dtype: str = "auto", cuda_graphs: bool | None = None,
                 max_num_batched_tokens: int | None = None, onednn_linear: bool = True):
        """See `LLMEngine` for the options. max_num_seqs: rows of the device block table
        (default 256 on CUDA, 64 elsewhere, and never more than a step's token budget
        `max_num_batched_tokens`: each running sequence decodes a token a step)."""
        self.model, base, self.adapters = unwrap(model)
        # A plain model wrapped for runtime adapters runs the engine's copy of its modules:
        # (each module of the caller's, its copy, its children then, its name).
        self.copied: list | None = None
        reason = unsupported_reason(base)
        if reason is not None:
            raise UnsupportedModelError(f"The engine cannot serve this model: {reason}.")
        register()  # the "paged" attention, even where generate's patches are disabled
        self.model.eval()
        self.watch, self.base = ModelWatch(self.model, base), base
        self.rope = TokenRope(base)  # rotary frequencies that follow a forward's length
        # (before compiling: a layer's class is part of what its graphs are keyed by)
        self.onednn_linear = flag("onednn_linear", onednn_linear)
        self.linears = (onednn_linears if onednn_linear and use_onednn_linears(self.model)
                        else contextlib.nullcontext)
        text_config = base.config.get_text_config(decoder=True)
        self.device, self.dtype = input_device(base), base.dtype  # the model's inputs' device
        self.rotary = switch_rotary(base, self.device)  # (Llama's rotary in one CPU pass)
        self.tp_size = getattr(base, "tp_size", None) or 1
        self.rank = torch.distributed.get_rank() if self.tp_size > 1 else 0
        spec = kv_spec(text_config)
        num_layers, head_dim, v_head_dim = spec.num_layers, spec.head_dim, spec.v_head_dim
        num_heads, kv_heads = tp_heads(text_config, attention_tp_size(base))  # this rank's
        # A model spread by device_map keeps each layer's KV on that layer's device; on one
        # device, sliding-window and full layers form KV groups sharing the pool's blocks.
        placement = model_placement(base, num_layers)
        reason = route_reason(base, placement, self.device)
        if reason is not None:
            raise UnsupportedModelError(f"The engine cannot serve this model: {reason}.")
        self.groups, placement = group_layers(spec.windows, placement)
        self.kv_device = placement.primary  # where block tables and metadata are built
        self._index_device = logits_index_device(base)  # for logits_to_keep
        self.on_cuda = any(d.type == "cuda" for d in placement.devices)
        self.block_size = positive("block_size", block_size)
        self.max_model_len = positive("max_model_len", max_model_len,
                                      getattr(text_config, "max_position_embeddings", 2048))
        default_seqs = 256 if self.on_cuda else 64
        if isinstance(max_num_batched_tokens, int) and max_num_batched_tokens > 0:
            default_seqs = min(default_seqs, max_num_batched_tokens)
        self.max_num_seqs = positive("max_num_seqs", max_num_seqs, default_seqs)
        self.kv_dtype = kv_dtype = quant.kv_cache_dtype(kv_cache_dtype)  # None: the model's
        per_layer = block_bytes(1, kv_heads, head_dim, self.block_size, self.dtype, v_head_dim,
                                kv_dtype)
        slots = self.groups.slots  # layers a block holds
        per_block = slots * per_layer
        if num_blocks is not None and self.groups.is_hybrid:  # counted in blocks of all layers
            num_blocks = self.groups.pool_blocks(positive("num_blocks", num_blocks))
        fraction("gpu_memory_utilization", gpu_memory_utilization)
        blocks = pool_blocks(num_blocks, kv_cache_bytes, gpu_memory_utilization, per_layer,
                             placement, self.max_num_seqs * self.groups.num_groups
                             * (cdiv(self.max_model_len, self.block_size) + 1))
        self.control = None
        if self.tp_size > 1:  # every rank must hold the same blocks: the smallest pool wins
            blocks = tp.agree_on_min(blocks, self.device)
            self.control = tp.control_group()
        graphs = wants_graphs(cuda_graphs, compile, placement.primary, blocks,
                              split=self.tp_size > 1 or not placement.is_single)
        # With graphs, one block of the budget is the spare one padded rows write.
        spare = 1 if graphs else 0
        self.pool = KVPool(slots, kv_heads, head_dim, self.block_size, blocks - spare,
                           self.dtype, placement, growable=False, v_head_dim=v_head_dim,
                           kv_dtype=kv_dtype, spare_blocks=spare)
        logger.info("hf-paged engine: KV pool of %d blocks x %d tokens (%s)", blocks,
                    self.block_size, ", ".join(
                        f"{blocks * per_layer * len(layers) / 2**20:.1f} MiB on {device}"
                        for device, layers in zip(placement.devices, placement.layers)))
        self.cpu_pool = None
        if preemption_mode == "swap":
            if swap_space_bytes is None:  # the pool's size, within a share of host memory
                physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
                ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
                swap_blocks = min(blocks, physical // 4 // ranks_here // per_block)
            else:
                swap_blocks = swap_space_bytes // per_block
            self.cpu_pool = KVPool(slots, kv_heads, head_dim, self.block_size,
                                   swap_blocks, self.dtype, placement.on("cpu"), growable=False,
                                   v_head_dim=v_head_dim, kv_dtype=kv_dtype)
            if torch.cuda.is_available() and self.on_cuda:
                self.cpu_pool.pin_memory()
        self.access = PoolAccess(self.pool, backend, num_heads, spec.windows, spec.latent,
                                 attention_features(base), self.groups)
        self.compile_option = compile
        self.compiled = self._compile(compile)  # None: eager forwards
        self.device_table = DeviceBlockTable(self.max_num_seqs,
                                             cdiv(self.max_model_len, self.block_size),
                                             self.kv_device, self.groups.num_groups,
                                             host_mirror=True)
        self.graphs = DecodeGraphs(self, pad_block=blocks - 1) if graphs else None

    def _compile(self, compile: bool | str):
        """The model under torch.compile (fullgraph, dynamic shapes), or None for eager.
        compile: True (Inductor) or the name of a torch.compile backend."""
        self.compile_error: str | None = None  # why a compiled forward ran eagerly
        if compile is False or compile is None:
            return None
        if not (compile is True or isinstance(compile, str)):
            raise ValueError(f"compile must be True, False or a torch.compile backend name; "
                             f"got {compile!r}.")
        if self.tp_size > 1 or not self.pool.placement.is_single:
            raise ValueError("compile=True runs a model on one device; this one is split "
                             "(tensor parallelism or device_map). Use compile=False.")
        backend = "inductor" if compile is True else compile
        variant = (self.pool.dtype, self.pool.kv_dtype, self.block_size,
                   self.linears is onednn_linears, *(b.name for b in self.access.backends))
        # A PEFT model's adapters are switched, disabled or merged in place while it
        # serves: its graphs keep the guards on the model.
        return compile_forward(self.model, backend, variant, model_guards=bool(self.adapters))

    # -- a step ------------------------------------------------------------------------------
    def check_model(self, admitting: bool) -> bool:
        """Raises ModelChangedError if the model was cast or moved since the pool was built,
        or put back in training mode with dropout to apply. Returns whether its weights or
        adapters changed since the last look (`ModelWatch.changed`), taken before a step
        that may admit a request (a prefix lookup), and before every step where a forward
        holds what it ran before: graphs are captured anew, and a compiled forward is
        looked up anew (keyed by the model's modules), after a change of its path."""
        self.watch.check()
        return (admitting or self.graphs is not None or self.compiled is not None) and \
            self.model_changed()

    @property
    def none_means_base(self) -> bool:
        """Whether requests with no adapter run the base model (the model is wrapped for
        runtime adapters), not the model as given."""
        return self.copied is not None

    def model_changed(self) -> bool:
        """Whether the model's weights or adapters changed since the last look; graphs and
        a compiled forward made for another path of its forward are dropped."""
        if self.copied is not None:
            follow(self.copied)
        changed, path = self.watch.changed(self.model)
        if path:  # (a rotary module put in place of another is switched too)
            self.rope.rotaries = use_token_rope(self.base)
        if path and self.graphs is not None:
            self.graphs.drop()
        if path and self.compiled is not None:
            self.compiled = self._compile(self.compile_option)
        return changed

    @property
    def vocab_size(self) -> int:
        """The model's logits per token, read each time: embeddings resized since count."""
        return self.base.get_output_embeddings().weight.shape[0]

    def attention_held(self):
        """A context whose steps find the model's attention switched already (a forward's
        own switch is then a lookup, not a change of the config): around a run of steps."""
        return paged_attention(self.base, self.watch.configs)

    def prepare(self, work: DeviceStep) -> None:
        """Block moves and block-table entries of a step, before its forwards."""
        if work.swap_out:
            gpu, cpu = zip(*work.swap_out)
            self.pool.copy_to(self.cpu_pool, list(gpu), list(cpu))
        if work.swap_in:
            cpu, gpu = zip(*work.swap_in)
            self.cpu_pool.copy_to(self.pool, list(cpu), list(gpu))
        if work.copies:
            self.access.copy_blocks(work.copies)
        self.device_table.apply(work.entries)

    def execute(self, work: DeviceStep) -> list[torch.Tensor]:
        """A whole step (what ranks above 0 run): block moves, table entries, forwards."""
        self.prepare(work)
        return [self.forward(f) for f in work.forwards]

    def metadata(self, rows: list[int], context: list[int], counts: list[int],
                 context_t: torch.Tensor | None = None) -> list[ForwardMetadata]:
        """Packed-forward metadata of sequence `rows` (their block-table rows), each with
        `context` tokens cached (context_t: the same on the device, if the caller has it)
        and `counts` new ones, decode rows apart from prompt chunks: one per KV group (each
        group's tables are rows g * max_num_seqs + row)."""
        device = self.kv_device
        # A compiled forward gets no host lengths: it would specialize on them.
        if counts.count(1) == len(counts):  # decodes: slots from the host mirror
            return decode_metadata(self.device_table, rows, context, context_t,
                                   self.block_size, host_lengths=self.compiled is None)
        index = to_device(rows, device)
        if context_t is None or context_t.device != device:
            context_t = to_device(context, device)
        lens = [c + n for c, n in zip(context, counts)]
        metas = []
        for g in range(self.groups.num_groups):
            table = self.device_table.group(g).index_select(0, index)
            metas.append(build_metadata(table, context_t, counts, max(counts), max(lens),
                                        self.block_size, packed=True,
                                        seq_lens_host=lens if self.compiled is None else None,
                                        split_decodes=True, uniform=self.compiled is not None))
        return metas

    def forward(self, f: Forward, check=None) -> torch.Tensor:
        """Runs one packed forward; returns the logits [S + P, V] of its rows that sample,
        then of its `prompt_rows`.
        check: called with the forward's metadata (one per KV group) before it runs (the
        isolation debug mode)."""
        metas = None
        if check is not None:  # (a graph builds its metadata inside: the same plan's)
            check(metas := self.metadata(f.rows, f.context, f.counts))
        logits = None if self.graphs is None else self.graphs.run(f)
        if logits is not None:  # a decode step, replayed from its graph
            return logits
        # ids and positions in one copy
        ids, positions = to_device(f.ids + f.positions, self.device).view(2, -1).unbind()
        # A token per row: the positions are the rows' cached lengths.
        metas = metas or self.metadata(f.rows, f.context, f.counts,
                                       positions if len(f.ids) == len(f.rows) else None)
        want = f.last + f.prompt_rows if f.prompt_rows else f.last
        if len(want) == len(f.ids) and not f.prompt_rows and self.compiled is None:
            keep = 0  # every token's logits, in order (`last` ascends): nothing to pick
        else:
            keep = to_device(want or [len(f.ids) - 1], self._index_device)
        try:
            with self.rope.around(f.rope_lengths, f.counts, positions):
                logits = self.run_model(f.fill_pending(ids), positions, metas, keep,
                                        forward_adapter(self, f.adapter))
        except COMPILE_ERRORS as err:  # (raised again if the forward ran eagerly)
            run_eagerly(self, err)  # nothing ran: the step runs anew, eagerly
            return self.forward(f, check)
        return logits[:len(want)]

    def run_model(self, ids: torch.Tensor, positions: torch.Tensor,
                  metas: list[ForwardMetadata], keep: torch.Tensor | int,
                  adapter: str | None = None) -> torch.Tensor:
        """The model over packed tokens: ids, positions [N] int64, `metas` (one per KV
        group), keep [S] int64 (the positions whose logits are wanted; 0: all) -> logits
        [S, V]."""
        # With no adapter loaded (none ever, or all unloaded) the base model runs, without
        # PEFT in the way.
        model = self.model if self.adapters else self.base
        extra = {}
        if self.adapters and adapter is not None:  # PEFT picks the adapter per batch row
            extra["adapter_names"] = [adapter]  # (with hooks Dynamo cannot trace: eager)
        elif self.compiled is not None:
            model = self.compiled
        paged_kv = self.access.forward(metas[0], group_metas=metas)
        with torch.inference_mode(), paged_attention(self.base, self.watch.configs), \
                self.linears(), self.rotary(), torch.autocast(self.device.type, enabled=False):
            try:  # (the model's dtype throughout: the caller's autocast is not the engine's)
                out = model(input_ids=ids[None], position_ids=positions[None],
                            past_key_values=paged_kv, use_cache=True, logits_to_keep=keep,
                            **{KWARG: paged_kv}, **extra)
            except BaseException:
                if extra:
                    drop_row_hooks(model)
                raise
        return out.logits[0]

    # -- tensor parallelism ------------------------------------------------------------------
    def broadcast(self, message) -> None:
        """Rank 0: sends a DeviceStep (or a control message) to the other ranks."""
        if self.tp_size > 1:
            tp.broadcast(message, self.control)

    def worker_loop(self) -> None:
        """Ranks above 0: run the steps rank 0 broadcasts until it stops them."""
        tp.worker_loop(self)
