"""The paged KV of one model forward, and what Transformers asks of a paged cache's layers.

`PagedForward` writes each layer's new keys and values through the forward's slot mapping
and attends over the pool, with the backends its `PoolAccess` (dispatch.py) chose. Its
metadata, built on the pool's first device, is copied to every other device once, never
per layer; a hybrid model's KV groups each have their own metadata.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from transformers.cache_utils import Cache

from ..errors import BackwardNotSupportedError, HFPagedError, PagedRouteError
from ..kv.metadata import ForwardMetadata
from . import reference
from .torch_backend import attention_mask, caller_mask_on_slots

# What a paged cache answers to `get_mask_sizes`: Transformers then asks the "paged" mask
# function for a mask of 0 keys, and that function returns None (the attention reads the
# lengths from the forward's metadata). No other cache has 0 keys to mask.
NO_MASK = (0, 0)


class _NoBackward(torch.autograd.Function):
    """Identity on a paged attention output that fails loudly in backward.

    The pool holds detached keys and values (and the GPU kernels have no backward), so
    gradients through a paged forward would silently miss the key/value paths.
    """

    @staticmethod
    def forward(ctx, out: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
        return out.clone()

    @staticmethod
    def backward(ctx, grad):
        raise BackwardNotSupportedError(
            "Gradients cannot flow through a forward on a PagedCache: it stores keys and values "
            "without autograd history. Run such forwards under torch.no_grad() / "
            "torch.inference_mode() (generate() does), or use a DynamicCache (or no cache) for "
            "forwards you differentiate."
        )


def cannot_apply(name: str, missing: str) -> str:
    return (f"cache_config['backend']={name!r} cannot run here: it does not implement "
            f"{missing}, which this model's attention uses; use 'auto' or 'torch'.")


class PagedLayers(ABC):
    """What Transformers asks of a cache's layers: each is a full or a sliding-window
    attention layer (`layer_windows`) of one pool, and none is compileable (block tables
    change shape)."""

    num_layers: int = 0
    layer_windows: tuple[int | None, ...] = ()

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_sliding(self) -> list[bool]:
        return [w is not None for w in self.layer_windows]

    @property
    def is_linear(self) -> list[bool]:
        return [False] * self.num_layers

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * self.num_layers

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return NO_MASK  # the "paged" attention needs no mask: the metadata has the lengths

    @abstractmethod
    def current_forward(self) -> "PagedForward":
        """The paged KV of the forward now running on this cache."""


class PagedForward(PagedLayers, Cache):
    """The paged KV of one model forward: writes go to the slots of its metadata, attention
    reads each row's own blocks. Passed explicitly: as the attention function's `paged_kv`
    keyword, and (in the engine) as the forward's `past_key_values`."""

    def __init__(self, access=None, meta: ForwardMetadata | None = None,
                 released_blocks: bool = False,
                 layer_windows: tuple[int | None, ...] = (),
                 group_metas: list[ForwardMetadata] | None = None):
        """Made with its metadata (the engine), or before it (generate: the cache binds it
        at the forward's first write, once the pool exists and the slots are taken)."""
        Cache.__init__(self, layers=[])
        self.layer_windows = tuple(layer_windows)
        self.num_layers = len(self.layer_windows)
        self.meta, self.hides_keys = None, False
        if access is not None:
            self.bind(access, meta, released_blocks, group_metas)

    def bind(self, access, meta: ForwardMetadata, released_blocks: bool,
             group_metas: list[ForwardMetadata] | None = None) -> None:
        """meta: the forward's metadata (group 0's); group_metas: every group's, when the
        layers form several groups (then on one device)."""
        pool = access.pool
        self.access, self.meta = access, meta
        self.layer_windows = access.windows
        self.num_layers = len(self.layer_windows)
        # Per layer, its group's metadata, when there are several groups.
        self._layer_metas = (None if group_metas is None or len(group_metas) == 1
                             else [group_metas[g] for g, _ in access.where])
        # Whether any layer has hidden slots (a query may then see no key): read per layer.
        self.hides_keys = any(m.key_hidden is not None for m in group_metas or [meta])
        self.released_blocks = released_blocks
        self._switch = access.switches()
        self._bare = not any(self._switch)  # no shard's device to make current
        self._shard = access.layer_shards  # per layer, the pool shard holding its slot
        if pool.placement.is_single:
            self._metas = [meta]
        else:
            self._metas = [meta.to(device) for device in pool.placement.devices]
        # Chosen once per forward for every layer (a caller's 4D mask is decided per call).
        self._backends = [access.backend_for(shard, m, False)
                          for shard, m in enumerate(self._metas)]

    def current_forward(self) -> "PagedForward":
        return self

    # -- Transformers' Cache interface (an engine forward's past_key_values) ------------------
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        return self.write(key_states, value_states, layer_idx)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions come with each forward; nothing is sliced by length

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    # -- per layer ----------------------------------------------------------------------------
    def meta_for(self, layer_idx: int) -> ForwardMetadata:
        """This forward's metadata for layer `layer_idx`: its group's, on its device."""
        if self._layer_metas is not None:
            return self._layer_metas[layer_idx]
        if len(self._metas) == 1:
            return self.meta
        return self._metas[self._shard[layer_idx]]

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int):
        """Stores one layer's new tokens through `meta.slot_mapping`; returns the layer's
        pool views.

        key_states, value_states: [R, Hkv, q, D] (padded layout; `meta.token_index` picks
        the stored columns) or [1, Hkv, N, D] for a packed forward
        -> (k_cache, v_cache) [NB, bs, Hkv, D]; a latent layout instead returns each row's
        stored tokens in full, [R, Hkv, T, D] and [R, Hkv, T, Dv] (slot t of row r holds its
        token t; T = meta.num_keys), which the layer expands before its attention.
        """
        if not 0 <= layer_idx < self.num_layers:
            layers = f"{self.num_layers} layer" + "s" * (self.num_layers != 1)
            raise HFPagedError(
                f"Layer {layer_idx} stores keys and values, but this paged KV holds {layers}: "
                "the cache was made for another model config (make it from this model's).")
        meta = self.meta_for(layer_idx)
        k_cache, v_cache = self.access.views(layer_idx)
        if meta.num_new:
            self._store(key_states, value_states, layer_idx, meta, k_cache, v_cache)
        if self.access.latent:
            if torch.compiler.is_compiling():  # (one op reading the shard after the write)
                return self.access.gather_traced(layer_idx, meta.block_tables)
            return (reference.gather_kv(k_cache, meta.block_tables),
                    reference.gather_kv(v_cache, meta.block_tables))
        return k_cache, v_cache

    def _store(self, key_states, value_states, layer_idx, meta, k_cache, v_cache) -> None:
        if key_states.device != k_cache.device:
            raise HFPagedError(
                f"Layer {layer_idx} computed its keys on {key_states.device}, but its KV pool "
                f"is on {k_cache.device}. The model moved after the cache was made (make a "
                "new one), or its layers are spread over devices and the cache was made "
                "without placement=hf_paged.model_placement(model)."
            )
        heads, dim, v_dim = k_cache.shape[2], reference.value_dim(k_cache), \
            reference.value_dim(v_cache)  # (an 8-bit view also holds its scales)
        if (key_states.shape[1] != heads or key_states.shape[-1] != dim
                or value_states.shape[1] != heads or value_states.shape[-1] != v_dim):
            check_new_states(key_states, value_states, layer_idx, heads, dim, v_dim)
        key = key_states.transpose(1, 2).reshape(-1, heads, dim)
        value = value_states.transpose(1, 2).reshape(-1, heads, v_dim)
        if meta.token_index is not None and not meta.packed:
            key = key.index_select(0, meta.token_index)
            value = value.index_select(0, meta.token_index)
        shard, dtype = self._shard[layer_idx], self.access.pool.dtype
        if key.dtype != dtype or value.dtype != dtype:  # (8-bit pools quantize from it)
            key, value = key.to(dtype), value.to(dtype)
        if torch.compiler.is_compiling():
            with torch.no_grad():
                self.access.write_traced(layer_idx, key, value, meta.slot_mapping)
            return
        write = self.access.backends[shard].write_kv
        if self._bare and not torch.is_grad_enabled():  # (inference: nothing to enter)
            write(k_cache, v_cache, key, value, meta.slot_mapping)
            return
        with torch.no_grad(), self.access.on_device(shard, self._switch):  # plain values
            write(k_cache, v_cache, key, value, meta.slot_mapping)

    def attend(self, query: torch.Tensor, layer_idx: int, scale: float,
               sliding_window: int | None = None,
               alibi_slopes: torch.Tensor | None = None,
               caller_mask: torch.Tensor | None = None,
               softcap: float | None = None, sinks: torch.Tensor | None = None,
               key: torch.Tensor | None = None, value: torch.Tensor | None = None,
               eager: bool = False) -> torch.Tensor:
        """Attention of this forward's queries over layer `layer_idx`.

        query [R, Hq, q, D] -> [R, q, Hq, Dv]; packed: [1, Hq, N, D] -> [1, N, Hq, Dv].
        alibi_slopes [Hq]: Falcon's ALiBi, `reference.alibi_bias(slope, key position, scale)`
        added to the scores.
        caller_mask: a 4D mask the caller passed to the model's forward, over columns
        ([R or 1, 1 or Hq, q, columns], bool or additive float); it replaces the causal and
        sliding-window masks, as in SDPA.
        softcap: tanh soft-capping of the scores; sinks [Hq]: per-head sink logits.
        key, value: a latent layout's expanded keys and values over each row's tokens
        ([R, Hq, T, D], [R, Hq, T, Dv], from the rows `write` returned); else unused (the
        layer's pool views are read through the metadata).
        sliding_window: the layer's, if it passes one; a sliding layer that does not (its
        model applies the window through the mask only: Qwen2-MoE, PhiMoE) gets its
        configured window, which the paged cache also releases blocks by.
        eager: the model's own attention is eager: a query that sees no key (hidden slots or
        a caller's mask hide them all) averages its row's keys as eager attention does
        (`reference.eager_fallback`); otherwise, and with sinks, it gives zeros.
        """
        eager = eager and sinks is None and (
            caller_mask is not None or self.meta_for(layer_idx).key_hidden is not None)
        if sliding_window is None:
            sliding_window = self.layer_windows[layer_idx]
        shard = self._shard[layer_idx]
        pool_dtype = self.access.pool.dtype
        with self.access.on_device(shard, self._switch):
            if self.access.latent:
                out = self._attend_expanded(query, key, value, layer_idx, scale,
                                            sliding_window, caller_mask, softcap, sinks, eager)
            else:
                k_view, v_view = self.access.views(layer_idx)
                # (A traced forward slices new views per call; eager ones show the route.)
                if not torch.compiler.is_compiling() and (
                        (key is not None and key is not k_view)
                        or (value is not None and value is not v_view)):
                    which = "keys" if key is not None and key is not k_view else "values"
                    raise PagedRouteError(
                        f"Layer {layer_idx} changed its {which} between the cache update and "
                        "the attention (repeated, split or re-laid them out), so the attention "
                        "cannot read them from the pool's blocks.")
                same = query.dtype == pool_dtype
                out = self._attend(query if same else query.to(pool_dtype),
                                   layer_idx, shard, scale, sliding_window, alibi_slopes,
                                   caller_mask, softcap,
                                   None if sinks is None else sinks.to(pool_dtype), eager)
            if out.dtype != query.dtype:
                out = out.to(query.dtype)
        if torch.is_grad_enabled() and query.requires_grad:
            out = _NoBackward.apply(out, query)
        return out

    def _attend_expanded(self, query, key, value, layer_idx, scale, sliding_window,
                         caller_mask, softcap, sinks, eager):
        """A latent layout's attention: the reference over the keys and values the layer
        expanded from its rows' stored tokens (slot t = token t of the row)."""
        meta = self.meta_for(layer_idx)
        if key is None or key.shape[0] != meta.block_tables.shape[0] or key.shape[2] != meta.num_keys:
            raise HFPagedError(
                f"Layer {layer_idx} stores a latent KV: its attention must get keys expanded "
                f"from the rows its cache update returned ([{meta.block_tables.shape[0]}, "
                f"heads, {meta.num_keys}, dim]); got "
                f"{None if key is None else tuple(key.shape)}.")
        if caller_mask is not None:
            mask = caller_mask_on_slots(meta, caller_mask)
        else:
            mask = attention_mask(meta, sliding_window)
        fallback = None
        if eager and mask.dtype == torch.bool:
            fallback = reference.eager_fallback(mask, meta.context_lens, meta.seq_lens,
                                                sliding_window)
        mask, uniform = fallback or (mask, None)
        padded = _spread_packed(query, meta) if meta.packed else query
        out = reference.attend(padded, key.to(padded.dtype), value.to(padded.dtype), mask,
                               scale, softcap, sinks, uniform)
        if meta.is_query is not None:
            out = out.masked_fill(~meta.is_query[:, :, None, None], 0.0)
        return _gather_packed(out, meta) if meta.packed else out

    def _attend(self, query, layer_idx, shard, scale, sliding_window, alibi_slopes,
                caller_mask, softcap=None, sinks=None, eager=False):
        meta = self.meta_for(layer_idx)
        k_cache, v_cache = self.access.views(layer_idx)
        if meta.max_seq_len == 0:  # every row is still all padding: no key to attend to
            return query.new_zeros(query.shape[0], query.shape[2], query.shape[1],
                                   reference.value_dim(v_cache))
        if caller_mask is not None:
            if alibi_slopes is not None:
                raise ValueError("A 4D attention mask cannot be combined with ALiBi here "
                                 "(Transformers' Falcon does not accept one either).")
            if self.released_blocks:
                raise HFPagedError(
                    "A 4D attention mask cannot be honoured after blocks left the sliding "
                    "window; call activate_past_recording() before the first forward."
                )
        backend = (self._backends[shard] if caller_mask is None
                   else self.access.backend_for(shard, meta, True))
        if softcap is not None or sinks is not None:
            backend = self.access.with_features(backend, shard, softcap is not None,
                                                sinks is not None)
        args = (scale, sliding_window, alibi_slopes)
        extra = {} if softcap is None and sinks is None else dict(softcap=softcap, sinks=sinks)
        if eager:  # (hidden slots or a caller's mask: the reference runs this forward)
            extra["eager_empty"] = True
        if not meta.packed:
            return backend.attention(query, k_cache, v_cache, meta, *args, caller_mask, **extra)
        if meta.parts is None:
            return _attend_packed(query, k_cache, v_cache, meta, backend, args, extra)
        out = query.new_empty(1, query.shape[2], query.shape[1], reference.value_dim(v_cache))
        for part, positions in meta.parts:
            piece = query.index_select(2, positions)
            out[:, positions] = _attend_packed(piece, k_cache, v_cache, part, backend, args,
                                               extra)
        return out


def check_new_states(key: torch.Tensor, value: torch.Tensor, layer_idx: int, heads: int,
                     dim: int, v_dim: int) -> None:
    """Raises HFPagedError unless layer `layer_idx` can store keys and values
    [R, heads, q, dim] and [R, heads, q, v_dim] (floating point, one device)."""
    if (key.dim() != 4 or value.dim() != 4 or key.shape[:3] != value.shape[:3]
            or key.shape[1] != heads or key.shape[3] != dim or value.shape[3] != v_dim):
        raise HFPagedError(
            f"Layer {layer_idx} stores keys {tuple(key.shape)} and values "
            f"{tuple(value.shape)} ([batch, heads, tokens, dim]), but its KV pool holds "
            f"{heads} heads of {dim} (keys) and {v_dim} (values) per token, for keys and "
            "values of the same batch and tokens: the cache was made for another model "
            "config, or the states were laid out otherwise.")
    if not (key.is_floating_point() and value.is_floating_point()) or key.device != value.device:
        raise HFPagedError(
            f"Layer {layer_idx} stores keys of {key.dtype} on {key.device} and values of "
            f"{value.dtype} on {value.device}: floating-point states on one device expected.")


def _spread_packed(query: torch.Tensor, meta: ForwardMetadata) -> torch.Tensor:
    """A packed query [1, Hq, N, D] (rows' tokens back to back) in the padded layout
    [R, Hq, q, D] of `meta` (right-aligned rows, zeros on padding)."""
    rows, q_cols = meta.query_pos.shape
    heads, dim = query.shape[1], query.shape[3]
    tokens = query.transpose(1, 2).reshape(-1, heads, dim)  # [N, Hq, D]
    if meta.token_index is not None:  # spread into the right-aligned [R * q] layout
        padded = tokens.new_zeros(rows * q_cols, heads, dim)
        tokens = padded.index_copy_(0, meta.token_index, tokens)
    return tokens.view(rows, q_cols, heads, dim).transpose(1, 2)


def _gather_packed(out: torch.Tensor, meta: ForwardMetadata) -> torch.Tensor:
    """[R, q, Hq, Dv] in the padded layout -> [1, N, Hq, Dv], the real tokens only."""
    rows, q_cols, heads, dim = out.shape
    out = out.reshape(rows * q_cols, heads, dim)
    if meta.token_index is not None:
        out = out.index_select(0, meta.token_index)
    return out.unsqueeze(0)


def _attend_packed(query, k_cache, v_cache, meta, backend, args, extra):
    """query [1, Hq, N, D], the rows' tokens back to back -> [1, N, Hq, Dv]."""
    if meta.token_index is None and meta.query_pos.shape[1] == 1:  # a token per row
        tokens = query[0].transpose(0, 1)  # [N, Hq, D]
        return backend.decode_packed(tokens, k_cache, v_cache, meta, *args, **extra)[None]
    out = backend.attention(_spread_packed(query, meta), k_cache, v_cache, meta, *args,
                            **extra)
    return _gather_packed(out, meta)
