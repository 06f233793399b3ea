"""The engine's linear switch: a float32 CPU model's large `nn.Linear` layers run through
oneDNN (kernels/cpu_linear.py) in the engine's forwards on this thread, and exactly as torch
runs them everywhere else (`generate`, training, other threads).

`use_onednn_linears(model)` gives each such layer the class `OneDNNLinear`, an `nn.Linear`
(isinstance checks, PEFT's wrapping and state dicts are unchanged) whose forward checks a
flag of the calling thread, set by `onednn_linears()` around an engine forward. Under
torch.compile the flag is read while tracing: the engine's own graphs record oneDNN's op,
any other compile of the model traces torch's.
"""

from __future__ import annotations

import contextlib
import threading

import torch.nn.functional as F
from torch import nn

from ..kernels import cpu_linear


class _Thread(threading.local):
    on = False  # inside `onednn_linears()` on this thread


_THREAD = _Thread()


class OneDNNLinear(nn.Linear):
    """An `nn.Linear` that runs through oneDNN inside `onednn_linears()` on its thread."""

    def forward(self, input):
        if _THREAD.on:
            return cpu_linear.linear(input, self.weight, self.bias)
        return F.linear(input, self.weight, self.bias)


def use_onednn_linears(model: nn.Module) -> int:
    """Gives the model's `nn.Linear` layers that run faster through oneDNN (float32, on the
    CPU, large: `cpu_linear.worth_it`) the class `OneDNNLinear`; returns how many layers
    have it. Subclasses of `nn.Linear` (quantized, tensor-parallel, PEFT's) are left alone."""
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear and cpu_linear.worth_it(module.weight):
            module.__class__ = OneDNNLinear
        count += type(module) is OneDNNLinear
    return count


@contextlib.contextmanager
def onednn_linears():
    """Inside, `OneDNNLinear` layers called on this thread run through oneDNN."""
    outer, _THREAD.on = _THREAD.on, True
    try:
        yield
    finally:
        _THREAD.on = outer
