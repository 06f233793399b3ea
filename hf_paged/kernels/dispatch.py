"""Writing a forward's keys and values into a `KVPool` and attending over them.

Both the generate-side `PagedCache` and the engine's per-step cache read and write the pool
the same way, through the `ForwardMetadata` of the forward: this mixin holds that code. A
subclass sets `pool`, `num_heads`, `num_layers`, `num_kv_heads`, `head_dim` and
`sliding_window`, calls `_bind_backends` once it has a pool, sets `meta` for each forward,
and refreshes its layer views with `_refresh_views()` whenever `pool.version` changes.

A pool split over devices (`device_map`) has one shard per device: each shard gets its own
backend, and the forward's metadata, built on the first device, is copied to every other
device once when it is set, never per layer.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

from ..errors import BackwardNotSupportedError, HFPagedError
from .backends import TorchBackend, select_backend
from ..kv.metadata import ForwardMetadata, to_device


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


class PoolAccess:
    """Per-layer pool views, the write of new tokens, and attention over the pool."""

    pool = None
    backend = None  # the first shard's backend
    _backends: list = []  # one per pool shard
    _references: list = []  # reference backends per shard, for forwards kernels do not cover
    _meta: ForwardMetadata | None = None
    _metas: list = [None]  # the forward's metadata on each shard's device
    _switch: list = [False]  # per shard: its CUDA device is not the current one

    @property
    def meta(self) -> ForwardMetadata | None:
        """The metadata of the running forward (on the pool's first device)."""
        return self._meta

    @meta.setter
    def meta(self, meta: ForwardMetadata | None) -> None:
        self._meta = meta
        if meta is None or self.pool is None:
            self._metas = [meta]
            return
        self._check_current_device()
        if self.pool.placement.is_single:
            self._metas = [meta]
        else:
            self._metas = [meta.to(device) for device in self.pool.placement.devices]

    def meta_for(self, layer_idx: int) -> ForwardMetadata | None:
        """The running forward's metadata on the device of layer `layer_idx`."""
        if len(self._metas) == 1:
            return self._meta
        return self._metas[self.pool.placement.where[layer_idx][0]]

    def _bind_backends(self, name: str, pool) -> None:
        """One attention backend per shard of `pool`: kernels and buffers live on its device.
        Raises ValueError (nothing changed) when the named backend cannot run there; in a
        pool over several devices, a CPU shard a GPU backend cannot serve gets the reference."""
        devices = pool.placement.devices

        def select(device):
            try:
                return select_backend(name, device, pool.dtype, pool.block_size,
                                      self.num_heads, self.num_kv_heads)
            except ValueError:
                if device.type == "cuda" or all(d.type != "cuda" for d in devices):
                    raise
                return TorchBackend()  # layers run on a CPU next to GPUs: the reference

        self._backends = [select(device) for device in devices]
        self.backend = self._backends[0]
        self._references = [None] * len(self._backends)
        self._switch = [False] * len(self._backends)

    def _check_current_device(self) -> None:
        """Notes which shards sit on a CUDA device other than the current one (once per
        forward): Triton launches on the current device, and accelerate does not switch it
        for the layers it places elsewhere."""
        devices = self.pool.placement.devices
        if all(d.type != "cuda" for d in devices):
            self._switch = [False] * len(devices)
            return
        current = torch.cuda.current_device()
        self._switch = [d.type == "cuda" and d.index != current for d in devices]

    def _on_device(self, shard: int):
        """Makes a shard's CUDA device current while its kernels launch, where needed."""
        if self._switch[shard]:
            return torch.cuda.device(self.pool.placement.devices[shard])
        return contextlib.nullcontext()

    def copy_blocks(self, pairs) -> None:
        """Copies blocks (src, dst) in every shard (copy-on-write)."""
        self._check_current_device()
        for shard, (kv, backend) in enumerate(zip(self.pool.shards, self._backends)):
            src, dst = to_device(pairs, kv.device).T
            with self._on_device(shard):
                backend.copy_blocks(kv, src, dst)

    # What Transformers asks of a cache's layers: all are full or sliding attention layers
    # of one pool, and none is compileable (block tables change shape).
    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_sliding(self) -> list[bool]:
        return [self.sliding_window is not None] * self.num_layers

    @property
    def is_linear(self) -> list[bool]:
        return [False] * self.num_layers

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * self.num_layers

    def _refresh_views(self) -> None:
        owner = weakref.ref(self)
        self._views = []
        for layer in range(self.num_layers):
            k, v = self.pool.layer_kv(layer)
            k._hf_paged_cache = owner  # lets the attention function find its metadata
            self._views.append((k, v))
        self._views_version = self.pool.version

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int):
        """Stores one layer's new tokens through `meta.slot_mapping`; returns the layer's
        pool views.

        key_states, value_states: [R, Hkv, q, D] (padded layout; `meta.token_index` picks
        the stored columns) or [1, Hkv, N, D] for a packed forward
        -> (k_cache, v_cache) [NB, bs, Hkv, D]
        """
        meta = self.meta_for(layer_idx)
        k_cache, v_cache = self._views[layer_idx]
        if meta.num_new == 0:
            return k_cache, v_cache
        if key_states.device != k_cache.device:
            raise HFPagedError(
                f"Layer {layer_idx} computed its keys on {key_states.device}, but its KV pool "
                f"is on {k_cache.device}. The model moved after the cache was made (make a "
                "new one), or its layers are spread over devices and the cache was made "
                "without placement=hf_paged.model_placement(model)."
            )
        key = key_states.transpose(1, 2).reshape(-1, self.num_kv_heads, self.head_dim)
        value = value_states.transpose(1, 2).reshape(-1, self.num_kv_heads, self.head_dim)
        if meta.token_index is not None and not meta.packed:
            key = key.index_select(0, meta.token_index)
            value = value.index_select(0, meta.token_index)
        shard = self.pool.placement.where[layer_idx][0]
        with torch.no_grad(), self._on_device(shard):  # the pool holds plain values
            self._backends[shard].write_kv(k_cache, v_cache, key.to(k_cache.dtype),
                                           value.to(v_cache.dtype), meta.slot_mapping)
        return k_cache, v_cache

    def attend(self, query: torch.Tensor, layer_idx: int, scale: float,
               sliding_window: int | None = None,
               alibi_slopes: torch.Tensor | None = None,
               caller_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of this forward's queries over layer `layer_idx`.

        query [R, Hq, q, D] -> [R, q, Hq, D]; packed: [1, Hq, N, D] -> [1, N, Hq, D].
        alibi_slopes [Hq]: adds slope * key position to the scores (Falcon-RW).
        caller_mask: a 4D mask the caller passed to the model's forward, over columns
        ([R or 1, 1 or Hq, q, columns], bool or additive float); it replaces the causal and
        sliding-window masks, as in SDPA.
        """
        shard = self.pool.placement.where[layer_idx][0]
        with self._on_device(shard):
            out = self._attend(query.to(self.pool.dtype), layer_idx, shard, scale,
                               sliding_window, alibi_slopes, caller_mask).to(query.dtype)
        if torch.is_grad_enabled() and query.requires_grad:
            out = _NoBackward.apply(out, query)
        return out

    def _attend(self, query, layer_idx, shard, scale, sliding_window, alibi_slopes,
                caller_mask):
        meta = self.meta_for(layer_idx)
        k_cache, v_cache = self._views[layer_idx]
        if meta.max_seq_len == 0:  # every row is still all padding: no key to attend to
            return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3])
        if caller_mask is not None:
            if alibi_slopes is not None:
                raise ValueError("A 4D attention mask cannot be combined with ALiBi here "
                                 "(Transformers' Falcon does not accept one either).")
            if self._released_blocks():
                raise HFPagedError(
                    "A 4D attention mask cannot be honoured after blocks left the sliding "
                    "window; call activate_past_recording() before the first forward."
                )
            return self._reference_backend(shard).attention(query, k_cache, v_cache, meta,
                                                            scale, caller_mask=caller_mask)
        backend = (self._reference_backend(shard) if meta.needs_reference
                   else self._backends[shard])
        if not meta.packed:
            return backend.attention(query, k_cache, v_cache, meta, scale, sliding_window,
                                     alibi_slopes)
        if meta.parts is None:
            return self._attend_packed(query, k_cache, v_cache, meta, backend, scale,
                                       sliding_window, alibi_slopes)
        out = torch.empty_like(query.transpose(1, 2))  # [1, N, Hq, D]
        for part, positions in meta.parts:
            piece = query.index_select(2, positions)
            out[:, positions] = self._attend_packed(piece, k_cache, v_cache, part, backend,
                                                    scale, sliding_window, alibi_slopes)
        return out

    def _attend_packed(self, query, k_cache, v_cache, meta, backend, scale, sliding_window,
                       alibi_slopes):
        """query [1, Hq, N, D], the rows' tokens back to back -> [1, N, Hq, D]."""
        rows, q_cols = meta.query_pos.shape
        heads, dim = query.shape[1], query.shape[3]
        tokens = query.transpose(1, 2).reshape(-1, heads, dim)  # [N, Hq, D]
        if meta.token_index is not None:  # spread into the right-aligned [R * q] layout
            padded = tokens.new_zeros(rows * q_cols, heads, dim)
            tokens = padded.index_copy_(0, meta.token_index, tokens)
        padded_query = tokens.view(rows, q_cols, heads, dim).transpose(1, 2)
        out = backend.attention(padded_query, k_cache, v_cache, meta, scale, sliding_window,
                                alibi_slopes)
        out = out.reshape(rows * q_cols, heads, dim)
        if meta.token_index is not None:
            out = out.index_select(0, meta.token_index)
        return out.unsqueeze(0)

    def _released_blocks(self) -> bool:
        """Whether blocks left a sliding window (a caller's 4D mask may need them)."""
        return False

    def _reference_backend(self, shard: int = 0):
        """The PyTorch reference of a shard, for forwards the kernels do not cover (hidden
        slots, a caller's 4D mask)."""
        if self._backends[shard].name == "torch":
            return self._backends[shard]
        if self._references[shard] is None:
            self._references[shard] = TorchBackend()
        return self._references[shard]

    @property
    def workspace_bytes(self) -> int:
        """Bytes of the backends' reusable buffers, all shards."""
        return sum(b.workspace_bytes for b in self._backends + self._references
                   if b is not None)

