"""The interface every attention backend implements, and what each one declares it covers.

A backend works on the pool layout of `reference.py` (per layer, K and V of
[num_blocks, block_size, Hkv, D]) and does three things: store new tokens through a slot
mapping, copy blocks (copy-on-write), and compute one forward's attention from its
`ForwardMetadata`. What a backend cannot do is declared in `Capabilities`, and the
dispatcher (`dispatch.py`) sends those forwards to the PyTorch reference: no backend
checks for itself whether it should have been called.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..kv.metadata import ForwardMetadata


@dataclass(frozen=True)
class Capabilities:
    """What a backend computes itself.

    hidden_slots:  reads `meta.key_hidden` (stored slots no query may see: a mask that
                   hides columns after a row's first real token)
    caller_mask:   honours a caller's 4D attention mask instead of causal masking
    varlen_queries: rows with more than one new token (prefill, chunked prefill, extend)
    softcap:       tanh soft-capping of the scores (`softcap=`, Gemma 2)
    sinks:         a per-head sink logit in the softmax denominator (`s_aux=`, gpt-oss)
    value_dim:     values of another size than keys (a latent KV's pool)
    dtypes:        pool dtypes it runs on     } checked when a backend is chosen for a
    devices:       device types it runs on    } pool (backends.select_backend)
    kv_dtypes:     8-bit K/V kinds it reads and writes (kv/quant.py; checked by PoolAccess)
    """

    hidden_slots: bool = False
    caller_mask: bool = False
    varlen_queries: bool = True
    softcap: bool = False
    sinks: bool = False
    value_dim: bool = False
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
    devices: tuple[str, ...] = ("cuda",)
    kv_dtypes: tuple[torch.dtype, ...] = ()

    def covers(self, meta: ForwardMetadata, caller_mask: bool) -> bool:
        """Whether a forward with this metadata (and a caller's mask or not) is covered."""
        if caller_mask and not self.caller_mask:
            return False
        if not self.varlen_queries and meta.query_pos.shape[1] > 1:
            return False
        return self.hidden_slots or meta.key_hidden is None

    def missing(self, softcap: bool, sinks: bool) -> str | None:
        """The layer feature this backend cannot apply, or None."""
        if softcap and not self.softcap:
            return "logit soft-capping (softcap)"
        if sinks and not self.sinks:
            return "attention sinks (s_aux)"
        return None


class Backend(ABC):
    """One attention implementation over the paged pool; one instance per pool shard
    (buffers and compiled kernels live on the shard's device)."""

    name: str = ""
    capabilities: Capabilities = Capabilities()
    workspace_bytes: int = 0  # bytes of reusable buffers it holds

    @abstractmethod
    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """key, value [N, Hkv, D] -> flat slots `slot_mapping` [N] of k_cache, v_cache."""

    @abstractmethod
    def copy_blocks(self, kv: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Block src[i] -> dst[i] in every layer, K and V (kv [L, 2, NB, bs, Hkv, D])."""

    @abstractmethod
    def attention(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: ForwardMetadata, scale: float, sliding_window: int | None = None,
                  alibi_slopes: torch.Tensor | None = None,
                  caller_mask: torch.Tensor | None = None, softcap: float | None = None,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
        """query [R, Hq, q, D] (the padded layout of `meta`) -> [R, q, Hq, Dv].

        sliding_window W: a query at position p sees keys t with p - W < t <= p.
        alibi_slopes [Hq]: Falcon's ALiBi, `reference.alibi_bias(slope, key position, scale)`
        added to the scores.
        caller_mask: only where `capabilities.caller_mask` (see torch_backend.py).
        softcap c: scores -> c * tanh(scores / c), before masking; sinks [Hq]: per-head
        logits joining each softmax's denominator (only where declared).
        """

    def decode_packed(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: ForwardMetadata, scale: float, sliding_window: int | None = None,
                      alibi_slopes: torch.Tensor | None = None,
                      **features) -> torch.Tensor:
        """A packed forward of one new token per row (row r's at r): query [N, Hq, D] ->
        [N, Hq, Dv]. By default `attention` over the padded layout of one column, with the
        keyword features it takes (softcap, sinks, ...)."""
        return self.attention(query.unsqueeze(2), k_cache, v_cache, meta, scale,
                              sliding_window, alibi_slopes, **features)[:, 0]
