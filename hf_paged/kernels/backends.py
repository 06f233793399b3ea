"""Attention backends and their selection.

A backend does three things on the pool layout of `reference.py`: write new tokens
through a slot mapping, copy blocks (copy-on-write), and compute attention for one
forward's queries from its `ForwardMetadata`. One instance serves one cache.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from . import reference


class TorchBackend:
    """The pure-PyTorch reference; runs anywhere."""

    name = "torch"

    def __init__(self):
        self._workspace: torch.Tensor | None = None  # gather buffer reused by every layer

    write_kv = staticmethod(reference.write_kv)
    copy_blocks = staticmethod(reference.copy_blocks)

    def attention(self, query, k_cache, v_cache, meta, scale, sliding_window=None,
                  alibi_slopes=None):
        """query [R, Hq, q, D] -> [R, q, Hq, D] (padded layout, see ForwardMetadata)."""
        mask = meta.attention_mask(sliding_window, alibi_slopes)
        workspace = self._gather_workspace(meta.block_tables.numel(), k_cache)
        return reference.paged_attention(query, k_cache, v_cache, meta.block_tables, mask,
                                         scale, workspace)

    def _gather_workspace(self, num_blocks: int, like: torch.Tensor) -> torch.Tensor:
        """[2, >= num_blocks, bs, Hkv, D] for gathered K and V, grown in 25% steps.

        Reused across layers and steps: fresh allocations page-fault on CPU, which cost
        more than the copy itself.
        """
        ws = self._workspace
        if ws is None or ws.shape[1] < num_blocks or ws.dtype != like.dtype:
            size = max(num_blocks, int(1.25 * (0 if ws is None else ws.shape[1])))
            with torch.inference_mode(False):  # usable under no_grad and inference_mode alike
                ws = torch.empty(2, size, *like.shape[1:], dtype=like.dtype, device=like.device)
            self._workspace = ws
        return ws

    @property
    def workspace_bytes(self) -> int:
        ws = self._workspace
        return 0 if ws is None else ws.numel() * ws.element_size()


class TritonBackend:
    """Triton kernels: split-KV decode with GQA grouping, extend/prefill, writes, copies."""

    name = "triton"
    workspace_bytes = 0

    def __init__(self):
        from . import triton_attention, triton_cache_ops

        self._attn = triton_attention
        self.write_kv = triton_cache_ops.write_kv
        self.copy_blocks = triton_cache_ops.copy_blocks

    def attention(self, query, k_cache, v_cache, meta, scale, sliding_window=None,
                  alibi_slopes=None):
        """query [R, Hq, q, D] -> [R, q, Hq, D] (padded layout, see ForwardMetadata)."""
        if query.shape[2] == 1 and meta.is_query is None:
            out = self._attn.decode_attention(
                query[:, :, 0], k_cache, v_cache, meta.block_tables_i32, meta.seq_lens, scale,
                sliding_window, alibi_slopes)
            return out.unsqueeze(1)
        return self._attn.extend_attention(
            query.transpose(1, 2), k_cache, v_cache, meta.block_tables_i32, meta.query_pos,
            meta.context_lens, meta.seq_lens, scale, sliding_window, alibi_slopes)


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why the Triton backend cannot run on `device`, or None if it can."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install 'hf-paged[test]' or triton)"
    if device.type == "cuda":
        return None
    if os.environ.get("TRITON_INTERPRET") == "1" and device.type == "cpu":
        return None
    return (f"the pool is on {device.type}; Triton kernels need a CUDA device "
            "(or TRITON_INTERPRET=1 with a CPU pool, for testing)")


def select_backend(name: str, device: torch.device | str):
    """The backend for `name` on `device`; "auto" picks the fastest one that can run.

    Raises ValueError saying why when the named backend cannot run here.
    """
    device = torch.device(device)
    if name == "torch":
        return TorchBackend()
    if name == "triton":
        reason = triton_unavailable_reason(device)
        if reason is not None:
            raise ValueError(f"cache_config['backend']='triton' cannot run here: {reason}.")
        return TritonBackend()
    if name == "auto":
        if device.type == "cuda" and triton_unavailable_reason(device) is None:
            return TritonBackend()
        return TorchBackend()
    raise ValueError(
        f"cache_config['backend']={name!r} is not available in this build of hf-paged "
        "(available: 'auto', 'torch', 'triton')."
    )
