"""The torch ops a compiled forward calls: Python kernels registered with the dispatcher
itself, so that a traced graph records one op where the kernel runs.

`torch.library.custom_op` wraps each call in Python layers of its own (argument defaults,
autograd and version bookkeeping): about 20 µs a call for the pool write, where the write
itself takes 9. Defined here from a schema, a call costs the dispatcher's 1-2 µs. These ops
run under `torch.inference_mode` / `no_grad` only (a forward on the paged KV has no
backward), so they need no autograd kernel.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

_LIBRARY = torch.library.Library("hf_paged", "FRAGMENT")


def define(name: str, schema: str, fake: Callable) -> Callable[[Callable], Callable]:
    """Decorator: `hf_paged::<name><schema>` (e.g. "(Tensor x) -> Tensor") runs the
    decorated function on every device; `fake` computes its outputs' shapes for tracing.
    Returns the op's overload (`torch.ops.hf_paged.<name>.default`)."""

    def register(kernel: Callable) -> Callable:
        _LIBRARY.define(name + schema)
        _LIBRARY.impl(name, kernel, "CompositeExplicitAutograd")
        torch.library.register_fake(f"hf_paged::{name}", fake, lib=_LIBRARY)
        return getattr(torch.ops.hf_paged, name).default

    return register


def impl_on(name: str, device: str, kernel: Callable) -> None:
    """Runs `kernel` for `hf_paged::<name>` on tensors of `device` ("CPU", "CUDA"): a
    device's kernel wins over the one `define` registers for every device."""
    _LIBRARY.impl(name, kernel, device)


def tracing() -> bool:
    """Whether the code running now is being traced (torch.compile, make_fx, fake tensors, a
    dispatch mode such as the CPU stand-in for a CUDA graph): kernels are then called
    through their ops, which a trace records as one op each. Outside tracing the kernel is
    called itself: an op's Python dispatch costs about as much as a small call."""
    return torch.compiler.is_compiling() or is_in_torch_dispatch_mode()


def like_first(tensor: torch.Tensor, *args) -> torch.Tensor:
    """Fake kernel of an op whose output has its first argument's shape, dtype and strides."""
    return torch.empty_like(tensor)
