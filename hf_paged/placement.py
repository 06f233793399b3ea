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


def _hooks(module) -> list:
    """accelerate's hooks on `module` (a SequentialHook holds several)."""
    hook = getattr(module, "_hf_hook", None)
    return [] if hook is None else [hook, *getattr(hook, "hooks", ())]


def _hook_device(module) -> torch.device | None:
    """The execution device accelerate's hook on `module` moves its inputs to, if any."""
    for h in _hooks(module):
        device = getattr(h, "execution_device", None)
        if device is not None:
            return normalize_device(device)
    return None


def input_device(model) -> torch.device:
    """Where `model` takes its inputs: the execution device of accelerate's hook on a
    dispatched model (its first weight may be offloaded, on "meta"), else `model.device`."""
    return _hook_device(model) or model.device


def logits_index_device(model) -> torch.device:
    """The device for an index tensor passed as `logits_to_keep`.

    The final norm of a dispatched model may sit on another device than its inputs, and
    accelerate's top hook would move the index to the input device: that hook is told to
    leave `logits_to_keep` alone, and the index stays on the host, which serves any device.
    """
    hooks = _hooks(model)
    if not hooks:
        return model.device
    for h in hooks:
        if hasattr(h, "skip_keys"):
            keys = h.skip_keys
            keys = [] if keys is None else [keys] if isinstance(keys, str) else list(keys)
            if "logits_to_keep" not in keys:
                h.skip_keys = keys + ["logits_to_keep"]
    return torch.device("cpu")


def layer_devices(model, num_layers: int) -> list[torch.device]:
    """The device each decoder layer's attention runs on (where its keys and values are made).

    A dispatched model (`device_map`) tells by accelerate's hooks: a layer offloaded to CPU
    or disk runs on its hook's execution device. Elsewhere a layer runs where its attention
    weights are. Layers whose attention cannot be found run on the model's device.
    """
    devices = [None] * num_layers
    for _, module in model.named_modules():
        layer = getattr(module, "layer_idx", None)
        if not isinstance(layer, int) or not 0 <= layer < num_layers or devices[layer] is not None:
            continue
        if not any(hasattr(module, n) for n in ("k_proj", "query_key_value", "qkv_proj")):
            continue  # a decoder layer carrying the index, not its attention
        device = _hook_device(module)
        if device is None:
            weights = [p.device for p in module.parameters() if p.device.type != "meta"]
            device = normalize_device(weights[0]) if weights else None
        devices[layer] = device
    fallback = normalize_device(input_device(model))
    return [d if d is not None else fallback for d in devices]


def model_placement(model, num_layers: int | None = None) -> Placement:
    """The KV placement of `model`: one device unless `device_map` spread its layers.
    num_layers: the layers whose KV is cached (default: the model's decoder layers)."""
    if num_layers is None:
        from .models import kv_layout

        num_layers = kv_layout(model.config.get_text_config(decoder=True))[0]
    if not getattr(model, "hf_device_map", None):
        return Placement.single(num_layers, model.device)
    return Placement.of_layers(layer_devices(model, num_layers))
