"""Where each layer's keys and values live.

A model loaded on one device keeps its whole KV pool there. A model spread over devices by
`device_map` (accelerate) computes each layer's keys on that layer's execution device, so
its pool is split the same way: one shard per device holding the KV of that device's
layers. Every shard uses the same block ids (one allocator, one set of block tables); only
where the bytes sit differs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..core.kv_groups import KVGroups


def normalize_device(device) -> torch.device:
    """A comparable device: an accelerate-style int is an accelerator index, a bare "cuda"
    is the current CUDA device."""
    if isinstance(device, int):
        accelerator = torch.accelerator.current_accelerator()
        device = torch.device(accelerator.type if accelerator is not None else "cuda", device)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cpu":
        device = torch.device("cpu")  # "cpu:0" is "cpu"
    return device


@dataclass(frozen=True)
class Placement:
    """Which device holds the KV of which layers.

    devices: one per shard; shard 0 holds layer 0 and is where per-forward metadata is built
    layers:  the (ascending) layer indices of each shard
    """

    devices: tuple[torch.device, ...]
    layers: tuple[tuple[int, ...], ...]
    # layer -> (shard, index of the layer in its shard)
    where: tuple[tuple[int, int], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if len(self.devices) != len(self.layers) or not self.devices:
            raise ValueError(f"a Placement needs one layer list per device; got "
                             f"{len(self.devices)} devices and {len(self.layers)} layer lists")
        where = {layer: (s, i) for s, layers in enumerate(self.layers)
                 for i, layer in enumerate(layers)}
        if sorted(where) != list(range(len(where))) or len(where) != sum(map(len, self.layers)):
            raise ValueError(f"a Placement must hold layers 0..n-1 once each; got {self.layers}")
        object.__setattr__(self, "where", tuple(where[layer] for layer in range(len(where))))

    @classmethod
    def single(cls, num_layers: int, device) -> "Placement":
        return cls((torch.device(device),), (tuple(range(num_layers)),))

    @classmethod
    def of_layers(cls, devices: Sequence) -> "Placement":
        """From the device of each layer: one shard per distinct device, in order of first use."""
        groups: dict[torch.device, list[int]] = {}
        for layer, device in enumerate(devices):
            groups.setdefault(normalize_device(device), []).append(layer)
        return cls(tuple(groups), tuple(tuple(g) for g in groups.values()))

    @property
    def num_layers(self) -> int:
        return len(self.where)

    @property
    def primary(self) -> torch.device:
        return self.devices[0]

    @property
    def is_single(self) -> bool:
        return len(self.devices) == 1

    def on(self, device) -> "Placement":
        """The same layer grouping with every shard on `device` (a swap pool's)."""
        return Placement((torch.device(device),) * len(self.layers), self.layers)


def group_layers(windows, placement: Placement | None, device=None):
    """(KVGroups, where their pool goes) for layers with these sliding `windows`.

    Sliding-window and full layers form separate groups (core/kv_groups.py) when every layer
    is on one device, since a block's slots then hold layers of several groups; a model
    spread over devices keeps one group (and its placement). placement None: one device,
    `device`."""
    groups = KVGroups.plan(windows, hybrid=placement is None or placement.is_single)
    if not groups.is_hybrid:
        return groups, placement or device
    return groups, Placement.single(groups.slots, placement.primary if placement else device)


def groups_for_pool(windows, pool) -> KVGroups:
    """The groups a given pool serves: grouped when its blocks hold a group's slots, one
    group when they hold every layer."""
    groups = KVGroups.plan(windows, hybrid=pool.placement.is_single)
    if pool.num_layers == groups.slots:
        return groups
    if pool.num_layers == len(windows):
        return KVGroups.plan(windows, hybrid=False)
    raise ValueError(f"PagedCache: the pool holds {pool.num_layers} layers per block; this "
                     f"model needs {len(windows)} (or {groups.slots}, grouped).")
