"""Per-architecture facts, read from the model's structure and config: whether the paged
cache can serve it, how its KV is laid out, and each layer's attention window.

A causal LM is served when its attention goes through Transformers' attention interface
(`_supports_attention_backend`) and every layer is a full or sliding-window attention layer
that updates a standard `Cache`; Falcon, whose attention is inline, has its own wrapper
(`falcon.py`). Anything else gets a named reason (`unsupported_reason`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from transformers.models.falcon.modeling_falcon import FalconForCausalLM, FalconModel
from transformers.models.llama.modeling_llama import LlamaForCausalLM, LlamaModel
from transformers.models.mistral.modeling_mistral import MistralForCausalLM, MistralModel

from ..errors import UnsupportedModelError

# Wrapped when hf-paged is enabled, so that their forwards take a PagedCache even before any
# generate() call has seen them; every other served class is wrapped at first use.
EAGER_MODELS = (LlamaForCausalLM, MistralForCausalLM, FalconForCausalLM,
                LlamaModel, MistralModel, FalconModel)
# The architectures the test suite runs against stock Transformers (README's table).
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "FalconForCausalLM", "Qwen2ForCausalLM",
    "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM",
    "Gemma3ForCausalLM", "Phi3ForCausalLM", "GptOssForCausalLM", "Olmo2ForCausalLM",
    "GraniteForCausalLM", "Starcoder2ForCausalLM", "MixtralForCausalLM",
    "SmolLM3ForCausalLM", "Cohere2ForCausalLM", "GPTNeoXForCausalLM", "PhiForCausalLM",
    "Glm4ForCausalLM", "Exaone4ForCausalLM", "MinistralForCausalLM",
    "DeepseekV3ForCausalLM", "Qwen2MoeForCausalLM", "PhimoeForCausalLM", "DbrxForCausalLM",
)
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")


def unsupported_reason(model) -> str | None:
    """Why the paged cache cannot serve `model` (a sentence naming the class), or None."""
    from transformers import GenerationMixin

    name = type(model).__name__
    config = getattr(model, "config", None)
    if config is None or not isinstance(model, GenerationMixin):
        if isinstance(getattr(model, "_orig_mod", None), GenerationMixin):  # torch.compile's
            return (f"{name} is torch.compile's wrapper of a {type(model._orig_mod).__name__}"
                    "; pass the model itself (the engine compiles its own forward with "
                    "LLM(..., compile=True))")
        return f"{name} is not a Transformers generative model"
    if getattr(config, "is_encoder_decoder", False):
        return f"{name} is an encoder-decoder model; the paged cache serves decoder-only models"
    text = config.get_text_config(decoder=True)
    if text is not config:
        return (f"{name} is a multimodal model; the paged cache serves text decoders (its "
                "causal attention would be wrong over bidirectionally attended inputs)")
    if isinstance(model, FalconForCausalLM):
        from .attention import original_implementation  # (attention imports the kernels)

        loaded = config._attn_implementation  # (what it had before a switch, during one;
        if loaded == "paged":  # a model sharing the config may have set another since)
            loaded = original_implementation(config) or loaded
        if config.alibi and loaded == "eager":
            return (f"{name} with ALiBi loaded with attn_implementation='eager': Transformers' "
                    "eager Falcon adds the ALiBi term twice (in its mask and to its scores), "
                    "its SDPA once, as the paged attention does; load it with "
                    "attn_implementation='sdpa'")
        return None
    other = sorted(set(getattr(text, "layer_types", None) or ()) - set(ATTENTION_LAYER_TYPES))
    if other:
        return (f"{name} has {', '.join(other)} layers; the paged cache serves models whose "
                "layers are all full or sliding-window attention (linear-attention, "
                "state-space and convolution layers keep a state of another kind, and "
                "sparse, compressed or chunked attention picks its keys by rules of its own)")
    if getattr(model, "_is_stateful", False):
        return f"{name} carries recurrent state, which a KV cache of blocks cannot hold"
    if not getattr(model, "_supports_attention_backend", False):
        return (f"{name} does not declare that its attention runs on Transformers' "
                "attention backends (its class's _supports_attention_backend), of which the "
                "paged attention is one")
    # Cached self-attention (a layer_idx) that attends both ways: BERT-style heads without
    # is_decoder=True. Neither a decoder's cross-attention (to encoder states a causal LM
    # never gets) nor an uncached encoder (a vision tower's) counts.
    bidirectional = sorted({type(m).__name__ for path, m in model.named_modules()
                            if getattr(m, "is_causal", None) is False
                            and hasattr(m, "layer_idx")
                            and not any(c in path for c in ("cross", "encoder_attn"))})
    if bidirectional:
        return (f"{name}'s attention is bidirectional ({bidirectional[0]}.is_causal is False), "
                "and the paged attention is causal")
    if getattr(text, "num_kv_shared_layers", 0):
        return f"{name}'s layers share other layers' KV caches, which the paged cache does not"
    if "past_key_values" not in inspect.signature(type(model).forward).parameters:
        return f"{name}.forward takes no past_key_values"
    try:
        kv_spec(text)
    except Exception as err:  # noqa: BLE001 - e.g. Gemma 4's head_dim differs per layer
        return (f"{name}'s layers do not share one KV shape (heads and head size), which one "
                f"pool of equal blocks needs ({type(err).__name__}: {err})")
    # (MiMo-V2-Flash's sliding layers hold twice the KV heads of its full ones, by its code)
    widths = {getattr(m.k_proj, "out_features", None) for m in model.modules()
              if hasattr(m, "layer_idx") and hasattr(m, "k_proj")} - {None}
    if len(widths) > 1:
        return (f"{name}'s layers do not share one KV shape (keys of {sorted(widths)} "
                "features per token), which one pool of equal blocks needs")
    return None


def is_supported(model) -> bool:
    return unsupported_reason(model) is None


def check_supported(model) -> None:
    """Raises `UnsupportedModelError` with the reason when `model` cannot be served."""
    reason = unsupported_reason(model)
    if reason is not None:
        raise UnsupportedModelError(f"{reason}.")


@dataclass(frozen=True)
class KVSpec:
    """What one token of a decoder stores per layer, and each layer's window.

    num_kv_heads, head_dim, v_head_dim: the heads and sizes of what a layer's `update`
    receives (keys [B, Hkv, q, head_dim], values [B, Hkv, q, v_head_dim]).
    latent: the layers cache a compressed latent that the attention expands into keys and
    values itself (multi-head latent attention, as Transformers runs DeepSeek-V2/V3): the
    cache then hands each layer its rows' stored tokens back in full, not pool views.
    windows: per layer, its sliding window (None: full attention).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    latent: bool
    windows: tuple[int | None, ...]


def layer_windows(config) -> tuple[int | None, ...]:
    """Each layer's sliding window: from `layer_types` where the config has them, else the
    model-wide `sliding_window` (Mistral, Mixtral, Phi-3, Starcoder2)."""
    layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None) or None
    if getattr(config, "model_type", None) == "falcon":
        return (None,) * layers
    types = getattr(config, "layer_types", None)
    if types:  # (assistant_early_exit lowers num_hidden_layers for its drafts, not layer_types)
        return tuple(window if t == "sliding_attention" else None for t in types[:layers])
    if getattr(config, "use_sliding_window", True) is False:
        return (None,) * layers
    return (window,) * layers


def kv_spec(config) -> KVSpec:
    """The KV layout of a decoder config (its text config for a composite one)."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    heads = config.num_attention_heads
    windows = layer_windows(config)
    if getattr(config, "kv_lora_rank", None) and getattr(config, "qk_rope_head_dim", None):
        # MLA: `update` gets the normalized latent [B, 1, q, kv_lora_rank] as keys and the
        # rotated shared key [B, 1, q, qk_rope_head_dim] as values.
        return KVSpec(config.num_hidden_layers, 1, config.kv_lora_rank,
                      config.qk_rope_head_dim, True, windows)
    if getattr(config, "model_type", None) == "falcon":
        # new_decoder_architecture broadcasts its num_kv_heads to every query head before
        # caching; we store the unique heads only. multi_query has one KV head.
        if config.new_decoder_architecture:
            kv_heads = config.num_kv_heads
        elif config.multi_query:
            kv_heads = 1
        else:
            kv_heads = heads
        dim = config.hidden_size // heads
        return KVSpec(config.num_hidden_layers, kv_heads, dim, dim, False, windows)
    # Only a config class that declares it has grouped KV heads (GPT-NeoX keeps any such
    # keyword it is given without using it).
    declared = ("num_key_value_heads" in getattr(type(config), "__dataclass_fields__", {})
                or "num_key_value_heads" in getattr(config, "attribute_map", {}))
    kv_heads = (getattr(config, "num_key_value_heads", None) if declared else None) or heads
    # DBRX keeps its attention's settings in a sub-config.
    kv_heads = getattr(getattr(config, "attn_config", None), "kv_n_heads", None) or kv_heads
    if getattr(config, "multi_query", False):  # GPT-BigCode: one KV head for every query head
        kv_heads = 1
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    # Values narrower or wider than keys without a latent (MiMo-V2-Flash).
    v_head_dim = getattr(config, "v_head_dim", None) or head_dim
    return KVSpec(config.num_hidden_layers, kv_heads, head_dim, v_head_dim, False, windows)


def kv_layout(config) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads actually stored, key head_dim) of a decoder config."""
    spec = kv_spec(config)
    return spec.num_layers, spec.num_kv_heads, spec.head_dim


def tp_heads(config, tp_size: int) -> tuple[int, int]:
    """(query heads, KV heads stored) on one rank of a model split over `tp_size` ranks by
    Transformers' tensor parallelism (attention projections split by whole heads; a latent
    KV is one head every rank keeps whole)."""
    heads = config.num_attention_heads
    spec = kv_spec(config)
    kv_heads = spec.num_kv_heads
    if tp_size == 1:
        return heads, kv_heads
    if heads % tp_size or (kv_heads % tp_size and not spec.latent):
        raise UnsupportedModelError(
            f"Tensor parallelism over {tp_size} ranks splits attention by heads: this model "
            f"has {heads} query and {kv_heads} KV heads, which do not divide by {tp_size}. "
            "Use a world size that divides both."
        )
    return heads // tp_size, kv_heads if spec.latent else kv_heads // tp_size


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


def attention_features(model) -> frozenset[str]:
    """What `model`'s attention layers ask of the attention function beyond masked softmax:
    "softcap" (tanh soft-capping of the scores, Gemma 2) and "sinks" (per-head sink logits,
    gpt-oss), read from the attention modules themselves."""
    import torch

    found = set()
    for module in model.modules():
        if not hasattr(module, "layer_idx"):
            continue
        if getattr(module, "attn_logit_softcapping", None) is not None:
            found.add("softcap")
        if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
            found.add("sinks")
    return frozenset(found)


def model_features(model) -> list[str]:
    """What sets `model`'s layers apart from plain causal attention, in words (the README's
    supported-models table is made from this): the layer windows, what its attention
    passes, its KV layout, and what the cache needs nothing for (MoE, RoPE variants)."""
    config = model.config.get_text_config(decoder=True)
    spec = kv_spec(config)
    features = []
    sliding = sum(w is not None for w in spec.windows)
    if sliding == len(spec.windows) and sliding:
        features.append("sliding window")
    elif sliding:
        features.append(f"sliding-window and full layers ({sliding}:{len(spec.windows) - sliding})")
    found = attention_features(model)
    if "softcap" in found:
        features.append("logit soft-capping")
    if "sinks" in found:
        features.append("attention sinks")
    if spec.latent:
        features.append("latent KV (MLA)")
    elif spec.num_kv_heads < config.num_attention_heads:
        features.append("grouped KV heads")
    names = {type(m).__name__.lower() for m in model.modules()}
    attrs = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    if any(getattr(m, "scaling", None) not in (None, getattr(m, "head_dim", 0) ** -0.5)
           for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "head_dim")
           and getattr(m, "head_dim", 0)):
        features.append("custom attention scaling")
    if {"q_norm", "k_norm"} <= attrs or {"q_layernorm", "k_layernorm"} <= attrs:
        features.append("QK norm")
    if any("expert" in n or "moe" in n for n in names):
        features.append("MoE")
    rope = getattr(config, "rope_parameters", None) or {}
    rotary = (getattr(config, "partial_rotary_factor", None)
              or (rope.get("partial_rotary_factor") if isinstance(rope, dict) else None))
    if rotary and rotary < 1:
        features.append("partial RoPE")
    if 0 in (getattr(config, "no_rope_layers", None) or ()):
        features.append("layers without RoPE")
    if getattr(config, "alibi", False):
        features.append("ALiBi")
    return features


def forward_owner(module) -> type | None:
    """The class in `module`'s MRO that defines its forward, when it takes past_key_values."""
    for cls in type(module).__mro__:
        forward = cls.__dict__.get("forward")
        if forward is not None:
            params = inspect.signature(forward).parameters
            return cls if "past_key_values" in params else None
    return None
