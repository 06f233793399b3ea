"""KV memory accounting of a `PagedCache`."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.block_table import FREED


@dataclass(frozen=True)
class DeviceMemory:
    """The KV memory one device holds: the layers placed there (all of them for a model on
    one device; a share for a model spread by `device_map`).

    device:           the device, as a string ("cuda:1")
    num_layers:       layers whose keys and values it holds
    bytes_per_token:  K+V bytes of one token over those layers
    pool_bytes:       bytes allocated there for the pool
    kv_bytes_in_use:  bytes of the blocks the cache holds, there
    """

    device: str
    num_layers: int
    bytes_per_token: int
    pool_bytes: int
    kv_bytes_in_use: int


@dataclass(frozen=True)
class GroupMemory:
    """One KV group of a hybrid model (see core/kv_groups.py): its layers' blocks.

    window:         its sliding window (None: full attention)
    layers:         its layers
    blocks_in_use:  blocks its tables hold (each of block_size tokens of its layers)
    tokens_stored:  distinct tokens held in them
    """

    window: int | None
    layers: tuple[int, ...]
    blocks_in_use: int
    tokens_stored: int


@dataclass(frozen=True)
class MemoryStats:
    """KV memory of a `PagedCache` at one moment.

    tokens_stored:       distinct tokens held in blocks (a shared token counts once; tokens
                         released outside a sliding window do not count; hidden slots, the
                         columns a mask hides after a row's first real token, do)
    logical_tokens:      sequence lengths summed over rows
    blocks_in_use:       blocks this cache holds
    peak_blocks_in_use:  most blocks this cache held at once since it was created or reset
    num_blocks:          blocks the pool has room for (a sized pool is shared with the other
                         caches of its model)
    shared_blocks:       blocks held by more than one row
    bytes_per_token:     K+V bytes of one token over all layers
    pool_bytes:          bytes allocated for the pool
    unshared_kv_bytes:   bytes the same rows would need in blocks of their own
    utilization:         tokens_stored / (blocks_in_use * block_size)
    workspace_bytes:     the reference backend's gather buffer (one layer's K and V of the
                         batch, reused by every layer and step)
    devices:             the same memory per device: {"cuda:1": DeviceMemory, ...}, one
                         entry per device holding layers (one for a model on one device)
    groups:              a hybrid model's KV groups (sliding-window layers apart from full
                         ones), each with its own blocks; empty for one group. The figures
                         above then count blocks of every layer: a group's block of k of the
                         model's L layers counts k / L of one, and tokens_stored averages
                         the layers (a token a sliding group released counts for the
                         layers still holding it)
    """

    tokens_stored: int
    logical_tokens: int
    blocks_in_use: int
    peak_blocks_in_use: int
    num_blocks: int
    block_size: int
    shared_blocks: int
    bytes_per_token: int
    pool_bytes: int
    unshared_kv_bytes: int
    utilization: float
    workspace_bytes: int = 0
    devices: dict[str, DeviceMemory] = field(default_factory=dict)
    groups: tuple[GroupMemory, ...] = ()

    @property
    def kv_bytes_in_use(self) -> int:
        return self.blocks_in_use * self.block_size * self.bytes_per_token

    @property
    def peak_kv_bytes(self) -> int:
        return self.peak_blocks_in_use * self.block_size * self.bytes_per_token


def _fill(tables, block_size: int) -> dict[int, int]:
    """Tokens held in each block of one group's tables."""
    fill: dict[int, int] = {}
    for table, n in zip(tables.tables, tables.lengths):
        for i, block in enumerate(table):
            if block != FREED:
                fill[block] = max(fill.get(block, 0), min(block_size, n - i * block_size))
    return fill


def measure(cache) -> MemoryStats:
    """Memory figures of `cache` (a PagedCache) at this moment."""
    if cache.pool is None:  # nothing stored yet
        return MemoryStats(0, 0, 0, 0, 0, cache.block_size, 0, 0, 0, 0, 0.0)
    bs, groups = cache.block_size, cache.groups
    fills = [_fill(t, bs) for t in cache.tables.by_group]
    layers = groups.num_layers
    in_use_pool = sum(len(f) for f in fills)
    in_use = groups.model_blocks(in_use_pool, round_up=True)
    tokens = round(sum(sum(f.values()) * len(g) for f, g in zip(fills, groups.layers)) / layers)
    shared = sum(1 for f in fills for b in f if cache.pool.blocks.refcount(b) > 1)
    bpt = cache.pool.bytes_per_token * layers // groups.slots
    unshared = sum(len(t) - f for tables in cache.tables.by_group
                   for t, f in zip(tables.tables, tables.freed))
    return MemoryStats(
        tokens_stored=tokens,
        logical_tokens=sum(cache.tables.lengths),
        blocks_in_use=in_use,
        peak_blocks_in_use=max(groups.model_blocks(cache.peak_blocks, round_up=True), in_use),
        num_blocks=groups.model_blocks(cache.pool.blocks.num_blocks),
        block_size=bs,
        shared_blocks=groups.model_blocks(shared, round_up=True),
        bytes_per_token=bpt,
        pool_bytes=cache.pool.nbytes,
        unshared_kv_bytes=unshared * bs * cache.pool.bytes_per_token,
        utilization=tokens / (in_use * bs) if in_use else 0.0,
        workspace_bytes=cache.workspace_bytes,
        devices=_per_device(cache.pool, in_use_pool * bs, layers),
        groups=() if not groups.is_hybrid else tuple(
            GroupMemory(w, g, len(f), sum(f.values()))
            for w, g, f in zip(groups.windows, groups.layers, fills)),
    )


def _per_device(pool, tokens_in_blocks: int, model_layers: int) -> dict[str, DeviceMemory]:
    """tokens_in_blocks: block slots the cache holds (pool blocks in use * block size).
    A pool of fewer layers per block than the model's (KV groups) is on one device."""
    per_layer = pool.bytes_per_token // pool.num_layers
    totals: dict[str, list[int]] = {}  # device -> [layers, pool bytes, layers per block]
    for device, layers, kv in zip(pool.placement.devices, pool.placement.layers, pool.shards):
        entry = totals.setdefault(str(device), [0, 0, 0])
        entry[0] += len(layers) if pool.num_layers == model_layers else model_layers
        entry[1] += kv.numel() * kv.element_size()
        entry[2] += len(layers)
    return {device: DeviceMemory(device, n, n * per_layer, nbytes,
                                 tokens_in_blocks * slots * per_layer)
            for device, (n, nbytes, slots) in totals.items()}
