"""The K/V block storage of one model: one tensor for all layers, plus its allocator."""

from __future__ import annotations

import math
import weakref

import torch

from .block_pool import BlockPool
from .config import PagedCacheConfig
from .errors import KVCacheExhaustedError, KVPoolAllocationError


class KVPool:
    """Blocks of K and V for every layer, `[L, 2, NB, bs, Hkv, D]`, and their `BlockPool`.

    A sized pool (`num_blocks` / `max_kv_bytes`) is allocated once and reused by later
    caches of the same model; an unsized one grows on demand, keeping a little headroom
    and never more than the caller's worst case.
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
        self._owner: weakref.ref | None = None

    @classmethod
    def for_config(cls, config: PagedCacheConfig, num_layers: int, num_kv_heads: int,
                   head_dim: int, dtype: torch.dtype, device) -> "KVPool":
        per_block = (
            num_layers * 2 * num_kv_heads * head_dim * config.block_size
            * torch.tensor([], dtype=dtype).element_size()
        )
        num_blocks = config.num_blocks
        if config.max_kv_bytes is not None:
            num_blocks = config.max_kv_bytes // per_block
            if num_blocks == 0:
                raise ValueError(
                    f"cache_config['max_kv_bytes']={config.max_kv_bytes} is smaller than one "
                    f"block ({per_block} bytes for block_size={config.block_size}); "
                    f"allowed: at least {per_block}."
                )
        return cls(num_layers, num_kv_heads, head_dim, config.block_size, num_blocks or 0,
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

    # -- ownership across caches -----------------------------------------------------
    def attach(self, cache) -> None:
        """Hands the whole pool to `cache`, the only one that may use it from now on.

        A previous cache is detached; its blocks return to the pool whether or not it is
        still alive, since no other cache can hold them.
        """
        previous = self._owner() if self._owner is not None else None
        if previous is not None and previous is not cache:
            previous._detach()
        self.blocks = BlockPool(self.blocks.num_blocks, self.block_size)
        self._owner = weakref.ref(cache)

    # -- growth -------------------------------------------------------------------------
    def ensure_free(self, needed: int, limit: int | None = None) -> None:
        """Makes `needed` blocks free, growing an unsized pool (to at most `limit` blocks)."""
        free = self.blocks.num_free
        if needed <= free:
            return
        if not self.growable:
            raise KVCacheExhaustedError(needed, free, self.blocks.num_blocks, self.block_size)
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
