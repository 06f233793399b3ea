"""`PagedCache`: a `transformers.Cache` whose keys and values live in a shared block pool."""

from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import Cache

from ..hf import attention
from ..core.block_table import BlockTables
from ..config import PagedCacheConfig
from ..errors import HFPagedError, KVCacheExhaustedError
from ..kv.pool import KVPool
from .plan import HiddenSlots, StepPlan, check_mask_shape, plan_from_mask, plan_unmasked
from ..kv.metadata import DeviceBlockTable, build_metadata, to_device
from ..kv.placement import Placement
from ..kernels.dispatch import PoolAccess
from ..hf.architectures import kv_layout, tp_heads
from .stats import MemoryStats, measure


_UNSET = object()  # no mask announced for the next forward


def inner_padding(mask: torch.Tensor) -> torch.Tensor:
    """0-d bool tensor: whether a 2D attention mask [R, L] has a zero after a real token."""
    mask = mask.bool()
    return (mask.cummax(1).values & ~mask).any()


def has_inner_padding(mask: torch.Tensor) -> bool:
    return bool(inner_padding(mask))


def _ceil_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class PagedCache(PoolAccess, Cache):
    """A `transformers.Cache` whose keys and values live in fixed-size blocks of a pool.

    `generate(..., cache_implementation="paged")` makes one for you (it is returned as
    `past_key_values` with `return_dict_in_generate=True`). Make one yourself to continue a
    returned cache, to run forwards of a model whose attention implementation is "paged",
    or to choose its settings::

        cache = PagedCache(model.config, {"block_size": 16, "num_blocks": 1024})
        out = model.generate(**inputs, past_key_values=cache, max_new_tokens=32)
        cache.memory_stats()  # tokens, blocks, sharing, bytes
        cache.reset()         # gives the blocks back; the pool stays allocated

    How it stores: each batch row has a block table; left padding is not stored, rows
    forked by beam search share blocks copy-on-write. Columns a mask hides after a row's
    first real token are stored as hidden slots (see `masking.py`). `update` returns the layer's pool views
    `[NB, bs, Hkv, D]`, which the "paged" attention reads through `self.meta`, the metadata
    built once per forward.

    Caches sharing one sized pool (concurrent generate calls) each own their blocks; a
    cache that is garbage-collected gives its blocks back to the pool.

    `get_seq_length` reports padded columns seen, as Transformers' caches do, so that
    generate slices its inputs the usual way.
    """

    def __init__(
        self,
        config,
        cache_config: PagedCacheConfig | dict | None = None,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        pool: KVPool | None = None,
        max_cache_len: int | None = None,
        tp_size: int = 1,
        placement: Placement | None = None,
    ):
        """config: the model's config. dtype, device: the pool's; when neither they nor a
        pool are given, the pool is made at the first forward with the keys' dtype and device.
        max_cache_len: the longest sequence the cache will hold, when known; an unsized pool
        then never uses blocks longer than that (rounded up to a power of two, at least 16).
        tp_size: the ranks a model loaded with Transformers' tensor parallelism splits its
        attention heads over (`hf_paged.models.attention_tp_size(model)`, usually
        `model.tp_size`); each rank's cache holds its own heads.
        placement: for a model spread over devices by `device_map`, where each layer's
        keys and values go (`hf_paged.model_placement(model)`; generate finds it itself):
        one pool shard per device. Default: every layer on the pool's device."""
        super().__init__(layers=[])
        text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        self.cache_config = PagedCacheConfig.from_any(cache_config)
        self.num_layers, _, self.head_dim = kv_layout(text_config)
        # Under tensor parallelism each rank holds (and caches) its own share of the heads.
        self.num_heads, self.num_kv_heads = tp_heads(text_config, tp_size)
        self.sliding_window = getattr(text_config, "sliding_window", None)
        self.block_size = self.cache_config.block_size
        if pool is None and not self.cache_config.is_sized and max_cache_len:
            self.block_size = min(self.block_size, max(_ceil_pow2(max_cache_len + 1), 16))
        self.max_cache_len = max_cache_len
        self.pool: KVPool | None = None
        self.placement = placement
        self.tables: BlockTables | None = None
        self.hidden = HiddenSlots()
        self.device_table: DeviceBlockTable | None = None
        self.meta = None
        self._seen = 0  # padded columns processed, what generate calls the sequence length
        self.peak_blocks = 0
        self._pending_mask: torch.Tensor | None | object = _UNSET  # None: told "no padding"
        self._pending_packed: tuple[list[int], int] | None = None
        # Width of the mask a running generate call started with, when its forwards get
        # generate's own masks: later columns are the ones generate appends (see
        # begin_generate).
        self._generate_columns: int | None = None
        self._views: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._views_version = -1
        # With a sliding window, blocks no query can see again are released, unless the
        # cache must be able to roll back (assisted decoding records past states).
        self._recording = False
        if pool is not None or dtype is not None or device is not None:
            self._bind_pool(pool, dtype or torch.float32, device or "cpu")

    def _bind_pool(self, pool: KVPool | None, dtype: torch.dtype, device) -> None:
        if pool is None:
            pool = KVPool.for_config(self.cache_config, self.num_layers, self.num_kv_heads,
                                     self.head_dim, dtype, self.placement or device,
                                     block_size=self.block_size)
        if pool.block_size != self.block_size:
            raise ValueError(
                f"PagedCache: pool block_size {pool.block_size} != cache_config block_size "
                f"{self.block_size}."
            )
        self._bind_backends(self.cache_config.backend, pool)
        self.pool = pool
        self.placement = pool.placement
        self.tables = BlockTables(pool.blocks)
        # Blocks go back to the (possibly shared) pool when this cache is collected.
        weakref.finalize(self, self.tables.release, later=True)

    def __getstate__(self):
        """Pickling (and deepcopy) carry the pool along; per-forward state is rebuilt."""
        state = self.__dict__.copy()
        state.update(backend=None, _backends=[], _references=[], _meta=None, _metas=[None],
                     _views=[], _views_version=-1)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        if self.pool is not None:
            self._bind_backends(self.cache_config.backend, self.pool)
            weakref.finalize(self, self.tables.release, later=True)

    # -- generate's view of the cache -----------------------------------------------------
    def __len__(self) -> int:
        return self.num_layers

    def __repr__(self) -> str:
        used = self.pool.blocks.num_used if self.pool is not None else 0
        return (f"PagedCache(rows={self.batch_size}, seen={self._seen}, "
                f"block_size={self.block_size}, blocks_in_use={used})")

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._seen

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        kv_length = self._seen + query_length
        attention.announce(self, kv_length)  # the mask function that follows is for this cache
        return kv_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self._seen

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def batch_size(self) -> int:
        return self.tables.num_rows if self.tables is not None else 0

    @property
    def is_initialized(self) -> bool:
        return self.device_table is not None

    @property
    def is_croppable(self) -> bool:
        return True

    def activate_past_recording(self):
        """Keeps every block from now on, so `crop` can roll back past the sliding window."""
        self._recording = True

    def is_recording_past(self, layer_idx: int = 0) -> bool:
        return self._recording

    # -- writing ------------------------------------------------------------------------------
    def begin_generate(self, attention_mask: torch.Tensor | None, trusted: bool) -> None:
        """A generate call starts on this cache with `attention_mask` [R, L] (or None).

        trusted: its forwards get generate's own masks (see `runs_plain_forward`). Then its
        single-token steps past column L cover only columns generate appended, always real,
        and do not read the mask (no host sync); otherwise every forward reads it.
        """
        self._generate_columns = (attention_mask.shape[-1]
                                  if trusted and attention_mask is not None else None)

    def end_generate(self) -> None:
        self._generate_columns = None

    def expect_forward(self, attention_mask: torch.Tensor | None) -> None:
        """Tells the next forward which of its columns are real tokens, whatever mask the
        forward itself gets.

        attention_mask: [R, seen + q] 2D mask (1 = real token) or None for no padding.
        """
        self._pending_mask = attention_mask

    def adopt_mask(self, attention_mask: torch.Tensor | None) -> None:
        """The 2D padding mask a forward got (None: none), as the "paged" mask function sees
        it, unless the forward was described already."""
        if self._pending_mask is _UNSET and self._pending_packed is None:
            self._pending_mask = attention_mask

    def expect_packed(self, counts: list[int], width: int) -> None:
        """Announces a packed forward: one input row holding `counts[r]` real tokens of each
        sequence back to back, standing for a left-padded batch `width` columns wide."""
        self._pending_packed = (list(counts), width)

    def load_prefix(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Stores leading tokens given directly as keys and values, before any forward:
        PEFT prefix tuning's virtual tokens. Rows with the same prefix share its blocks.

        keys, values: one [R, Hkv, V, D] tensor per layer. Raises ValueError if the shapes do
        not match this cache's layers, KV heads and head dim.
        """
        rows, heads, length, dim = keys[0].shape
        if self._seen or len(keys) != self.num_layers or len(values) != self.num_layers or any(
                t.shape != (rows, self.num_kv_heads, length, self.head_dim) for t in keys + values):
            raise ValueError(
                f"a prefix needs {self.num_layers} layers of [rows, {self.num_kv_heads} KV heads, "
                f"tokens, {self.head_dim}] on an empty cache; got {len(keys)} layers of "
                f"{tuple(keys[0].shape)} after {self._seen} columns"
            )
        if self.pool is None:
            self._bind_pool(None, keys[0].dtype, keys[0].device)
        shared = all(torch.equal(t, t[:1].expand_as(t)) for t in keys + values)
        stored = 1 if shared else rows
        # One packed forward of the prefix tokens: [1, Hkv, stored * V, D], rows back to back.
        self.expect_packed([length] * stored + [0] * (rows - stored), length)
        for layer, (k, v) in enumerate(zip(keys, values)):
            device = self.pool.layer_kv(layer).device  # a layer's own device under device_map
            packed = [t[:stored].transpose(0, 1).reshape(1, heads, stored * length, dim)
                      .to(device) for t in (k, v)]
            self.update(packed[0], packed[1], layer)
        if shared and rows > 1:
            self.reorder_cache(torch.zeros(rows, dtype=torch.long))  # every row shares row 0's

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Stores the new tokens of one layer; returns that layer's pool views.

        key_states, value_states: [R, Hkv, q, D] -> (k_cache, v_cache) [NB, bs, Hkv, D]
        (a packed forward passes [1, Hkv, N, D], N real tokens of all rows).
        """
        if layer_idx == 0:
            if attention.claim() is not None:
                raise HFPagedError(
                    "A PagedCache was passed to a model whose attention implementation is not "
                    "'paged' (its mask was built for another one). Load the model with "
                    "attn_implementation='paged' (or call model.set_attn_implementation('paged')), "
                    "or use generate(..., cache_implementation='paged'), which switches it."
                )
            if self.pool is None:
                self._bind_pool(None, key_states.dtype, key_states.device)
            self._begin_forward(key_states.shape[0], key_states.shape[2])
        if self.meta is None:
            raise HFPagedError("PagedCache.update: layer 0 must be updated first in each forward.")
        return self.write(key_states, value_states, layer_idx)

    def _plan_step(self, rows: int, q_len: int) -> StepPlan:
        """What this forward adds, from the announced mask or packing; changes no state."""
        lengths = self.tables.lengths if self.device_table is not None else [0] * rows
        packed = self._pending_packed
        if packed is not None:
            counts, width = packed
            if sum(counts) != q_len or rows != 1 or self._seen:
                raise ValueError(
                    f"PagedCache: a packed forward of {sum(counts)} tokens was announced for an "
                    f"empty cache, but the model ran on input of shape [{rows}, {q_len}] after "
                    f"{self._seen} cached columns."
                )
            return StepPlan(list(counts), width, packed=True)
        if self._pending_mask is _UNSET:
            # No mask function ran: the caller passed a prepared 4D mask (honoured by the
            # attention), or drives the cache by hand. Every new column is stored.
            return StepPlan([q_len] * rows, q_len)
        mask = self._pending_mask
        if mask is None:
            return plan_unmasked(lengths, self._seen, q_len, self.hidden)
        check_mask_shape(mask, rows, self._seen, q_len)
        if (q_len == 1 and self._generate_columns is not None
                and self._seen >= self._generate_columns):
            return StepPlan([1] * rows, 1)  # a column generate appended: real in every row
        return plan_from_mask(mask, lengths, self._seen, self.hidden)

    def _begin_forward(self, rows: int, q_len: int) -> None:
        """Allocates this forward's slots and builds the metadata all layers share."""
        if self.device_table is not None and rows != self.tables.num_rows and \
                self._pending_packed is None:
            self._pending_mask, self._pending_packed = _UNSET, None
            raise ValueError(
                f"PagedCache holds {self.tables.num_rows} sequence(s) but the forward has {rows} "
                "rows; call reset() before reusing the cache for another batch."
            )
        try:
            step = self._plan_step(rows, q_len)
        except (ValueError, HFPagedError):
            self._pending_mask, self._pending_packed = _UNSET, None  # not for a later forward
            raise
        counts = step.counts
        rows = len(counts)
        if self.device_table is None:
            self.tables.resize(rows)
            self.hidden.resize(rows)
            cols = -(-(self.max_cache_len or 1) // self.block_size) + 1
            self.device_table = DeviceBlockTable(rows, cols, self.pool.device)
        if self.sliding_window is not None and not self._recording:
            # The next query sits at slot n and sees slots > n - window.
            self.tables.release_before(
                [n - self.sliding_window + 1 for n in self.tables.lengths])
        needed = self.tables.blocks_needed(counts)
        try:
            self.pool.ensure_free(needed, limit=self._block_limit(rows),
                                  held=self.tables.num_held)
            plan = self.tables.append(counts, needed)
        except KVCacheExhaustedError as err:  # nothing was taken: the step can be retried
            raise KVCacheExhaustedError(err.needed, err.free, err.num_blocks, err.block_size,
                                        held=self.tables.num_held) from None
        # Committed from here on.
        self._pending_mask, self._pending_packed = _UNSET, None
        self.hidden.apply(step)
        context = self.device_table.lengths
        if plan.copies:
            self.copy_blocks(plan.copies)
        self.device_table.apply(plan.entries)
        self._seen += step.width
        max_len = max(self.tables.lengths)
        num_cols = max(-(-max_len // self.block_size), 1)
        self.meta = build_metadata(
            self.device_table, context, counts, max(counts) if step.packed else q_len, max_len,
            self.block_size, packed=step.packed,
            key_hidden=self.hidden.slot_mask(num_cols * self.block_size, self.pool.device),
            columns=self._seen, seq_lens_host=list(self.tables.lengths))
        self.device_table.lengths = self.meta.seq_lens
        self.peak_blocks = max(self.peak_blocks, self.tables.num_held)
        if self._views_version != self.pool.version:
            self._refresh_views()

    def _block_limit(self, rows: int) -> int | None:
        """Most blocks this cache can need: caps an unsized pool's growth headroom."""
        if self.max_cache_len is None:
            return None
        return rows * -(-(self.max_cache_len + 1) // self.block_size)

    def _released_blocks(self) -> bool:
        return any(self.tables.freed)

    # -- structure changes from generate -----------------------------------------------------------
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row i continues old row beam_idx[i]: tables are shared, nothing is copied."""
        if self.device_table is None:
            return
        src_rows = beam_idx.tolist()
        self.tables.fork_rows(src_rows)
        self.hidden.fork(src_rows)
        self.device_table.fork(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.reorder_cache(torch.as_tensor(indices, dtype=torch.long))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.device_table is None:
            return
        rows = torch.arange(self.tables.num_rows).repeat_interleave(repeats)
        self.reorder_cache(rows)

    def crop(self, tokens_to_remove: int) -> None:
        """Drops the last `-tokens_to_remove` columns (a positive value is the length to keep)."""
        keep = self._seen + tokens_to_remove if tokens_to_remove <= 0 else tokens_to_remove
        if keep >= self._seen:
            return
        keep = max(keep, 0)  # as DynamicCache: removing more than is cached empties it
        removed = self._seen - keep
        if self.device_table is not None:
            lengths = [max(n - removed, 0) for n in self.tables.lengths]
            if self.sliding_window is not None and any(
                    f and n - self.sliding_window + 1 < f * self.block_size
                    for n, f in zip(lengths, self.tables.freed)):
                raise HFPagedError(
                    f"crop({tokens_to_remove}) would need tokens this cache already released "
                    "outside the sliding window; call activate_past_recording() before "
                    "generating if you will crop."
                )
            self.tables.truncate(lengths)
            self.hidden.truncate(lengths)
            self.device_table.lengths = to_device(lengths, self.device_table.device)
        self._seen = keep

    def reset(self) -> None:
        """Frees this cache's blocks; the pool stays allocated for reuse."""
        if self.tables is not None:
            self.tables.release()
        self.hidden.resize(0)
        self.device_table = None
        self.meta = None
        self._seen = 0
        self._pending_mask, self._pending_packed = _UNSET, None
        self._generate_columns = None
        self.peak_blocks = 0

    # -- accounting -----------------------------------------------------------------------------------
    def memory_stats(self) -> MemoryStats:
        """KV memory now: tokens, blocks, sharing and bytes (see `MemoryStats`)."""
        return measure(self)
