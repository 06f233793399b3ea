"""Tiny random models of the decoder architectures Transformers serves through its attention
interface, each with its distinctive features switched on (sliding-window layer patterns,
logit soft-capping, attention sinks, custom scaling, latent KV, MoE, partial / no RoPE)."""

from __future__ import annotations

import torch
import transformers

from conftest import BOS, EOS, PAD, VOCAB, sharpen_and_check

WINDOW = 6  # sliding windows short enough that the tests' sequences pass them

_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
             pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS, tie_word_embeddings=False)

_MOE = dict(num_local_experts=4, num_experts_per_tok=2)

# name -> (config class, model class, config overrides; "seed": the weights' seed where the
# default one gives a degenerate continuation)
ARCHITECTURES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen2_sliding": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW,
        max_window_layers=1)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=32)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        num_hidden_layers=4, head_dim=16, sliding_window=WINDOW, attn_logit_softcapping=5.0,
        final_logit_softcapping=None, query_pre_attn_scalar=24)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=6, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=20,
        layer_types=["sliding_attention"] * 5 + ["full_attention"])),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(partial_rotary_factor=0.5)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        num_hidden_layers=4, head_dim=16, sliding_window=WINDOW, **_MOE,
        layer_types=["sliding_attention", "full_attention"] * 2)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(
        attention_multiplier=0.3, embedding_multiplier=2.0, residual_multiplier=0.7,
        logits_scaling=0.5)),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(sliding_window=WINDOW)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(**_MOE, sliding_window=WINDOW)),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(
        num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0])),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", dict(
        num_hidden_layers=4, sliding_window=WINDOW,
        layer_types=["sliding_attention"] * 3 + ["full_attention"])),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(rotary_pct=0.25, seed=1)),
    "phi": ("PhiConfig", "PhiForCausalLM", dict(partial_rotary_factor=0.5)),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", dict(head_dim=16)),
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", dict(
        num_hidden_layers=4, sliding_window=WINDOW,
        layer_types=["sliding_attention"] * 3 + ["full_attention"])),
    "ministral": ("MinistralConfig", "MinistralForCausalLM", dict(
        num_hidden_layers=3, sliding_window=WINDOW, head_dim=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"])),
    # Their attention modules pass no window: the model applies it through the mask only.
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW,
        max_window_layers=1, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32)),
    "phimoe": ("PhimoeConfig", "PhimoeForCausalLM", dict(sliding_window=WINDOW, **_MOE)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        num_key_value_heads=4, kv_lora_rank=24, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1, seed=1)),
    # Grouped KV heads named in a sub-config (attn_config.kv_n_heads), clipped QKV.
    "dbrx": ("DbrxConfig", "DbrxForCausalLM", dict(d_model=64,
        attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
        ffn_config=dict(ffn_hidden_size=96, moe_num_experts=4, moe_top_k=2))),
}
NAMES = list(ARCHITECTURES)


def make_arch(name: str, seed: int = 0, **overrides):
    """A tiny random model of architecture `name` (see ARCHITECTURES), eval mode, sharpened
    logits, checked to give a varied greedy continuation."""
    config_cls, model_cls, extra = ARCHITECTURES[name]
    kwargs = {**_BASE, **extra, **overrides}
    torch.manual_seed(seed + kwargs.pop("seed", 0))
    config = getattr(transformers, config_cls)(**kwargs)
    model = getattr(transformers, model_cls)(config)
    return sharpen_and_check(model, name)
