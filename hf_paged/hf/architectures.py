"""Per-architecture facts: which models are supported and how their KV heads are laid out."""

from __future__ import annotations

from transformers.models.falcon.modeling_falcon import FalconForCausalLM, FalconModel
from transformers.models.llama.modeling_llama import LlamaForCausalLM, LlamaModel
from transformers.models.mistral.modeling_mistral import MistralForCausalLM, MistralModel

from ..errors import UnsupportedModelError

SUPPORTED_MODELS = (LlamaForCausalLM, MistralForCausalLM, FalconForCausalLM)
SUPPORTED_ARCHITECTURES = tuple(cls.__name__ for cls in SUPPORTED_MODELS)
# The decoder stacks under them (called directly, or by a head whose forward an accelerate
# hook captured before hf-paged was imported).
BASE_MODELS = (LlamaModel, MistralModel, FalconModel)


def is_supported(model) -> bool:
    return isinstance(model, SUPPORTED_MODELS)


def kv_layout(config) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads actually stored, head_dim) of a decoder config."""
    heads = config.num_attention_heads
    if getattr(config, "model_type", None) == "falcon":
        # new_decoder_architecture broadcasts its num_kv_heads to every query head before
        # caching; we store the unique heads only. multi_query has one KV head.
        if config.new_decoder_architecture:
            kv_heads = config.num_kv_heads
        elif config.multi_query:
            kv_heads = 1
        else:
            kv_heads = heads
        return config.num_hidden_layers, kv_heads, config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_dim


def tp_heads(config, tp_size: int) -> tuple[int, int]:
    """(query heads, KV heads stored) on one rank of a model split over `tp_size` ranks by
    Transformers' tensor parallelism (attention projections split by whole heads)."""
    heads = config.num_attention_heads
    kv_heads = kv_layout(config)[1]
    if tp_size == 1:
        return heads, kv_heads
    if heads % tp_size or kv_heads % tp_size:
        raise UnsupportedModelError(
            f"Tensor parallelism over {tp_size} ranks splits attention by heads: this model "
            f"has {heads} query and {kv_heads} KV heads, which do not divide by {tp_size}. "
            "Use a world size that divides both."
        )
    return heads // tp_size, kv_heads // tp_size


def attention_tp_size(model) -> int:
    """The ranks `model`'s attention heads are split over by Transformers' tensor
    parallelism: `model.tp_size`, or 1 when it runs alone or its plan leaves the key
    projections whole (Transformers' own rule for its caches)."""
    tp_size = getattr(model, "tp_size", None) or 1
    if tp_size == 1:
        return 1
    from transformers.distributed.tensor_parallel import get_kv_heads_per_rank

    heads = kv_layout(model.config.get_text_config(decoder=True))[1]
    per_rank = get_kv_heads_per_rank(getattr(model, "tp_plan", None) or {}, heads, tp_size)
    return 1 if per_rank == heads else tp_size
