"""Falcon's attention on the paged cache.

Falcon computes attention inline in `FalconAttention.forward` instead of going through
Transformers' attention interface, so the integration replaces that forward with the one
made here, which falls back to the original whenever the cache is not a paged one (a
`PagedCache`, or an engine forward's `PagedForward`). Falcon's decoder layer passes no
keywords on to its attention, so the forward's paged KV is read from the cache it is given
(`layer_past.current_forward()`).
"""

from __future__ import annotations

import functools

import torch
from transformers.models.falcon import modeling_falcon
from transformers.models.falcon.modeling_falcon import build_alibi_tensor

from ..kernels.forward import PagedLayers
from .attention import ATTENTION_NAME, original_implementation


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """Falcon's per-head ALiBi slopes [H] (float32), read off Transformers' own builder."""
    return build_alibi_tensor(torch.ones(1, 2), num_heads, torch.float32)[:, 0, 1]


def split_qkv(module, fused_qkv: torch.Tensor):
    """fused [B, q, *] -> query [B, Hq, q, D], key and value [B, Hkv, q, D], unique KV heads only."""
    batch, q_len, _ = fused_qkv.shape
    heads, dim = module.num_heads, module.head_dim
    if module.new_decoder_architecture:
        kv_heads = module.num_kv_heads
        qkv = fused_qkv.view(batch, q_len, kv_heads, heads // kv_heads + 2, dim)
        query = qkv[:, :, :, :-2].flatten(2, 3)  # query head h reads KV head h // group
        key, value = qkv[:, :, :, -2], qkv[:, :, :, -1]
    elif module.multi_query:
        qkv = fused_qkv.view(batch, q_len, heads + 2, dim)
        query, key, value = qkv[:, :, :-2], qkv[:, :, -2:-1], qkv[:, :, -1:]
    else:
        qkv = fused_qkv.view(batch, q_len, heads, 3, dim)
        query, key, value = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
    return query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)


class ConfigView:
    """A Falcon attention module's view of its model config: "paged" reads as the model's
    own implementation before the switch ("sdpa" if it had none).

    Falcon picks its attention branch by name at every call. Under the "paged" name on one
    of Transformers' own caches it must take the branch of the implementation whose mask
    `paged_mask` made (hf/attention.py), as a stock forward does. Every other attribute, and
    every later change of the implementation, reads through to the config itself.
    """

    def __init__(self, config):
        object.__setattr__(self, "_config", config)

    @property
    def _attn_implementation(self):
        name = self._config._attn_implementation
        if name != ATTENTION_NAME:
            return name
        return original_implementation(self._config) or "sdpa"

    def __getattr__(self, name):
        if name == "_config":  # not set yet (unpickling)
            raise AttributeError(name)
        return getattr(self._config, name)

    def __setattr__(self, name, value):
        setattr(self._config, name, value)

    def __reduce__(self):
        return ConfigView, (self._config,)


def paged_falcon_attention(original):
    """Wraps `FalconAttention.forward`: paged attention on a paged cache, stock otherwise."""

    @functools.wraps(original)
    def forward(self, hidden_states, alibi, attention_mask, position_ids=None, layer_past=None,
                use_cache=False, output_attentions=False, position_embeddings=None, **kwargs):
        if not isinstance(layer_past, PagedLayers):  # a PagedCache or a PagedForward
            # Installed before any stock call, not only once switched: a paged call on another
            # thread may switch the shared config between this check and the original's read
            # of the name, which would then take the eager branch with an SDPA mask.
            if not isinstance(self.config, ConfigView):
                self.config = ConfigView(self.config)
            return original(self, hidden_states, alibi, attention_mask, position_ids=position_ids,
                            layer_past=layer_past, use_cache=use_cache,
                            output_attentions=output_attentions,
                            position_embeddings=position_embeddings, **kwargs)
        query, key, value = split_qkv(self, self.query_key_value(hidden_states))
        batch, _, q_len, dim = query.shape
        slopes = None
        if alibi is None:
            cos, sin = position_embeddings
            # (read from the module: the engine's forwards may switch it, hf/rotary.py)
            query, key = modeling_falcon.apply_rotary_pos_emb(query, key, cos, sin)
        else:
            # Transformers' sdpa path adds alibi / sqrt(head_dim) to the scores once; the
            # kernels scale the slopes' term by the scores' scale (reference.alibi_bias).
            slopes = self.__dict__.get("_hf_paged_slopes")
            if slopes is None or (slopes.device, slopes.dtype) != (query.device, query.dtype):
                slopes = alibi_slopes(self.num_heads).to(device=query.device, dtype=query.dtype)
                self.__dict__["_hf_paged_slopes"] = slopes
        layer_past.update(key, value, self.layer_idx)
        paged_kv = layer_past.current_forward()
        # A mask here was prepared by the caller (4D): for a paged cache, paged_mask gives None.
        out = paged_kv.attend(query, self.layer_idx, self.inv_norm_factor, alibi_slopes=slopes,
                              caller_mask=attention_mask)
        meta = paged_kv.meta_for(self.layer_idx)
        if (slopes is not None and meta.is_query is not None and not meta.packed
                and meta.columns == q_len):
            # Falcon-RW adds its mask as a float bias (finfo.min), so in Transformers a query
            # seeing no key (left padding) attends uniformly to every column: the mean of its
            # row's values. Reproducible in a first forward, where all those values are here.
            mean = value.mean(2).repeat_interleave(self.num_heads // value.shape[1], 1)
            out = torch.where(meta.is_query[:, :, None, None], out, mean[:, None].to(out.dtype))
        out = out.reshape(batch, q_len, self.num_heads * dim)
        return self.dense(out), None

    return forward
