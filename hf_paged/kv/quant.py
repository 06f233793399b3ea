"""8-bit K/V blocks: each stored token's key (and value) head is its values in 8 bits and
one bfloat16 scale.

Layout: a quantized pool stores bytes; a layer's views show them as the 8-bit kind
(`torch.int8`, `torch.float8_e4m3fn` or `torch.float8_e5m2`), shape [NB, bs, Hkv, D + 2]:
the last two elements of each head are the bit pattern of its bfloat16 scale. Keeping the
scale beside its values makes every block self-contained: copy-on-write, swaps and pool
growth copy bytes and stay bit-exact, and a block costs D + 2 bytes per head and token
against 2 D for bfloat16 (1.94x the blocks at D = 64, 1.97x at D = 128).

Scales are chosen per token and head when it is written: the absolute maximum of its D
values over the kind's largest finite value (127, 448, 57344), so nothing saturates and no
calibration pass is needed. The scale is a bfloat16 (float16 would round small scales, a
head of values below 0.03 in fp8 e4m3, into its subnormals), rounded up so that no value
overflows; a value is x / scale rounded to the kind (int8: to nearest), and reads as
stored * scale: the scale's own rounding costs nothing, only the value's does.
"""

from __future__ import annotations

import torch

from ..config import KV_CACHE_DTYPES as NAMES

SCALE_ELEMENTS = 2  # one bfloat16 scale, as two 8-bit elements

KV_CACHE_DTYPES = {
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,  # vLLM's alias
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
KINDS = tuple(QMAX)
# The kernels' number for each kind (Triton's QUANT, the CUDA kernel's kv_quant; 0: none).
CODES = {torch.int8: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}
assert set(NAMES) == {"auto", *KV_CACHE_DTYPES}  # config's names: the ones mapped here
_TINY = 2.0 ** -126  # (an all-zero head stays zero)


def kv_cache_dtype(value) -> torch.dtype | None:
    """The 8-bit kind for a user's `kv_cache_dtype` ("auto" or None: the model's dtype,
    unquantized). Raises ValueError naming the choices."""
    if value is None or value == "auto":
        return None
    if isinstance(value, torch.dtype) and value in QMAX:
        return value
    if isinstance(value, str) and value in KV_CACHE_DTYPES:
        return KV_CACHE_DTYPES[value]
    raise ValueError(f"kv_cache_dtype must be 'auto' or one of {sorted(KV_CACHE_DTYPES)}; got "
                     f"{value!r}.")


def is_quantized(cache: torch.Tensor) -> bool:
    """Whether a layer's K or V view holds 8-bit values and scales."""
    return cache.dtype in QMAX


def stored_dim(head_dim: int, kind: torch.dtype | None) -> int:
    """Elements per head and token in a pool of `kind` (None: unquantized)."""
    return head_dim if kind is None else head_dim + SCALE_ELEMENTS


def quantize(x: torch.Tensor, kind: torch.dtype) -> torch.Tensor:
    """[..., D] float -> [..., D + 2] uint8: values in `kind` and the bfloat16 scale."""
    xf = x.float()
    qmax = QMAX[kind]
    # x (1 + 2^-7) then round to nearest: never below the exact scale (bfloat16 keeps 8 bits)
    scale = (xf.abs().amax(-1, keepdim=True) / qmax * (1 + 2.0 ** -7)).clamp(min=_TINY)
    scale = scale.to(torch.bfloat16)
    q = (xf / scale.float()).clamp(-qmax, qmax)
    q = q.round().to(torch.int8) if kind is torch.int8 else q.to(kind)
    return torch.cat([q.view(torch.uint8), scale.view(torch.uint8)], -1)


def dequantize(stored: torch.Tensor, kind: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """[..., D + 2] (uint8 or `kind`) -> [..., D] in `dtype`."""
    raw = stored.view(torch.uint8)
    values = raw[..., :-SCALE_ELEMENTS].view(kind).float()
    scale = raw[..., -SCALE_ELEMENTS:].contiguous().view(torch.bfloat16).float()
    return (values * scale).to(dtype)
