"""Where a loaded model runs: the devices accelerate's `device_map` gave its layers, read
as a KV `Placement`, and where its inputs and the `logits_to_keep` index must go."""

from __future__ import annotations

import torch

from ..kv.placement import Placement, normalize_device

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
    dispatched model (its first weight may be offloaded, on "meta"), or of the first module
    hooked to run somewhere (`cpu_offload` hooks each module, not the model), else
    `model.device`."""
    device = _hook_device(model)
    if device is None and model.device.type == "meta":
        device = next((d for d in map(_hook_device, model.modules()) if d is not None), None)
    return device or model.device


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


# What an attention module (not the decoder layer around it) holds: its key projection
# (fused in some: Falcon, Phi-3, DBRX; DeepSeek-V3's latent one).
_KV_PROJECTIONS = ("k_proj", "query_key_value", "qkv_proj", "Wqkv", "kv_a_proj_with_mqa")


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
        if not any(hasattr(module, n) for n in _KV_PROJECTIONS):
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
        from ..hf.architectures import kv_layout

        num_layers = kv_layout(model.config.get_text_config(decoder=True))[0]
    if not getattr(model, "hf_device_map", None):  # (offloaded modules run on its input device)
        return Placement.single(num_layers, input_device(model))
    return Placement.of_layers(layer_devices(model, num_layers))
