"""The "paged" attention implementation and its mask function, as Transformers calls them.

A paged forward hands the attention its KV explicitly: the `paged_kv` keyword (a
`PagedForward`), which Transformers passes from the model's forward down to the attention
interface. The engine passes it itself; generate's forwards get it from the patched base
model forward (generate/patches.py). Without it, this is Transformers' SDPA attention.

Masks: a paged cache answers `get_mask_sizes` with 0 keys (`NO_MASK`), and the mask function
then returns None: the metadata has the lengths. A 4D mask the caller prepared skips mask
creation and reaches the attention, which honours it.

Any other forward (another cache, no cache, training) runs the mask and attention functions
of the implementation the model had before it was switched to "paged" (hf/switch.py), so
that a stock forward gives the same result whichever name it reads, even as another thread
switches the shared config. A model loaded as "paged" has no other: it runs SDPA's.
"""

from __future__ import annotations

import sys
import weakref

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..errors import HFPagedError, PagedRouteError
from ..kernels.forward import PagedForward
from ..kv.pool import is_pool_view

ATTENTION_NAME = "paged"
KWARG = "paged_kv"  # the forward keyword that carries a PagedForward to the attention

# id(config) -> the attention implementation it had when last switched to "paged" (kept
# after the switch ends: a stock forward may still be between its mask and its attention)
_originals: dict[int, str] = {}
_held: set[int] = set()  # ids of the configs a switch holds at "paged" now


def remember_original(config, implementation: str | None) -> None:
    """A switch sets `config` to "paged" from `implementation` and holds it there, until
    `let_go` (a switch for good never lets go)."""
    if implementation and implementation != ATTENTION_NAME:
        if id(config) not in _originals:
            weakref.finalize(config, _forget, id(config))
        _originals[id(config)] = implementation
        _held.add(id(config))


def let_go(config) -> None:
    _held.discard(id(config))


def _forget(config_id: int) -> None:
    _originals.pop(config_id, None)
    _held.discard(config_id)


def original_implementation(config) -> str | None:
    """The implementation `config` had before "paged"; None if it never had another."""
    return _originals.get(id(config))


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    paged_kv: PagedForward | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Transformers attention interface: query [B, Hq, q, D] -> (out [B, q, Hq, Dv], None).

    paged_kv: the forward's paged KV; `key`/`value` are then the layer's pool views (or, for
    a latent KV, keys expanded from its rows' tokens) and its metadata says where each row's
    tokens are. A mask reaching here is the caller's (4D). Each layer passes its own
    sliding_window, softcap (Gemma 2) and s_aux sink logits (gpt-oss).
    """
    if paged_kv is not None:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return paged_kv.attend(query, module.layer_idx, scale, sliding_window,
                               caller_mask=attention_mask, softcap=softcap, sinks=s_aux,
                               key=key, value=value, eager=_eager_empty(module, paged_kv,
                                                                        attention_mask)), None
    if is_pool_view(key):
        raise PagedRouteError(
            f"Layer {module.layer_idx} got a paged KV pool's keys without the forward's "
            f"metadata (the `{KWARG}` keyword did not reach the attention). This model's "
            "attention layers do not pass the forward's keywords on to the attention "
            "function; it is not supported on the paged cache."
        )
    passed = {name: value for name, value in (("sliding_window", sliding_window),
              ("softcap", softcap), ("s_aux", s_aux)) if value is not None}
    original = original_implementation(module.config)
    # the model's own implementation, picked and called as its attention layers do
    own = None if original is None else ALL_ATTENTION_FUNCTIONS.get_interface(
        original, _module_eager(module))
    if own is not None:
        return own(module, query, key, value, attention_mask, dropout=dropout,
                   scaling=scaling, **passed, **kwargs)
    if softcap is not None or s_aux is not None:  # beyond SDPA: the model's own eager path
        return _eager(module, query, key, value, attention_mask, dropout=dropout,
                      scaling=scaling, **passed, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, **passed, **kwargs)


def _eager_empty(module, paged_kv: PagedForward, caller_mask) -> bool:
    """Whether a query that sees no key follows eager attention (`PagedForward.attend`).
    Only forwards where one can (hidden slots, a caller's mask) look further: the engine's,
    which torch.compile traces, return at the first test."""
    if caller_mask is None and not paged_kv.hides_keys:
        return False
    # Only while a switch holds the config: one its owner set to "paged" has no other.
    held = id(module.config) in _held
    return held and original_implementation(module.config) == "eager"


def _module_eager(module):
    """The modeling module's own `eager_attention_forward` (None if it has none)."""
    return getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)


def _eager(module, query, key, value, attention_mask, **kwargs):
    """The modeling module's own `eager_attention_forward` (which applies its softcap or
    sinks), with the boolean SDPA mask made additive as eager attention adds it."""
    eager = _module_eager(module)
    if eager is None:
        raise HFPagedError(f"{type(module).__name__} passes softcap or s_aux to its attention "
                           "but its module has no eager_attention_forward to run them.")
    q_len, k_len = query.shape[2], key.shape[2]
    if attention_mask is None and q_len > 1 and getattr(module, "is_causal", True):
        # SDPA's mask function returns None where SDPA may run `is_causal` instead; eager
        # attention has no such flag, so the causal mask is spelled out (bottom-right).
        attention_mask = torch.ones(q_len, k_len, dtype=torch.bool,
                                    device=query.device).tril(k_len - q_len)[None, None]
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        attention_mask = torch.zeros(attention_mask.shape, dtype=query.dtype,
                                     device=query.device).masked_fill(
            ~attention_mask, torch.finfo(query.dtype).min)
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is None:
            kwargs.pop(name, None)
    return eager(module, query, key, value, attention_mask, **kwargs)


def paged_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """Mask interface: None for a forward on a paged cache (which reports 0 keys to mask),
    the mask of the model's own implementation (SDPA's if it has none) for any other."""
    if kv_length == 0:
        return None
    original = original_implementation(kwargs.get("config"))
    if original is not None:
        if original not in ALL_MASK_ATTENTION_FUNCTIONS:
            return None  # (as Transformers skips mask creation for such an implementation)
        return ALL_MASK_ATTENTION_FUNCTIONS[original](
            batch_size, q_length, kv_length, q_offset, kv_offset,
            attention_mask=attention_mask, **kwargs)
    return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset,
                     attention_mask=attention_mask, **kwargs)
