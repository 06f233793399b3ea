"""The K/V block storage of one model: one tensor for all layers, plus its allocator."""

from __future__ import annotations

import gc
import math
import threading
import weakref

import torch

from .block_pool import BlockPool
from .config import PagedCacheConfig
from .errors import KVCacheExhaustedError, KVPoolAllocationError


class KVPool:
    """Blocks of K and V for every layer, `[L, 2, NB, bs, Hkv, D]`, and their `BlockPool`.

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
        device: torch.device,
        growable: bool,
    ):
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.block_size = block_size
        self.dtype, self.device = dtype, torch.device(device)
        self.growable = growable
        self.kv = self._zeros(num_blocks)  # first: an impossible size fails before the free list
        self.blocks = BlockPool(num_blocks, block_size)
        self.version = 0  # bumped when `kv` is reallocated, so views can be refreshed

    @classmethod
    def for_config(cls, config: PagedCacheConfig, num_layers: int, num_kv_heads: int,
                   head_dim: int, dtype: torch.dtype, device,
                   block_size: int | None = None) -> "KVPool":
        """block_size: overrides the config's (an unsized cache may use shorter blocks)."""
        block_size = block_size or config.block_size
        per_block = (
            num_layers * 2 * num_kv_heads * head_dim * block_size
            * torch.tensor([], dtype=dtype).element_size()
        )
        num_blocks = config.num_blocks
        if config.max_kv_bytes is not None:
            num_blocks = config.max_kv_bytes // per_block
            if num_blocks == 0:
                raise ValueError(
                    f"cache_config['max_kv_bytes']={config.max_kv_bytes} is smaller than one "
                    f"block ({per_block} bytes for block_size={block_size}); "
                    f"allowed: at least {per_block}."
                )
        return cls(num_layers, num_kv_heads, head_dim, block_size, num_blocks or 0,
                   dtype, device, growable=not config.is_sized)

    def _zeros(self, num_blocks: int) -> torch.Tensor:
        # Zeros, not empty: masked-out keys are still multiplied by 0 and must not be NaN.
        # Made outside inference mode so calls under no_grad and inference_mode can share it.
        shape = (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        try:
            with torch.inference_mode(False):
                return torch.zeros(shape, dtype=self.dtype, device=self.device)
        except (RuntimeError, MemoryError) as err:  # out of memory, or a size torch refuses
            size = math.prod(shape) * torch.tensor([], dtype=self.dtype).element_size()
            raise KVPoolAllocationError(
                f"Could not allocate a KV pool of {num_blocks} block(s) of {self.block_size} "
                f"tokens ({size / 2**30:.2f} GiB) on {self.device}: {err}. Lower "
                "cache_config['num_blocks'] / ['max_kv_bytes'] / ['block_size'], the batch size "
                "or max_new_tokens."
            ) from err

    # -- sizes -----------------------------------------------------------------------
    @property
    def bytes_per_token(self) -> int:
        """K+V bytes of one token over all layers."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.kv.element_size()

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

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
        old = self.kv
        self.kv = self._zeros(num_blocks)
        self.kv[:, :, : old.shape[2]] = old
        self.blocks.grow(num_blocks)
        self.version += 1


# Sized pools kept per model, keyed weakly so that a model's pool goes with it and is never
# pickled or deep-copied with it (a copy of the model gets a pool of its own).
_kept: "weakref.WeakKeyDictionary[object, tuple[tuple, KVPool]]" = weakref.WeakKeyDictionary()
_kept_lock = threading.Lock()


def kept_pool(model, config: PagedCacheConfig, num_layers: int, num_kv_heads: int,
              head_dim: int, dtype: torch.dtype, device) -> KVPool:
    """The sized pool of `model` for `config`, made on first use.

    Only the latest sizing is kept: a call asking for another one replaces it, and the old
    pool is freed once the caches still using it are gone.
    """
    key = (config.block_size, config.num_blocks, config.max_kv_bytes, num_layers, num_kv_heads,
           head_dim, dtype, str(device))
    with _kept_lock:
        kept = _kept.get(model)
        if kept is not None and kept[0] == key:
            return kept[1]
        pool = KVPool.for_config(config, num_layers, num_kv_heads, head_dim, dtype, device)
        _kept[model] = (key, pool)
        return pool
