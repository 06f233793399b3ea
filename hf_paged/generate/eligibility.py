"""Whether a model's generate call can take the paged cache's shortcuts, or the paged cache
at all: what reaches its forward, and what training mode would change."""

from __future__ import annotations

import torch
from torch.nn.modules import module as torch_module
from transformers import GenerationMixin

from ..distributed.placement import input_device


def runs_plain_forward(model) -> bool:
    """Whether generate's forwards reach `model` exactly as Transformers makes them.

    Only then may the prefill be replaced by a packed one on distinct prompts and decode
    steps skip reading the mask. Not so with an overridden `prepare_inputs_for_generation`
    (PEFT prompt learning, subclasses), forward hooks or replaced forwards (PEFT adapter
    batches, accelerate), or modules in training mode (dropout draws random numbers per
    input shape).
    """
    if ("prepare_inputs_for_generation" in model.__dict__
            or type(model).prepare_inputs_for_generation
            is not GenerationMixin.prepare_inputs_for_generation):
        return False
    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return False
    return not any(m.training or m._forward_pre_hooks or "forward" in m.__dict__
                   or any(not _records_outputs(h) for h in m._forward_hooks.values())
                   for m in model.modules())


def _records_outputs(hook) -> bool:
    """Transformers' own output-capturing hook: installed for good by the first call that
    asks for attentions or hidden states, it records only inside such a call (which the
    packed prefill does not serve) and changes nothing."""
    return getattr(hook, "__module__", None) == "transformers.utils.output_capturing"


def stock_reason(model) -> tuple[str, str] | None:
    """(why this call cannot run on the paged cache, what brings it back), or None: a model
    in training mode (`training_reason`), or a call under torch.autocast."""
    reason = training_reason(model)
    if reason is not None:
        return reason, "model.eval()"
    reason = autocast_reason(model)
    return None if reason is None else (reason, "model.to(dtype) instead of autocast")


_AUTOCAST_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu")


def autocast_reason(model) -> str | None:
    """Why a forward under torch.autocast cannot run on the paged cache, or None. (Asked
    of every paged forward: the model's device is looked up only while autocast is on.)"""
    if not any([torch.is_autocast_enabled(t) for t in _AUTOCAST_TYPES]):
        return None
    device = input_device(model).type  # (an offloaded model's weights may be on "meta")
    if not torch.amp.is_autocast_available(device) or not torch.is_autocast_enabled(device):
        return None
    return (f"torch.autocast is on ({_name(torch.get_autocast_dtype(device))} compute for a "
            f"{_name(model.dtype)} model), which the paged attention does not follow: it "
            "computes in its pool's dtype")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def training_reason(model) -> str | None:
    """Why a model in training mode cannot generate on the paged cache, or None."""
    if not model.training:
        return None
    if getattr(model, "is_activation_checkpointing", False):  # gradient checkpointing
        return ("gradient checkpointing is on in training mode, where Transformers runs the "
                "layers without a cache")
    for module in model.modules():
        dropout = getattr(module, "attention_dropout", 0.0)  # Llama, Mistral: a float
        if isinstance(dropout, torch.nn.Dropout):  # Falcon: a module
            dropout = dropout.p
        if module.training and isinstance(dropout, float) and dropout > 0:
            return (f"attention dropout ({dropout}) is active in training mode, and it draws "
                    "its random numbers inside Transformers' attention kernel")
    return None
