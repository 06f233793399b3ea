"""`PagedCache`: a `transformers.Cache` whose keys and values live in a shared block pool."""

from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import Cache

from ..core.kv_groups import GroupedTables, KVGroups
from ..config import PagedCacheConfig
from ..errors import HFPagedError, KVCacheExhaustedError
from ..kv.pool import KVPool
from ..hf.architectures import kv_spec, tp_heads
from ..kernels.dispatch import PoolAccess
from ..kernels.forward import PagedForward, PagedLayers, check_new_states
from ..kv.metadata import DeviceBlockTable, build_metadata, to_device
from ..kv.placement import Placement, group_layers, groups_for_pool
from ..utils import cdiv
from .plan import HiddenSlots, StepPlan, plan_forward
from .prefix import load_prefix
from .stats import MemoryStats, measure


_NOT_GIVEN = ...  # expect_forward was not called for the next forward (copies keep Ellipsis)


def _ceil_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class PagedCache(PagedLayers, Cache):
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
    first real token are stored as hidden slots (see `plan.py`).

    Each forward: the patched base model forward (generate/patches.py) calls
    `begin_forward` with the forward's own mask (or a packed plan), which allocates the
    forward's slots and builds its metadata once; `update` writes each layer's new tokens
    through it and returns the layer's pool views `[NB, bs, Hkv, D]`; the attention gets
    the same `PagedForward` as its `paged_kv` keyword; `end_forward` closes it. A cache
    driven by hand (`update` called without a forward) stores every new column.

    Caches sharing one sized pool (concurrent generate calls) each own their blocks; a
    cache that is garbage-collected gives its blocks back to the pool.

    `get_seq_length` reports padded columns seen, as Transformers' caches do, so that
    generate slices its inputs the usual way.
    """

    def __init__(self, config, cache_config: PagedCacheConfig | dict | None = None, *,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 pool: KVPool | None = None, max_cache_len: int | None = None,
                 tp_size: int = 1, placement: Placement | None = None,
                 features: frozenset = frozenset()):
        """config: the model's config. dtype, device: the pool's; when neither they nor a
        pool are given, the pool is made at the first forward with the keys' dtype and device.
        max_cache_len: the longest sequence the cache will hold, when known; an unsized pool
        then never uses blocks longer than that (rounded up to a power of two, at least 16).
        tp_size: the ranks a model loaded with Transformers' tensor parallelism splits its
        attention heads over (`hf_paged.models.attention_tp_size(model)`, usually
        `model.tp_size`); each rank's cache holds its own heads.
        placement: for a model spread over devices by `device_map`, where each layer's
        keys and values go (`hf_paged.model_placement(model)`; generate finds it itself):
        one pool shard per device. Default: every layer on the pool's device.
        features: what the model's attention layers pass beyond q, k, v
        (`hf_paged.hf.architectures.attention_features(model)`), so that a backend named
        in cache_config that cannot apply them is refused before anything is stored."""
        super().__init__(layers=[])
        text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        self.cache_config = PagedCacheConfig.from_any(cache_config)
        self.spec = kv_spec(text_config)
        self.num_layers, self.head_dim = self.spec.num_layers, self.spec.head_dim
        self.layer_windows = self.spec.windows
        self.features = frozenset(features)
        # Under tensor parallelism each rank holds (and caches) its own share of the heads.
        self.num_heads, self.num_kv_heads = tp_heads(text_config, tp_size)
        self.block_size = self.cache_config.block_size
        if pool is None and not self.cache_config.is_sized and max_cache_len:
            self.block_size = min(self.block_size, max(_ceil_pow2(max_cache_len + 1), 16))
        self.max_cache_len = max_cache_len
        self.pool: KVPool | None = None
        self.placement = placement
        self.groups: KVGroups | None = None  # how the layers share blocks (with the pool)
        self.tables: GroupedTables | None = None
        self.hidden = HiddenSlots()
        self.device_table: DeviceBlockTable | None = None
        self.access: PoolAccess | None = None
        self._forward: PagedForward | None = None  # of the forward now running
        self._step: StepPlan | None = None  # what it adds (planned by begin_forward)
        self._in_forward = False  # between begin_forward and end_forward
        self._seen = 0  # padded columns processed, what generate calls the sequence length
        self.peak_blocks = 0
        # The 2D mask a caller gave `expect_forward` for the next forward (the one hand-off
        # this cache takes: see there); None: "no padding"; _NOT_GIVEN: nothing was given.
        self._expected_mask: torch.Tensor | None | object = _NOT_GIVEN
        # Width of the mask a running generate call started with, when its forwards get
        # generate's own masks: later columns are the ones generate appends (see
        # begin_generate).
        self._generate_columns: int | None = None
        # With a sliding window, blocks no query can see again are released, unless the
        # cache must be able to roll back (assisted decoding records past states).
        self._recording = False
        if pool is not None or dtype is not None or device is not None:
            self._bind_pool(pool, dtype or torch.float32, device or "cpu")

    def _bind_pool(self, pool: KVPool | None, dtype: torch.dtype, device) -> None:
        if pool is None:
            self.groups, where = group_layers(self.spec.windows, self.placement, device)
            pool = KVPool.for_config(self.cache_config, self.groups.slots, self.num_kv_heads,
                                     self.head_dim, dtype, where,
                                     block_size=self.block_size,
                                     v_head_dim=self.spec.v_head_dim,
                                     model_layers=self.num_layers)
        else:
            self.groups = groups_for_pool(self.spec.windows, pool)
        if pool.block_size != self.block_size:
            raise ValueError(
                f"PagedCache: pool block_size {pool.block_size} != cache_config block_size "
                f"{self.block_size}."
            )
        self.access = self._access(pool)
        self.pool = pool
        if not self.groups.is_hybrid:
            self.placement = pool.placement
        self.tables = GroupedTables(pool.blocks, self.groups)
        # Blocks go back to the (possibly shared) pool when this cache is collected.
        weakref.finalize(self, self.tables.release, later=True)

    def __getstate__(self):
        """Pickling (and deepcopy) carry the pool along; per-forward state is rebuilt."""
        state = self.__dict__.copy()
        state.update(access=None, _forward=None, _step=None, _in_forward=False)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        if self.pool is not None:
            self.access = self._access(self.pool)
            weakref.finalize(self, self.tables.release, later=True)

    def _access(self, pool: KVPool) -> PoolAccess:
        return PoolAccess(pool, self.cache_config.backend, self.num_heads, self.layer_windows,
                          self.spec.latent, self.features, self.groups)

    @property
    def backend(self):
        """The attention backend of the pool's first shard (None before the pool exists)."""
        return None if self.access is None else self.access.backend

    @property
    def workspace_bytes(self) -> int:
        return 0 if self.access is None else self.access.workspace_bytes


    # -- generate's view of the cache -----------------------------------------------------
    def __len__(self) -> int:
        return self.num_layers

    def __repr__(self) -> str:
        used = self.pool.blocks.num_used if self.pool is not None else 0
        return (f"PagedCache(rows={self.batch_size}, seen={self._seen}, "
                f"block_size={self.block_size}, blocks_in_use={used})")

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._seen

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
        forward itself gets (for callers who pass a prepared 4D mask, which says nothing
        about padding). The one hand-off this cache takes: the next forward that runs uses it
        up (one that fails for lack of blocks keeps it for its retry), and one whose shape
        does not match it raises.

        attention_mask: [R, seen + q] 2D mask (1 = real token), or None: no padding.
        """
        self._expected_mask = attention_mask

    def load_prefix(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Stores leading tokens given directly as keys and values (PEFT prefix tuning's
        virtual tokens); see `generate/prefix.py`."""
        load_prefix(self, keys, values)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Stores the new tokens of one layer; returns that layer's pool views.

        key_states, value_states: [R, Hkv, q, D] -> (k_cache, v_cache) [NB, bs, Hkv, D]
        (a packed forward passes [1, Hkv, N, D], N real tokens of all rows).
        """
        if not self._in_forward:  # driven by hand: refused before anything changes
            self._check_by_hand(key_states, value_states, layer_idx)
        if layer_idx == 0 and not self._in_forward:
            # Each layer-0 update starts a forward that stores every new column, unless
            # expect_forward said otherwise.
            self._step = self._checked_plan(key_states.shape[0], key_states.shape[2],
                                            None, None, by_hand=True)
            self._forward = self._new_forward()
        if self._forward is not None and self._forward.meta is None and (
                self._in_forward or layer_idx == 0):
            # The forward's first layer (layer 0, or the first left after layers were
            # removed from the model) takes its slots for every layer.
            if self.pool is None:
                self._bind_pool(None, key_states.dtype, key_states.device)
            self._prepare(self._step, self._forward)
        elif self._forward is None or self._forward.meta is None:
            raise HFPagedError("PagedCache.update: layer 0 must be updated first in each forward "
                               "driven by hand (outside a model forward).")
        return self._forward.write(key_states, value_states, layer_idx)

    def _check_by_hand(self, key_states, value_states, layer_idx: int) -> None:
        if not (hasattr(layer_idx, "__index__") and 0 <= layer_idx < self.num_layers):
            raise HFPagedError(f"PagedCache.update: layer_idx={layer_idx!r} is not a layer of "
                               f"the model's {self.num_layers} (0 to {self.num_layers - 1}).")
        check_new_states(key_states, value_states, layer_idx, self.num_kv_heads, self.head_dim,
                         self.spec.v_head_dim)

    def current_forward(self) -> PagedForward:
        if self._forward is None:
            raise HFPagedError(
                "The paged attention ran without a forward prepared on its PagedCache: this "
                "model's forward is not one hf-paged has wrapped (generate() wraps it; for "
                "direct forwards call hf_paged.prepare_model(model) first)."
            )
        return self._forward

    def begin_forward(self, rows: int, q_len: int, attention_mask: torch.Tensor | None = None,
                      plan: StepPlan | None = None) -> PagedForward:
        """Starts a forward of input [rows, q_len]: plans what it adds (changing nothing yet)
        and returns its `PagedForward`, which the forward's first write (layer 0's
        `update`) binds to this forward's slots and metadata, built once for all layers.
        A `KVCacheExhaustedError` there leaves the cache as it was (the forward can be
        retried once blocks are free).

        attention_mask: the forward's own mask: [R, seen + q] 2D (1 = real token), None (no
        padding), or a caller's 4D mask (every new column is stored; the attention honours
        the mask). A mask given to `expect_forward` takes its place.
        plan: a packed forward's `StepPlan` (one input row holding the real tokens of every
        row back to back: generate's packed prefill, PEFT's virtual tokens).
        """
        self._step = self._checked_plan(rows, q_len, attention_mask, plan)
        self._forward, self._in_forward = self._new_forward(), True
        return self._forward

    @property
    def in_forward(self) -> bool:
        """Whether a forward begun by `begin_forward` is running."""
        return self._in_forward

    @property
    def meta(self):
        """The metadata of the running forward (None between forwards, or before layer 0)."""
        return None if self._forward is None else self._forward.meta

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        if not self._in_forward:  # Transformers builds masks at the start of a model forward
            raise HFPagedError(
                "A model forward reached this PagedCache without hf-paged preparing it: its "
                "forward is not one hf-paged has wrapped (call hf_paged.prepare_model(model) "
                "before running forwards on a PagedCache yourself; generate() does it), "
                "hf_paged.disable() was called, or a module below the model was called."
            )
        return super().get_mask_sizes(query_length, layer_idx)

    def _checked_plan(self, rows, q_len, mask, packed, by_hand=False) -> StepPlan:
        try:
            expected = None if self._expected_mask is _NOT_GIVEN else (self._expected_mask,)
            started = self.device_table is not None
            return plan_forward(
                rows, q_len, mask, packed, seen=self._seen, hidden=self.hidden,
                lengths=self.tables.lengths if started else None, expected=expected,
                by_hand=by_hand, generate_columns=self._generate_columns)
        except (ValueError, HFPagedError):
            self._expected_mask = _NOT_GIVEN  # not for a later forward
            raise

    def end_forward(self) -> None:
        """Closes the running forward (its metadata is not reused)."""
        self._forward, self._step, self._in_forward = None, None, False

    def _new_forward(self) -> PagedForward:
        return PagedForward(layer_windows=self.layer_windows)

    def _prepare(self, step: StepPlan, forward: PagedForward) -> None:
        """Allocates the slots of `step`, builds its metadata and binds `forward` to them
        (all or nothing: the commit point of a forward)."""
        counts = step.counts
        rows = len(counts)
        if first := self.device_table is None:
            self.tables.resize(rows)
            self.hidden.resize(rows)
            cols = cdiv(self.max_cache_len or 1, self.block_size) + 1
            self.device_table = DeviceBlockTable(rows, cols, self.pool.device,
                                                 self.groups.num_groups)
        if not self._recording:
            self.tables.release_outside_window()
        needed = self.tables.blocks_needed(counts)
        try:
            self.pool.ensure_free(needed, limit=self._block_limit(rows),
                                  held=self.tables.num_held)
            plan = self.tables.append(counts, needed)
        except KVCacheExhaustedError as err:  # nothing was taken: the step can be retried
            if first:  # (with any batch: the cache stays uninitialized)
                self.tables.resize(0)
                self.hidden.resize(0)
                self.device_table = None
            raise self.groups.in_model_blocks(err, self.tables.num_held) from None
        # Committed from here on.
        self._expected_mask = _NOT_GIVEN
        self.hidden.apply(step)
        context = self.device_table.lengths
        if plan.copies:
            self.access.copy_blocks(plan.copies)
        self.device_table.apply(plan.entries)
        self._seen += step.width
        max_len = max(self.tables.lengths)
        num_cols = max(cdiv(max_len, self.block_size), 1)
        key_hidden = self.hidden.slot_mask(num_cols * self.block_size, self.pool.device)
        q_len = max(counts) if step.packed else step.width
        lengths = list(self.tables.lengths)
        metas = [build_metadata(
            self.device_table.group(g), context, counts, q_len, max_len, self.block_size,
            packed=step.packed, key_hidden=key_hidden, columns=self._seen,
            seq_lens_host=lengths) for g in range(self.groups.num_groups)]
        self.device_table.lengths = metas[0].seq_lens
        self.peak_blocks = max(self.peak_blocks, self.tables.num_held)
        forward.bind(self.access, metas[0], released_blocks=self.tables.released_any(),
                     group_metas=metas)

    def _block_limit(self, rows: int) -> int | None:
        """Most blocks this cache can need: caps an unsized pool's growth headroom."""
        if self.max_cache_len is None:
            return None
        return rows * cdiv(self.max_cache_len + 1, self.block_size)

    # -- structure changes from generate -----------------------------------------------------------
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row i continues old row beam_idx[i]: tables are shared, nothing is copied."""
        if self.device_table is None:
            return
        src_rows = beam_idx.tolist()
        self.tables.fork_rows(src_rows)
        self.hidden.fork(src_rows)
        self.device_table.fork(beam_idx)

    def batch_select_indices(self, indices) -> None:  # (positions, or a mask over the rows)
        indices = torch.as_tensor(indices)
        if indices.dtype == torch.bool:
            indices = indices.nonzero().flatten()
        self.reorder_cache(indices.long())

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
            if self.tables.cannot_keep(lengths):
                raise HFPagedError(
                    f"crop({tokens_to_remove}) would need tokens this cache already released "
                    "outside the sliding window; call activate_past_recording() before "
                    "generating if you will crop."
                )
            self.tables.truncate(lengths)
            self.hidden.truncate(lengths)
            self.device_table.lengths = to_device(lengths, self.device_table.device)
        self._seen = keep

    def recompute(self) -> None:
        """Empties the cache for a forward that computes every row anew (Phi-3's generate
        at its LongRoPE switch), the peak so far kept."""
        peak = self.peak_blocks
        self.reset()
        self.peak_blocks = peak

    def reset(self) -> None:
        """Frees this cache's blocks; the pool stays allocated for reuse."""
        if self.tables is not None:
            self.tables.release()
        self.hidden.resize(0)
        self.device_table = None
        self.end_forward()
        self._seen = 0
        self._expected_mask = _NOT_GIVEN
        self._generate_columns = None
        self.peak_blocks = 0

    # -- accounting -----------------------------------------------------------------------------------
    def memory_stats(self) -> MemoryStats:
        """KV memory now: tokens, blocks, sharing and bytes (see `MemoryStats`)."""
        return measure(self)
