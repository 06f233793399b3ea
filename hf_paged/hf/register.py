"""What both paths need registered in Transformers: the "paged" attention and mask functions,
and Falcon's attention (which does not go through the attention interface); and what the
engine switches in its model's modeling modules: Llama's rotary application (hf/rotary.py)."""

from __future__ import annotations

import contextlib
import sys

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface
from transformers.models.falcon import modeling_falcon
from transformers.models.falcon.modeling_falcon import FalconAttention, FalconFlashAttention2

from .attention import ATTENTION_NAME, paged_attention_forward, paged_mask
from . import rotary
from .falcon import paged_falcon_attention

_originals: dict[tuple[object, str], object] = {}  # (class or module, name) -> original


def register() -> None:
    """Registers "paged" with Transformers and wraps Falcon's attention (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, paged_mask)
    # Falcon picks its attention class by name when built (from_pretrained(..., "paged")).
    modeling_falcon.FALCON_ATTENTION_CLASSES[ATTENTION_NAME] = FalconAttention
    for owner in (FalconAttention, FalconFlashAttention2):
        if (owner, "forward") not in _originals:
            original = owner.__dict__["forward"]
            _originals[owner, "forward"] = original
            owner.forward = paged_falcon_attention(original)


def switch_rotary(model, device: torch.device):
    """Gives each modeling module of `model` whose `apply_rotary_pos_emb` is Llama's the
    engine's switched one (`rotary.fused`; `unregister` undoes it), for a model whose
    inputs are on the CPU (`device`) where the CPU kernels can be had. Returns the context
    its forwards run in: `rotary.fused_rotary` where a module has it, else a null one."""
    if device.type != "cpu" or rotary.kernel() is None:
        return contextlib.nullcontext
    switched = False
    for name in {type(m).__module__ for m in model.modules()}:
        module = sys.modules.get(name)
        if (module, "apply_rotary_pos_emb") not in _originals:
            if module is None or not rotary.is_llamas(module):
                continue
            own = _originals[module, "apply_rotary_pos_emb"] = module.apply_rotary_pos_emb
            module.apply_rotary_pos_emb = rotary.fused(own)
        switched = True
    return rotary.fused_rotary if switched else contextlib.nullcontext


def unregister() -> None:
    for (owner, name), original in _originals.items():
        setattr(owner, name, original)
    _originals.clear()
    ALL_ATTENTION_FUNCTIONS._global_mapping.pop(ATTENTION_NAME, None)
    ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.pop(ATTENTION_NAME, None)
    modeling_falcon.FALCON_ATTENTION_CLASSES.pop(ATTENTION_NAME, None)


def is_registered() -> bool:
    return ATTENTION_NAME in ALL_ATTENTION_FUNCTIONS._global_mapping
