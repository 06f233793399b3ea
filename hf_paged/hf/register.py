"""What both paths need registered in Transformers: the "paged" attention and mask functions,
and Falcon's attention (which does not go through the attention interface)."""

from __future__ import annotations

from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface
from transformers.models.falcon import modeling_falcon
from transformers.models.falcon.modeling_falcon import FalconAttention, FalconFlashAttention2

from .attention import ATTENTION_NAME, paged_attention_forward, paged_mask
from .falcon import paged_falcon_attention

_originals: dict[tuple[type, str], object] = {}


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


def unregister() -> None:
    for (owner, name), original in _originals.items():
        setattr(owner, name, original)
    _originals.clear()
    ALL_ATTENTION_FUNCTIONS._global_mapping.pop(ATTENTION_NAME, None)
    ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.pop(ATTENTION_NAME, None)
    modeling_falcon.FALCON_ATTENTION_CLASSES.pop(ATTENTION_NAME, None)


def is_registered() -> bool:
    return ATTENTION_NAME in ALL_ATTENTION_FUNCTIONS._global_mapping
