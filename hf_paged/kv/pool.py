"""The K/V block storage of one model: one tensor per device for its layers, plus the
allocator they share."""

from __future__ import annotations

import gc
import threading
import weakref

import torch

from ..core.block_pool import BlockPool
from ..config import PagedCacheConfig
from ..errors import KVCacheExhaustedError, KVPoolAllocationError
from .metadata import to_device
from .quant import kv_cache_dtype, stored_dim
from ..kv.placement import Placement


def block_bytes(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                dtype: torch.dtype, v_head_dim: int | None = None,
                kv_dtype: torch.dtype | None = None) -> int:
    """Bytes of one block's K and V over `num_layers` layers (values of `v_head_dim`, by
    default the keys' size); kv_dtype: an 8-bit kind (kv/quant.py) stores each head in
    D + 2 bytes instead of D elements of `dtype`."""
    if kv_dtype is not None:
        return num_layers * num_kv_heads * 2 * stored_dim(head_dim, kv_dtype) * block_size
    return (num_layers * num_kv_heads * (head_dim + (v_head_dim or head_dim)) * block_size
            * torch.tensor([], dtype=dtype).element_size())


def split_layer(kv: torch.Tensor, split: int = 0, kv_dtype: torch.dtype | None = None):
    """(k_cache, v_cache) [NB, bs, Hkv, D] views of one layer's blocks `kv` [2, NB, bs, Hkv,
    D] (split > 0: [1, NB, bs, Hkv, Dk + Dv], values from `split` on; kv_dtype: an 8-bit
    pool's bytes, [NB, bs, Hkv, D + 2] each, viewed as that kind)."""
    if kv_dtype is not None:  # values and their scales, as the kind
        return kv[0].view(kv_dtype), kv[1].view(kv_dtype)
    if not split:
        return kv[0], kv[1]
    return torch.split(kv[0], [split, kv.shape[-1] - split], dim=-1)


# Storage addresses of every live pool's shards, for is_pool_view (a set: read without a
# lock; written under one, by pools being made, grown, pinned or collected).
_pool_storages: set[int] = set()
_storages_lock = threading.Lock()


def is_pool_view(t) -> bool:
    """Whether `t` is a layer's K or V view into a live `KVPool` (the attention function's
    check that pool-shaped keys never reach a non-paged attention)."""
    return (isinstance(t, torch.Tensor) and t.dim() == 4
            and t.untyped_storage().data_ptr() in _pool_storages)


def _track(owner: "KVPool", old: list[int]) -> None:
    """Records the pool's shard storages in place of `old` (its previous ones)."""
    new = [kv.untyped_storage().data_ptr() for kv in owner.shards]
    with _storages_lock:
        _pool_storages.difference_update(old)
        _pool_storages.update(new)
    owner._storages = new
    if getattr(owner, "_untrack", None) is not None:
        owner._untrack.detach()
    owner._untrack = weakref.finalize(owner, _forget, new)


def _forget(storages: list[int]) -> None:
    with _storages_lock:
        _pool_storages.difference_update(storages)


class KVPool:
    """Blocks of K and V for every layer and their `BlockPool`.

    `shards[s]` is `[L_s, 2, NB, bs, Hkv, D]` on `placement.devices[s]`, holding the layers
    `placement.layers[s]`: one shard for a model on one device, one per device for a model
    spread by `device_map`. Block b is block b in every shard. Keys and values of different
    sizes (a latent KV) share one tensor `[L_s, 1, NB, bs, Hkv, Dk + Dv]` instead, each
    layer's K and V being views of its last dimension (`layer_views`). An 8-bit pool
    (`kv_dtype`, kv/quant.py) stores bytes, `[..., Hkv, D + 2]`, whose views show the 8-bit
    kind; `dtype` stays the model's (what its attention computes in).

    A sized pool (`num_blocks` / `max_kv_bytes`) is allocated once and kept for its model
    (`kept_pool`); the caches of every call with that sizing, concurrent ones included, draw
    blocks from it side by side, each owning its own. An unsized one belongs to one cache
    and grows on demand, keeping a little headroom and never more than the caller's worst
    case (growth reallocates `kv`, so it must not be shared across threads).
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        num_blocks: int,
        dtype: torch.dtype,
        device: torch.device | Placement,
        growable: bool,
        v_head_dim: int | None = None,
        kv_dtype: torch.dtype | None = None,
        spare_blocks: int = 0,
    ):
        """device: the device of every layer, or a `Placement` of the layers over devices.
        head_dim, v_head_dim: sizes of a key and a value head (default: the same).
        spare_blocks: blocks after the `num_blocks` handed out, never owned by a sequence
        (block `num_blocks` is where padded rows of a captured decode graph write)."""
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.v_head_dim = v_head_dim or head_dim
        self.block_size = block_size
        self.placement = (device if isinstance(device, Placement)
                          else Placement.single(num_layers, device))
        if self.placement.num_layers != num_layers:
            raise ValueError(f"the placement covers {self.placement.num_layers} layers; the "
                             f"pool has {num_layers}")
        self.dtype, self.device = dtype, self.placement.primary
        self.kv_dtype = kv_dtype  # an 8-bit kind, or None (stored in `dtype`)
        if kv_dtype is not None and self.v_head_dim != head_dim:
            raise ValueError("an 8-bit KV pool needs keys and values of one size; this "
                             f"model's are {head_dim} and {self.v_head_dim} (a latent KV).")
        self.growable = growable
        # First: an impossible size fails before the free list exists.
        self.shards = self._zeros(num_blocks + spare_blocks)
        self.blocks = BlockPool(num_blocks, block_size)
        self.version = 0  # bumped when `kv` is reallocated, so views can be refreshed
        _track(self, [])

    def __getstate__(self):
        state = self.__dict__.copy()
        state.pop("_untrack", None)
        state["_storages"] = []
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        _track(self, [])  # a copy has storages of its own

    @classmethod
    def for_config(cls, config: PagedCacheConfig, num_layers: int, num_kv_heads: int,
                   head_dim: int, dtype: torch.dtype, device,
                   block_size: int | None = None, v_head_dim: int | None = None,
                   model_layers: int | None = None) -> "KVPool":
        """block_size: overrides the config's (an unsized cache may use shorter blocks).
        device: a device or a `Placement`; `max_kv_bytes` bounds all devices together.
        model_layers: the model's layers, when a block holds fewer (`num_layers`, a KV
        group's): `num_blocks` still counts blocks of every layer, so the pool has the bytes
        of `num_blocks` such blocks."""
        block_size = block_size or config.block_size
        kv_dtype = kv_cache_dtype(config.kv_cache_dtype)
        per_block = block_bytes(num_layers, num_kv_heads, head_dim, block_size, dtype,
                                v_head_dim, kv_dtype)
        num_blocks = config.num_blocks
        if num_blocks and model_layers:
            num_blocks = -(-num_blocks * model_layers // num_layers)  # (read back: num_blocks)
        if config.max_kv_bytes is not None:
            num_blocks = config.max_kv_bytes // per_block
            if num_blocks == 0:
                raise ValueError(
                    f"cache_config['max_kv_bytes']={config.max_kv_bytes} is smaller than one "
                    f"block ({per_block} bytes for block_size={block_size}); "
                    f"allowed: at least {per_block}."
                )
        return cls(num_layers, num_kv_heads, head_dim, block_size, num_blocks or 0,
                   dtype, device, growable=not config.is_sized, v_head_dim=v_head_dim,
                   kv_dtype=kv_dtype)

    def _zeros(self, num_blocks: int) -> list[torch.Tensor]:
        # Zeros, not empty: masked-out keys are still multiplied by 0 and must not be NaN.
        # Made outside inference mode so calls under no_grad and inference_mode can share it.
        tail = ((2, num_blocks, self.block_size, self.num_kv_heads,
                 stored_dim(self.head_dim, self.kv_dtype))
                if not self.fused else
                (1, num_blocks, self.block_size, self.num_kv_heads,
                 self.head_dim + self.v_head_dim))
        shards = []
        for device, layers in zip(self.placement.devices, self.placement.layers):
            try:
                with torch.inference_mode(False):
                    shards.append(torch.zeros((len(layers), *tail), dtype=self.storage_dtype,
                                              device=device))
            except (RuntimeError, MemoryError) as err:  # out of memory, or a size torch refuses
                size = block_bytes(len(layers), self.num_kv_heads, self.head_dim,
                                   self.block_size, self.dtype, self.v_head_dim,
                                   self.kv_dtype) * num_blocks
                raise KVPoolAllocationError(
                    f"Could not allocate a KV pool of {num_blocks} block(s) of "
                    f"{self.block_size} tokens ({size / 2**30:.2f} GiB for {len(layers)} "
                    f"layer(s)) on {device}: {err}. Lower cache_config['num_blocks'] / "
                    "['max_kv_bytes'] / ['block_size'], the batch size or max_new_tokens."
                ) from err
        return shards

    @property
    def kv(self) -> torch.Tensor:
        """`[L, 2, NB, bs, Hkv, D]`, the whole pool of a model on one device."""
        if not self.placement.is_single:
            raise AttributeError("KVPool.kv: this pool is split over devices; use `shards` "
                                 "or `layer_kv(layer)`")
        return self.shards[0]

    @property
    def storage_dtype(self) -> torch.dtype:
        """What the shards hold: bytes for an 8-bit pool, else the model's dtype."""
        return self.dtype if self.kv_dtype is None else torch.uint8

    @property
    def fused(self) -> bool:
        """Keys and values differ in size and share the last dimension of one tensor."""
        return self.v_head_dim != self.head_dim

    def layer_kv(self, layer: int) -> torch.Tensor:
        """[2, NB, bs, Hkv, D] (fused: [1, NB, bs, Hkv, Dk + Dv]): K and V blocks of one
        layer, on that layer's device."""
        shard, index = self.placement.where[layer]
        return self.shards[shard][index]

    def layer_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache [NB, bs, Hkv, Dk], v_cache [NB, bs, Hkv, Dv]) of one layer."""
        return split_layer(self.layer_kv(layer), self.split, self.kv_dtype)

    @property
    def split(self) -> int:
        """Where a fused layer's values start in its last dimension (0: not fused)."""
        return self.head_dim if self.fused else 0

    def pin_memory(self) -> None:
        """Page-locks a CPU pool (faster, asynchronous swaps to and from a GPU)."""
        self.shards = [kv.pin_memory() for kv in self.shards]
        _track(self, self._storages)

    def copy_to(self, other: "KVPool", src: list[int], dst: list[int]) -> None:
        """Copies blocks `src` of this pool into blocks `dst` of `other` (a pool with the
        same layer grouping, e.g. a CPU swap pool), shard by shard."""
        for mine, theirs in zip(self.shards, other.shards):
            moved = mine.index_select(2, to_device(src, mine.device))
            # Into host memory the copy must be complete before the CPU writes it out.
            moved = moved.to(theirs.device, non_blocking=theirs.device.type != "cpu")
            theirs.index_copy_(2, to_device(dst, theirs.device), moved)

    # -- sizes -----------------------------------------------------------------------
    @property
    def bytes_per_token(self) -> int:
        """K+V bytes of one token over all layers, as stored (an 8-bit pool's scales
        included)."""
        if self.kv_dtype is not None:
            return self.num_layers * self.num_kv_heads * 2 * stored_dim(self.head_dim,
                                                                         self.kv_dtype)
        return (self.num_layers * self.num_kv_heads * (self.head_dim + self.v_head_dim)
                * self.element_size)

    @property
    def element_size(self) -> int:
        return self.shards[0].element_size()

    @property
    def nbytes(self) -> int:
        return sum(kv.numel() for kv in self.shards) * self.element_size

    # -- growth -------------------------------------------------------------------------
    def ensure_free(self, needed: int, limit: int | None = None, held: int | None = None) -> None:
        """Makes `needed` blocks free, growing an unsized pool (to at most `limit` blocks).

        held: blocks the asking cache holds, for the error message.
        """
        free = self.blocks.num_free
        if needed <= free:
            return
        if not self.growable:
            gc.collect()  # caches dropped inside reference cycles give their blocks back
            free = self.blocks.num_free
            if needed <= free:
                return
            raise KVCacheExhaustedError(needed, free, self.blocks.num_blocks, self.block_size,
                                        held=held)
        required = self.blocks.num_used + needed
        headroom = max(required // 8, 1)
        target = required + headroom
        if limit is not None:
            target = max(required, min(target, limit))
        self._grow(target)

    def _grow(self, num_blocks: int) -> None:
        old = self.shards
        self.shards = self._zeros(num_blocks)
        _track(self, self._storages)
        for new, kv in zip(self.shards, old):
            new[:, :, : kv.shape[2]] = kv
        self.blocks.grow(num_blocks)
        self.version += 1


# Sized pools kept per model, keyed weakly so that a model's pool goes with it and is never
# pickled or deep-copied with it (a copy of the model gets a pool of its own).
_kept: "weakref.WeakKeyDictionary[object, tuple[tuple, KVPool]]" = weakref.WeakKeyDictionary()
_kept_lock = threading.Lock()


def kept_pool(model, config: PagedCacheConfig, num_layers: int, num_kv_heads: int,
              head_dim: int, dtype: torch.dtype, device,
              v_head_dim: int | None = None, model_layers: int | None = None) -> KVPool:
    """The sized pool of `model` for `config`, made on first use.

    Only the latest sizing is kept: a call asking for another one replaces it, and the old
    pool is freed once the caches still using it are gone.
    """
    key = (config.block_size, config.num_blocks, config.max_kv_bytes, config.kv_cache_dtype,
           num_layers, num_kv_heads, head_dim, v_head_dim, model_layers, dtype,
           device if isinstance(device, Placement) else str(device))
    with _kept_lock:
        kept = _kept.get(model)
        if kept is not None and kept[0] == key:
            return kept[1]
        pool = KVPool.for_config(config, num_layers, num_kv_heads, head_dim, dtype, device,
                                 v_head_dim=v_head_dim, model_layers=model_layers)
        _kept[model] = (key, pool)
        return pool
