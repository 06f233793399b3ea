"""Rotary embeddings whose frequencies depend on a forward's length, token by token in the
engine's packed forwards.

Transformers' `dynamic_rope_update` picks a rotary embedding's frequencies from the longest
position of each forward: LongRoPE (the Phi-3, Phi-3.5 and Phi-4 128K models) takes its long
factors once a position passes `original_max_position_embeddings`, dynamic NTK scales its base
past `max_position_embeddings`. Stock `generate` runs a request's prompt in one forward and then
a token per forward, so its token at position p has the frequencies of length
max(p + 1, prompt length). The engine packs many requests and prompt chunks into one forward,
where one long request would change every other's frequencies (and a chunk of a long prompt
would not yet see its length). In engine forwards each token gets the frequencies its own
request has in stock `generate` alone (on a fresh model: Transformers' dynamic NTK also keeps
the longest length it has seen, which the engine does not).

`use_token_rope(model)` gives each such rotary module a subclass of its class whose forward
reads the tokens' lengths that `token_rope(lengths)` sets for the calling thread around an
engine forward; everywhere else (stock and paged `generate`, other threads) it is the class's
own forward. Under torch.compile the lengths are an input of the engine's graphs.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ..core.prefix_cache import rope_namespace
from ..core.rope_switch import RopeSwitch
from ..errors import UnsupportedModelError
from ..kv.metadata import to_device
from ..utils import set_on_thread


# Model types whose generate drops its cache and computes a sequence anew once it holds more
# than `original_max_position_embeddings` tokens (their `prepare_inputs_for_generation`), so
# that LongRoPE's long factors apply to all of it.
RECOMPUTED_AT_SWITCH = frozenset({"phi3", "phimoe", "phi4_multimodal"})


def recomputes_at_switch(model) -> bool:
    return getattr(model.config, "model_type", None) in RECOMPUTED_AT_SWITCH


class TokenRope:
    """A served model's length-dependent rotary embeddings (none: nothing to do), switched
    to per-token frequencies: what the engine's forwards, prefix cache and scheduler need."""

    def __init__(self, model):
        self.rotaries = use_token_rope(model)
        # Phi-3's switch: sequences computed anew past it (core/rope_switch.py), or None.
        self.switch = None
        limit = getattr(model.config, "original_max_position_embeddings", None)  # (as generate)
        if recomputes_at_switch(model) and limit is not None \
                and any(m.rope_type == "longrope" for m in self.rotaries):
            self.switch = RopeSwitch(limit, rope_namespace(self.prompt_class(limit + 1)))

    def __bool__(self) -> bool:
        return bool(self.rotaries)

    def prompt_class(self, length: int) -> str | None:
        """What, besides its tokens, decides the K/V of a prompt of `length` tokens (a
        prefix-cache namespace part): whether LongRoPE's long factors apply to it, the
        length itself past dynamic NTK's limit; None where nothing does."""
        parts = [("long" if length > _longrope_limit(m) else "") if m.rope_type == "longrope"
                 else (str(length) if length > m.original_max_seq_len else "")
                 for m in self.rotaries]
        return ",".join(parts) if any(parts) else None

    def around(self, lengths: list[int] | None, counts: list[int], positions: torch.Tensor):
        """A context for a packed forward of rows of `counts` tokens at `positions` [N] (on
        the device), whose rotary lengths (prompt lengths, or all a sequence held when
        computed anew) are `lengths` (None: a draft model's, each token's position): each
        token's own frequencies (`token_rope`)."""
        if not self.rotaries:
            return contextlib.nullcontext()
        rows = lengths or [0] * len(counts)
        if len(counts) == positions.shape[0]:  # a token per row (decodes): nothing to repeat
            return token_rope(token_lengths(positions, to_device(rows, positions.device)))
        host = to_device(rows + counts, positions.device)
        return token_rope(token_lengths(positions, *host.view(2, -1)))


class _Thread(threading.local):
    lengths = None  # [N] int64 on the model's device, inside `token_rope()` on this thread


_THREAD = _Thread()
_SUBCLASSES: dict[type, type] = {}  # a rotary class -> its per-token subclass


def length_dependent(module) -> bool:
    """Whether `module` is a rotary embedding whose frequencies follow the forward's length."""
    rope_type = getattr(module, "rope_type", None)
    kinds = rope_type.values() if isinstance(rope_type, dict) else [rope_type]
    return hasattr(module, "original_inv_freq") and any(
        isinstance(k, str) and (k == "longrope" or "dynamic" in k) for k in kinds)


def use_token_rope(model) -> list:
    """Switches the model's length-dependent rotary embeddings to per-token frequencies in
    engine forwards; returns them. UnsupportedModelError for one that keeps such
    frequencies per layer type (`rope_type` a dict), which this does not cover."""
    found = []
    for module in model.modules():
        if not length_dependent(module):
            continue
        if isinstance(module.rope_type, dict):
            raise UnsupportedModelError(
                f"{type(module).__name__} scales its rotary frequencies by the forward's length "
                f"per layer type ({module.rope_type}); the engine cannot give each request its "
                "own. Serve it with generate(cache_implementation=\"paged\").")
        if module.rope_type == "longrope" and getattr(module, "long_inv_freq", None) is None:
            # (what stock computes on its first long forward, kept as it keeps it)
            module.long_inv_freq = ROPE_INIT_FUNCTIONS["longrope"](
                module.config, module.original_inv_freq.device,
                seq_len=_longrope_limit(module) + 1)[0]
        if type(module) not in _SUBCLASSES.values():
            module.__class__ = _subclass(type(module), module)
        found.append(module)
    return found


def token_rope(lengths: torch.Tensor):
    """Inside, switched rotary embeddings called on this thread give token i of their packed
    positions the frequencies of length lengths[i] ([N] int64: max(position + 1, the
    token's prompt length))."""
    return set_on_thread(_THREAD, "lengths", lengths)


def token_lengths(positions: torch.Tensor, row_lengths: torch.Tensor,
                  counts: torch.Tensor | None = None) -> torch.Tensor:
    """positions [N] int64 of a packed forward, its rows' rotary lengths and token counts
    [R] (None: a token per row) -> each token's length, max(position + 1, its row's) [N]."""
    if counts is not None:
        row_lengths = torch.repeat_interleave(row_lengths, counts,
                                              output_size=positions.shape[0])
    return torch.maximum(positions + 1, row_lengths)


def _longrope_limit(module) -> int:
    return module.config.rope_parameters["original_max_position_embeddings"]


def _per_token(module, x: torch.Tensor, position_ids: torch.Tensor, lengths: torch.Tensor):
    """cos, sin [1, N, dim] of packed positions [1, N], token i's from the frequencies of
    length lengths[i], with the class's own arithmetic (`inv_freq` times the position, laid
    out as the class does, times its scale)."""
    original, scale = module.original_inv_freq.to(x.device), module.attention_scaling
    if module.rope_type == "longrope":
        long = (lengths > _longrope_limit(module))[:, None]
        rope = module.config.rope_parameters
        if module._rope_scaled:  # (PhiMoE: short factors throughout, its scale by length)
            inv_freq = original
            scale = torch.where(long, rope["long_mscale"], rope["short_mscale"]).float()
        else:
            inv_freq = torch.where(long, module.long_inv_freq.to(x.device), original)
    else:  # dynamic NTK: the base grown to each length past max_position_embeddings
        grown = ROPE_INIT_FUNCTIONS[module.rope_type](module.config, x.device,
                                                      seq_len=lengths[:, None])[0]
        inv_freq = torch.where((lengths > module.original_max_seq_len)[:, None], grown, original)
    angles = _LAYOUTS[module._rope_layout](position_ids[0, :, None].float() * inv_freq.float())
    angles = angles[None]  # [1, N, dim]
    return (angles.cos() * scale).to(x.dtype), (angles.sin() * scale).to(x.dtype)


# How rotary classes lay their angles out over the head: twice over (Llama and most), as
# pairs (Cohere), or once (gpt-oss, which rotates halves itself).
_LAYOUTS = {"halves": lambda f: torch.cat((f, f), dim=-1),
            "pairs": lambda f: torch.repeat_interleave(f, 2, dim=-1),
            "once": lambda f: f}


def _layout(cls: type, module) -> tuple[str, bool]:
    """Which of `_LAYOUTS` the class's own forward takes, and whether its length scales the
    result rather than the frequencies (PhiMoE's forward: its factors stay short, and its
    `long_mscale` or `short_mscale` apply). Probed on `module` at a length under the limit
    and, for LongRoPE, one past it: the class's own forward and `_per_token` must agree bit
    for bit (dynamic NTK's grown base is Transformers' own function: probed short only).
    UnsupportedModelError where no layout does."""
    scalings = [False] + ([True] if module.rope_type == "longrope"
                          and "long_mscale" in module.config.rope_parameters else [])
    limit = _longrope_limit(module) if module.rope_type == "longrope" else \
        module.original_max_seq_len
    probes = [min(16, limit)] + ([limit + 2] if module.rope_type == "longrope" else [])
    x = torch.zeros(1, 1, 1, device=module.original_inv_freq.device)
    buffers = dict(module._buffers)
    values, state = {k: v.clone() for k, v in buffers.items() if v is not None}, \
        dict(module.__dict__)
    try:
        for name, scaled in [(name, scaled) for scaled in scalings for name in _LAYOUTS]:
            module._rope_layout, module._rope_scaled = name, scaled  # (tried, then taken off)
            if all(_agrees(cls, module, x, n) for n in probes):
                return name, scaled
    finally:  # (the class's own forward updates the module's frequencies)
        module.__dict__.clear()
        module.__dict__.update(state)
        module._buffers.clear()
        module._buffers.update(buffers)
        with torch.no_grad():
            for key, value in values.items():
                buffers[key].copy_(value)
    raise UnsupportedModelError(
        f"{cls.__name__} scales its rotary frequencies by the forward's length, and computes "
        "its angles in a way the engine does not reproduce for each request's own length. "
        "Serve it with generate(cache_implementation=\"paged\").")


def _agrees(cls, module, x: torch.Tensor, n: int) -> bool:
    positions = torch.arange(n, device=x.device)[None]
    with torch.no_grad():
        expected = cls.forward(module, x, positions)
        got = _per_token(module, x, positions, torch.full((n,), n, device=x.device))
    return all(torch.equal(a, b) for a, b in zip(got, expected))


def _subclass(cls: type, module) -> type:
    if cls not in _SUBCLASSES:
        (layout, scaled), own = _layout(cls, module), cls.forward

        def forward(self, x, position_ids, *args, **kwargs):
            lengths = _THREAD.lengths
            if lengths is None or args or kwargs or position_ids.shape[0] != 1:
                return own(self, x, position_ids, *args, **kwargs)
            return _per_token(self, x, position_ids, lengths)

        def __reduce_ex__(self, protocol):  # (pickled and copied as the class it switched)
            return _unswitched, (cls, self.__dict__)

        switched = type(f"PerToken{cls.__name__}", (cls,),
                        {"forward": forward, "__reduce_ex__": __reduce_ex__,
                         "__module__": cls.__module__, "_rope_layout": layout,
                         "_rope_scaled": scaled})
        _SUBCLASSES[cls] = switched
    return _SUBCLASSES[cls]


def _unswitched(cls: type, state: dict):
    """A switched rotary module rebuilt (unpickled, copied) as its own class."""
    module = cls.__new__(cls)
    module.__setstate__(dict(state))
    return module
