"""The engine's rotary application: Llama's `apply_rotary_pos_emb` (q * cos +
rotate_half(q) * sin, and the same for k) in one pass of the CPU kernels
(`cuda/cpu_rotary.cpp`) inside the engine's forwards on this thread, with the same values
bit for bit; everywhere else (`generate`, training, other threads) Transformers' own.

Transformers' attention layers call the `apply_rotary_pos_emb` of their modeling module
(Llama's, copied into Mistral, Qwen2, Gemma, Falcon and most others), about fourteen small
ops a layer. The engine has `hf/register.py` replace that name, in each modeling module of
its model whose function and `rotate_half` are Llama's (`is_llamas`), with `fused(own)`,
which checks a flag of the calling thread, set by `fused_rotary()` around an engine
forward. Off, outside inference, while a forward is traced (torch.compile fuses the ops
itself; the CPU stand-in for a CUDA graph records them) or for what the kernel does not
take (not float32 on the CPU, another layout), it is the module's own.
"""

from __future__ import annotations

import threading

import torch
from transformers.models.llama import modeling_llama

from ..kernels import cpu_ops
from ..kernels.library import tracing
from ..utils import set_on_thread


class _Thread(threading.local):
    kernel = None  # inside `fused_rotary()` on this thread: the CPU kernel


_THREAD = _Thread()
_kernel = None  # the CPU kernel, once a model is switched
# Llama's own function (the reference of every module's, switched or not)
_LLAMA_APPLY = getattr(modeling_llama.apply_rotary_pos_emb, "own",
                       modeling_llama.apply_rotary_pos_emb)


def _same_code(function, reference) -> bool:
    """Whether `function` runs `reference`'s bytecode (docstrings aside)."""
    a, b = getattr(function, "__code__", None), reference.__code__
    return a is not None and (a.co_code, a.co_names, a.co_varnames, a.co_consts[1:]) == \
        (b.co_code, b.co_names, b.co_varnames, b.co_consts[1:])


def fused(own):
    """`own` (a module's `apply_rotary_pos_emb`, Llama's) switched: the CPU kernel inside
    `fused_rotary()` where it applies, `own` otherwise."""

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        native = _THREAD.kernel
        if native is not None and unsqueeze_dim == 1 and not torch.is_grad_enabled() \
                and not tracing():  # (a trace records Transformers' ops)
            rotated = native(q, k, cos, sin)  # (None for what it does not take)
            if rotated is not None:
                return rotated
        return own(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb.__doc__ = own.__doc__
    apply_rotary_pos_emb.own = own  # (Transformers' function)
    return apply_rotary_pos_emb


def is_llamas(module) -> bool:
    """Whether modeling module `module`'s `apply_rotary_pos_emb` and `rotate_half` are
    Llama's (the same bytecode, docstrings aside)."""
    return _same_code(getattr(module, "apply_rotary_pos_emb", None), _LLAMA_APPLY) \
        and _same_code(getattr(module, "rotate_half", None), modeling_llama.rotate_half)


def kernel():
    """The CPU kernel (`cpu_ops.rotary`), or None where the CPU kernels cannot be had."""
    global _kernel
    _kernel = _kernel or cpu_ops.rotary()
    return _kernel


def fused_rotary():
    """Inside, switched `apply_rotary_pos_emb` calls on this thread take the CPU kernel."""
    return set_on_thread(_THREAD, "kernel", _kernel)
