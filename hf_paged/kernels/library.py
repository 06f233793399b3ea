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
