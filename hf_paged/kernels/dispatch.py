"""The dispatcher: a pool's layer views and one attention backend per shard.

`PoolAccess` binds one backend per pool shard (`device_map` splits a pool over devices) and
decides, from each backend's declared `Capabilities`, which forwards go to the PyTorch
reference instead. `PoolAccess.forward(meta)` makes the `PagedForward` of one model
forward (forward.py): the object the "paged" attention function receives as its `paged_kv`
keyword (and an engine forward's `past_key_values`).
"""

from __future__ import annotations

import contextlib

import torch

from ..core.kv_groups import KVGroups
from ..kv.metadata import ForwardMetadata, to_device
from . import reference
from .backends import select_backend
from .base import Backend
from .forward import NO_MASK, PagedForward, PagedLayers, cannot_apply
from .torch_backend import TorchBackend

__all__ = ["NO_MASK", "PagedForward", "PagedLayers", "PoolAccess"]


class PoolAccess:
    """Per-layer views of a `KVPool` and one attention backend per shard."""

    def __init__(self, pool, backend: str, num_heads: int,
                 windows: tuple[int | None, ...] | None = None, latent: bool = False,
                 features: frozenset = frozenset(), groups: KVGroups | None = None):
        """backend: a name for `select_backend` ("auto", "torch", ...); num_heads: query
        heads (of this rank); windows: each layer's sliding window (None: full attention);
        latent: the layers store a latent KV their attention expands (each layer's write
        returns its rows' tokens in full; see `PagedForward.write`). features: what the
        model's attention layers pass (`hf.architectures.attention_features`): a backend
        named explicitly that cannot apply them is refused here. groups: how the layers
        share the pool's blocks (default: one group, layer i in slot i). Raises ValueError
        (nothing bound) when it cannot run on the pool's devices; in a pool over several
        devices, a CPU shard a GPU backend cannot serve gets the reference."""
        self.pool = pool
        self.num_heads, self.latent = num_heads, latent
        self.groups = groups or KVGroups.plan((None,) * pool.num_layers)
        if self.groups.slots != pool.num_layers:
            raise ValueError(f"the KV groups put {self.groups.slots} layers in a block; the "
                             f"pool's blocks hold {pool.num_layers}")
        self.where = self.groups.where()  # per layer: (group, slot)
        self.layer_shards = [pool.placement.where[slot][0] for _, slot in self.where]
        self.windows = (tuple(windows) if windows is not None
                        else (None,) * self.groups.num_layers)
        self.backend_name = backend
        devices = pool.placement.devices

        def select(device):
            if pool.kv_dtype is not None:
                return self._select_8bit(backend, device)
            if pool.fused or latent:  # only the reference reads values of their own size
                if backend not in ("auto", "torch"):
                    raise ValueError(
                        f"cache_config['backend']={backend!r} cannot run here: this model's "
                        "keys and values differ in size (a latent KV), which only the "
                        "'torch' backend reads.")
                return TorchBackend()
            try:
                return select_backend(backend, device, pool.dtype, pool.block_size,
                                      num_heads, pool.num_kv_heads)
            except ValueError:
                if device.type == "cuda" or all(d.type != "cuda" for d in devices):
                    raise
                return TorchBackend()  # layers run on a CPU next to GPUs: the reference

        self.backends: list[Backend] = [select(device) for device in devices]
        if backend != "auto":
            for b in self.backends:
                missing = b.capabilities.missing("softcap" in features, "sinks" in features)
                if missing is not None:
                    raise ValueError(cannot_apply(backend, missing))
        self._references: list[Backend | None] = [
            b if isinstance(b, TorchBackend) else None for b in self.backends]
        self._views: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._views_version = -1

    def _select_8bit(self, name: str, device: torch.device) -> Backend:
        """The backend of an 8-bit pool: one that reads its kind (`Capabilities.kv_dtypes`);
        "auto" takes Triton on a GPU (never flash-attn, which reads none) or the CPU kernel
        on CPU where they can run, else the reference."""
        kind = self.pool.kv_dtype
        if name == "auto":
            try:
                chosen = select_backend("triton" if device.type == "cuda" else "cpu", device,
                                        self.pool.dtype)
                if kind in chosen.capabilities.kv_dtypes:
                    return chosen
            except ValueError:
                pass
            return TorchBackend()
        chosen = select_backend(name, device, self.pool.dtype, self.pool.block_size,
                                self.num_heads, self.pool.num_kv_heads)
        if kind not in chosen.capabilities.kv_dtypes:
            raise ValueError(f"cache_config['backend']={name!r} cannot run here: it does not "
                             f"read 8-bit K/V blocks ({kind}) on {device}; the backends that "
                             "do: 'torch', 'triton' (fp8 from sm_89 on), 'cuda', 'cpu', or "
                             "'auto'.")
        return chosen

    @property
    def backend(self) -> Backend:
        """The first shard's backend."""
        return self.backends[0]

    def views(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) [NB, bs, Hkv, D] of a layer: its slot of the pool's blocks
        (renewed when the pool grows)."""
        if torch.compiler.is_compiling():  # sliced in the graph from the shard: views lifted
            return self.pool.layer_views(self.where[layer_idx][1])  # apart alias each other
        if self._views_version != self.pool.version:
            slots = [self.pool.layer_views(slot) for slot in range(self.pool.num_layers)]
            self._views = [slots[slot] for _, slot in self.where]
            self._views_version = self.pool.version
        return self._views[layer_idx]

    def write_traced(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor,
                     slot_mapping: torch.Tensor) -> None:
        """A compiled forward's write of one layer's new tokens (key, value [N, Hkv, D] in
        the pool's dtype): one op on the layer's shard, which the compiler keeps in place
        (`reference.write_layer_kv`)."""
        shard, index = self.pool.placement.where[self.where[layer_idx][1]]
        reference.write_layer_kv(self.pool.shards[shard], index, key, value, slot_mapping,
                                 self.pool.split, self.pool.kv_dtype)

    def gather_traced(self, layer_idx: int,
                      block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A compiled forward's read of a latent layer's rows (`reference.gather_layer_kv`):
        [R, Hkv, T, Dk] and [R, Hkv, T, Dv]."""
        shard, index = self.pool.placement.where[self.where[layer_idx][1]]
        return reference.gather_layer_kv(self.pool.shards[shard], index, block_tables,
                                         self.pool.split)

    def backend_for(self, shard: int, meta: ForwardMetadata, caller_mask: bool) -> Backend:
        """The backend that computes this forward on `shard`: the shard's own where its
        capabilities cover the forward, the PyTorch reference otherwise (the one rule)."""
        backend = self.backends[shard]
        if backend.capabilities.covers(meta, caller_mask):
            return backend
        return self.reference(shard)

    def reference(self, shard: int) -> Backend:
        if self._references[shard] is None:
            self._references[shard] = TorchBackend()
        return self._references[shard]

    def with_features(self, backend: Backend, shard: int, softcap: bool, sinks: bool) -> Backend:
        """`backend`, or the reference where it cannot apply a layer's softcap or sinks (a
        backend named explicitly for a model known to use them was refused when bound)."""
        missing = backend.capabilities.missing(softcap, sinks)
        if missing is None:
            return backend
        if self.backend_name != "auto":
            raise ValueError(cannot_apply(self.backend_name, missing))
        return self.reference(shard)

    def switches(self) -> list[bool]:
        """Per shard: its CUDA device is not the current one (Triton launches on the current
        device, and accelerate does not switch it for the layers it places elsewhere)."""
        devices = self.pool.placement.devices
        if all(d.type != "cuda" for d in devices):
            return [False] * len(devices)
        current = torch.cuda.current_device()
        return [d.type == "cuda" and d.index != current for d in devices]

    def on_device(self, shard: int, switch: list[bool]):
        """Makes a shard's CUDA device current while its kernels launch, where needed."""
        if switch[shard]:
            return torch.cuda.device(self.pool.placement.devices[shard])
        return contextlib.nullcontext()

    def copy_blocks(self, pairs) -> None:
        """Copies blocks (src, dst) in every shard (copy-on-write)."""
        switch = self.switches()
        for shard, (kv, backend) in enumerate(zip(self.pool.shards, self.backends)):
            src, dst = to_device(pairs, kv.device).T
            with self.on_device(shard, switch):
                backend.copy_blocks(kv, src, dst)

    def forward(self, meta: ForwardMetadata, released_blocks: bool = False,
                group_metas: list[ForwardMetadata] | None = None) -> "PagedForward":
        """The paged KV of one forward with metadata `meta` (on the pool's first device).
        released_blocks: blocks left a sliding window (a caller's 4D mask cannot be honoured).
        group_metas: each KV group's metadata (the same rows and tokens, each group's own
        block tables and slots), when the layers form several groups."""
        self.views(0)  # renewed here, outside a compiled forward, which then only reads them
        return PagedForward(self, meta, released_blocks, group_metas=group_metas)

    @property
    def workspace_bytes(self) -> int:
        """Bytes of the backends' reusable buffers, all shards."""
        seen = {id(b): b for b in self.backends + self._references if b is not None}
        return sum(b.workspace_bytes for b in seen.values())


