"""Whether a model's layers really hand the paged KV to the attention: one forward of one
token on a scratch pool, once per model class and KV layout.

A class can say it uses the attention interface and still not let the paged KV through:
a decoder layer that drops the forward's keywords before its attention (Nemotron), or an
attention that re-lays its keys or values out after the cache update (JetMoE repeats its
keys, DiffLlama splits its values in two). Those
raise `PagedRouteError` on the way; the probe turns that into a reason, so that generate
falls back to Transformers' cache with a warning and the engine refuses the model by
name, before any real request runs.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from ..errors import PagedRouteError
from ..kernels.dispatch import PoolAccess
from ..kv.metadata import build_metadata, to_device
from ..kv.placement import Placement, group_layers
from ..kv.pool import KVPool
from .architectures import attention_tp_size, kv_spec, tp_heads
from .attention import KWARG
from .switch import paged_attention

# (class, KV layout, input device) -> verdict: models of one class with different layouts
# (heads, head sizes, windows), or placed apart, are probed apart.
_checked: dict[tuple, str | None] = {}
_lock = threading.Lock()


def route_reason(model, placement=None, device=None) -> str | None:
    """Why the paged KV does not reach `model`'s attention (a sentence), or None.

    placement: where its layers are (a model spread by `device_map`), or a function giving
    it (called only when the class is probed); default: `device`. device: where it takes
    its inputs (for a model whose embeddings are offloaded to "meta", the execution device
    of accelerate's hooks); default: its input embeddings' device. A model in training
    mode is not probed (its forward would draw random numbers for dropout); its class is
    probed at its first call in eval mode. A probe that fails for another reason gives
    that as the reason: such a model cannot run paged.
    """
    # (Callers ask `unsupported_reason` first, which refuses a layout kv_spec cannot read.)
    device = device or model.get_input_embeddings().weight.device
    key = (type(model), kv_spec(model.config), attention_tp_size(model), device)
    if key in _checked:
        return _checked[key]
    if model.training:
        return None
    with _lock:
        if key not in _checked:
            _checked[key] = _probe(model, placement() if callable(placement) else placement,
                                   device)
    return _checked[key]


def _probe(model, placement: Placement | None, device: torch.device) -> str | None:
    text = model.config.get_text_config(decoder=True)
    spec = kv_spec(text)
    heads, kv_heads = tp_heads(text, attention_tp_size(model))
    groups, where = group_layers(spec.windows, placement, device)
    block_size = 16
    pool = KVPool(groups.slots, kv_heads, spec.head_dim, block_size, 1, model.dtype, where,
                  growable=False, v_head_dim=spec.v_head_dim)
    access = PoolAccess(pool, "torch", heads, spec.windows, spec.latent, groups=groups)
    table = torch.zeros(1, 1, dtype=torch.int32, device=pool.device)
    context = to_device([0], pool.device)
    metas = [build_metadata(table, context, [1], 1, 1, block_size, packed=True)
             for _ in range(groups.num_groups)]
    paged_kv = access.forward(metas[0], group_metas=metas)
    waiting = _track_layers(paged_kv)
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    try:
        with torch.no_grad(), paged_attention(model), _without_call_hooks(model), \
                _state_kept(model):
            model(input_ids=ids, position_ids=torch.zeros_like(ids), past_key_values=paged_kv,
                  use_cache=True, **{KWARG: paged_kv})
    except PagedRouteError as err:
        return (f"{type(model).__name__}'s layers do not hand the paged KV to the attention "
                f"as Transformers' attention interface does ({err})")
    except Exception as err:  # noqa: BLE001 - whatever stops one token stops generation
        if waiting:  # it failed between a layer's cache update and that layer's attention
            return (f"layer {min(waiting)} of {type(model).__name__} failed after its "
                    "cache update and before its attention, computing on what the update "
                    "returned: a paged cache returns the layer's pool blocks ([blocks, "
                    "block_size, heads, dim]), not the sequence's keys and values "
                    f"({type(err).__name__}: {err})")
        return (f"a one-token forward of {type(model).__name__} on the paged cache failed "
                f"({type(err).__name__}: {err})")
    return None


def _track_layers(paged_kv) -> set[int]:
    """The layers whose cache update `paged_kv` served and whose attention it has not
    (yet) run, kept up to date by its calls."""
    waiting: set[int] = set()
    update, attend = paged_kv.update, paged_kv.attend

    def tracked_update(key, value, layer_idx, *args, **kwargs):
        out = update(key, value, layer_idx, *args, **kwargs)  # (an update that raises: not
        waiting.add(layer_idx)  # the layer's doing after it)
        return out

    def tracked_attend(query, layer_idx, *args, **kwargs):
        waiting.discard(layer_idx)
        return attend(query, layer_idx, *args, **kwargs)

    paged_kv.update, paged_kv.attend = tracked_update, tracked_attend
    return waiting


@contextlib.contextmanager
def _state_kept(model):
    """What a forward changes in its modules goes back as it was after the probe: it is the
    state the caller's own forwards left (a dynamic-NTK rotary embedding grows its
    frequencies with the longest input so far, and a one-token forward resets them)."""
    saved = [(m, dict(m._buffers), {k: v for k, v in vars(m).items() if not k.startswith("_")})
             for m in model.modules()]
    try:
        yield
    finally:
        for module, buffers, attributes in saved:
            module._buffers.clear()
            module._buffers.update(buffers)
            for name in [k for k in vars(module) if not k.startswith("_")]:
                if name not in attributes:
                    delattr(module, name)
            vars(module).update(attributes)


@contextlib.contextmanager
def _without_call_hooks(model):
    """Forward pre-hooks that rewrite a call's keywords are set aside during the probe: they
    belong to the call that is running (PEFT's mixed-adapter batches give every LoRA layer
    the batch's `adapter_names`, one per row, which a one-token probe does not have)."""
    parked = []
    for module in model.modules():
        hooks = module._forward_pre_hooks
        if any(i in module._forward_pre_hooks_with_kwargs for i in hooks):
            parked.append((module, dict(hooks)))  # (restored in their order)
            for i in [i for i in hooks if i in module._forward_pre_hooks_with_kwargs]:
                del hooks[i]
    try:
        yield
    finally:
        for module, hooks in parked:
            module._forward_pre_hooks.clear()
            module._forward_pre_hooks.update(hooks)
