"""The engine's linear switch: a float32 CPU model's large `nn.Linear` layers run through
oneDNN (kernels/cpu_linear.py) in the engine's forwards on this thread, and exactly as torch
runs them everywhere else (`generate`, training, other threads).

`use_onednn_linears(model)` gives each such layer the class `OneDNNLinear` (or, for
Falcon's `FalconLinear`, `OneDNNFalconLinear`), a subclass of its own (isinstance checks,
PEFT's wrapping, state dicts and pickling are unchanged) whose forward checks a flag of the
calling thread, set by `onednn_linears()` around an engine forward; off, it is the class's
own forward. Under torch.compile the flag is read while tracing: the engine's own graphs
record oneDNN's op, any other compile of the model traces torch's.
"""

from __future__ import annotations

import threading

import torch
from torch import nn
from transformers.models.falcon.modeling_falcon import FalconLinear

from ..kernels import cpu_linear
from ..utils import set_on_thread


class _Thread(threading.local):
    on = False  # inside `onednn_linears()` on this thread


_THREAD = _Thread()


def _through_onednn(layer, input: torch.Tensor, own) -> torch.Tensor:
    # (no autograd kernel: a forward that records gradients takes the class's own path,
    # as does a call oneDNN cannot run as given)
    weight, bias = layer.weight, layer.bias
    if _THREAD.on and not torch.is_grad_enabled() and cpu_linear.fits(input, weight, bias):
        return cpu_linear.linear(input, weight, bias)
    return own(layer, input)


class OneDNNLinear(nn.Linear):
    """An `nn.Linear` that runs through oneDNN inside `onednn_linears()` on its thread."""

    def forward(self, input):
        return _through_onednn(self, input, nn.Linear.forward)


class OneDNNFalconLinear(FalconLinear):
    """Falcon's `FalconLinear` (`input @ weight.T + bias`), through oneDNN likewise."""

    def forward(self, input):
        return _through_onednn(self, input, FalconLinear.forward)


# The layer classes whose forward is `F.linear`'s arithmetic -> their switched class.
_SWITCHED = {nn.Linear: OneDNNLinear, FalconLinear: OneDNNFalconLinear}


def use_onednn_linears(model: nn.Module) -> int:
    """Gives the model's linear layers that run faster through oneDNN (float32, on the CPU,
    large: `cpu_linear.worth_it`) their switched class; returns how many layers have one.
    Other subclasses of `nn.Linear` (quantized, tensor-parallel, PEFT's) are left alone."""
    count = 0
    for module in model.modules():
        switched = _SWITCHED.get(type(module))
        if switched is not None and cpu_linear.worth_it(module.weight):
            module.__class__ = switched
        count += type(module) in _SWITCHED.values()
    return count


def onednn_linears():
    """Inside, `OneDNNLinear` layers called on this thread run through oneDNN."""
    return set_on_thread(_THREAD, "on", True)
