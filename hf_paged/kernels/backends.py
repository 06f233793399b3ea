"""Attention backends and their selection.

A backend does three things on the pool layout of `reference.py`: write new tokens
through a slot mapping, copy blocks (copy-on-write), and compute attention for one
forward's queries from its `ForwardMetadata`. One instance serves one cache.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from ..kernels import reference


class TorchBackend:
    """The pure-PyTorch reference; runs anywhere."""

    name = "torch"

    def __init__(self):
        self._workspace: torch.Tensor | None = None  # gather buffer reused by every layer

    write_kv = staticmethod(reference.write_kv)
    copy_blocks = staticmethod(reference.copy_blocks)

    def attention(self, query, k_cache, v_cache, meta, scale, sliding_window=None,
                  alibi_slopes=None, caller_mask=None):
        """query [R, Hq, q, D] -> [R, q, Hq, D] (padded layout, see ForwardMetadata).

        caller_mask: a caller's 4D mask over columns (see `ForwardMetadata.caller_mask`),
        used instead of the causal / sliding-window mask, as SDPA uses it.
        """
        if caller_mask is not None:
            mask = meta.caller_mask(caller_mask)
        else:
            mask = meta.attention_mask(sliding_window, alibi_slopes)
        workspace = self._gather_workspace(meta.block_tables.numel(), k_cache)
        groups = meta.length_groups() if query.shape[2] == 1 and caller_mask is None else None
        if groups is not None:  # decode rows of very different lengths: gather each bucket
            out = query.new_empty(query.shape[0], 1, query.shape[1], query.shape[3])
            for rows, cols in groups:
                keys = cols * meta.block_size
                part = reference.paged_attention(
                    query.index_select(0, rows), k_cache, v_cache,
                    meta.block_tables.index_select(0, rows)[:, :cols],
                    mask.index_select(0, rows)[..., :keys], scale, workspace)
                out.index_copy_(0, rows, part)
            return out
        out = reference.paged_attention(query, k_cache, v_cache, meta.block_tables, mask,
                                        scale, workspace)
        if meta.is_query is not None:  # padding columns: zeros, as the kernels give
            out = out.masked_fill(~meta.is_query[:, :, None, None], 0.0)
        return out

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
        from ..kernels import triton_attention, triton_cache_ops

        self._attn = triton_attention
        self.write_kv = triton_cache_ops.write_kv
        self.copy_blocks = triton_cache_ops.copy_blocks

    def attention(self, query, k_cache, v_cache, meta, scale, sliding_window=None,
                  alibi_slopes=None):
        """query [R, Hq, q, D] -> [R, q, Hq, D] (padded layout, see ForwardMetadata)."""
        if query.shape[2] == 1 and meta.is_query is None:
            out = self._attn.decode_attention(
                query[:, :, 0], k_cache, v_cache, meta.block_tables_i32, meta.seq_lens, scale,
                sliding_window, alibi_slopes, max_seq_len=meta.max_seq_len)
            return out.unsqueeze(1)
        return self._attn.extend_attention(
            query.transpose(1, 2), k_cache, v_cache, meta.block_tables_i32, meta.query_pos,
            meta.context_lens, meta.seq_lens, scale, sliding_window, alibi_slopes)


class CudaBackend:
    """The CUDA C++ kernels of `cuda/` for decode, writes and copies; q > 1 (prefill, extend)
    goes through Triton, or the reference where Triton is missing."""

    name = "cuda"
    workspace_bytes = 0

    def __init__(self):
        from ..kernels import cuda_ops

        self._ops = cuda_ops.load()
        self._partition = cuda_ops.PARTITION
        self._extend = (TritonBackend() if triton_unavailable_reason(torch.device("cuda")) is None
                        else TorchBackend())
        self.copy_blocks = self._ops.copy_blocks

    def write_kv(self, k_cache, v_cache, key, value, slot_mapping):
        self._ops.write_kv(key, value, k_cache, v_cache, slot_mapping)

    def attention(self, query, k_cache, v_cache, meta, scale, sliding_window=None,
                  alibi_slopes=None):
        if query.shape[2] == 1 and meta.is_query is None:
            out = self._ops.decode(query[:, :, 0], k_cache, v_cache, meta.block_tables_i32,
                                   meta.seq_lens, alibi_slopes, scale, sliding_window or 0,
                                   meta.max_seq_len, self._partition)
            return out.unsqueeze(1)
        return self._extend.attention(query, k_cache, v_cache, meta, scale, sliding_window,
                                      alibi_slopes)


class FlashAttnBackend:
    """flash-attn 2's paged KV cache (`flash_attn_with_kvcache` with `block_table`)."""

    name = "flash_attn"
    workspace_bytes = 0
    write_kv = staticmethod(reference.write_kv)
    copy_blocks = staticmethod(reference.copy_blocks)

    def __init__(self):
        from flash_attn import flash_attn_with_kvcache

        self._fn = flash_attn_with_kvcache

    def attention(self, query, k_cache, v_cache, meta, scale, sliding_window=None,
                  alibi_slopes=None):
        """Queries are right-aligned to each row's end (flash-attn's causal convention),
        which is where the padded layout puts them; padding columns are discarded."""
        return self._fn(
            query.transpose(1, 2), k_cache, v_cache,
            cache_seqlens=meta.seq_lens.to(torch.int32), block_table=meta.block_tables_i32,
            softmax_scale=scale, causal=True,
            window_size=(sliding_window - 1, 0) if sliding_window else (-1, -1),
            alibi_slopes=None if alibi_slopes is None else alibi_slopes.float(),
        )


FLASH_ATTN_BLOCK_MULTIPLE = 256  # flash-attn 2 paged KV needs block_size % 256 == 0


def flash_attn_unavailable_reason(device: torch.device, dtype: torch.dtype,
                                  block_size: int) -> str | None:
    if importlib.util.find_spec("flash_attn") is None:
        return "flash-attn is not installed (pip install 'hf-paged[flash]')"
    if device.type != "cuda":
        return f"flash-attn needs a CUDA device; the pool is on {device.type}"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"flash-attn takes float16 or bfloat16; the pool is {dtype}"
    if block_size % FLASH_ATTN_BLOCK_MULTIPLE:
        return (f"flash-attn 2 needs block_size to be a multiple of "
                f"{FLASH_ATTN_BLOCK_MULTIPLE}; got {block_size}")
    return None


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why the Triton backend cannot run on `device`, or None if it can."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install 'hf-paged[triton]')"
    if device.type == "cuda":
        return None
    if os.environ.get("TRITON_INTERPRET") == "1" and device.type == "cpu":
        return None
    return (f"the pool is on {device.type}; Triton kernels need a CUDA device "
            "(or TRITON_INTERPRET=1 with a CPU pool, for testing)")


def select_backend(name: str, device: torch.device | str, dtype: torch.dtype = torch.float32,
                   block_size: int = 16, num_heads: int = 1, num_kv_heads: int = 1):
    """The backend for `name` on `device`; "auto" picks the fastest one that can run here.

    "auto": flash-attn where its constraints hold, else Triton on CUDA, else the reference.
    The CUDA C++ kernels are built on first use, so they run only when asked for.
    Raises ValueError saying why when the named backend cannot run here.
    """
    device = torch.device(device)

    def unavailable(reason: str) -> ValueError:
        return ValueError(f"cache_config['backend']={name!r} cannot run here: {reason}.")

    if name == "torch":
        return TorchBackend()
    if name == "triton":
        reason = triton_unavailable_reason(device)
        if reason is not None:
            raise unavailable(reason)
        return TritonBackend()
    if name == "cuda":
        from ..kernels import cuda_ops

        reason = cuda_ops.unavailable_reason()
        if reason is None and device.type != "cuda":
            reason = f"the pool is on {device.type}; the CUDA kernels need a CUDA device"
        if reason is None and num_heads // num_kv_heads not in (1, 2, 4, 8, 16):
            reason = f"the decode kernel takes 1, 2, 4, 8 or 16 query heads per KV head, not {num_heads // num_kv_heads}"
        if reason is not None:
            raise unavailable(reason)
        return CudaBackend()
    if name == "flash_attn":
        reason = flash_attn_unavailable_reason(device, dtype, block_size)
        if reason is not None:
            raise unavailable(reason)
        return FlashAttnBackend()
    if name == "auto":
        if flash_attn_unavailable_reason(device, dtype, block_size) is None:
            return FlashAttnBackend()
        if device.type == "cuda" and triton_unavailable_reason(device) is None:
            return TritonBackend()
        return TorchBackend()
    raise ValueError(
        f"cache_config['backend'] must be one of 'auto', 'torch', 'triton', 'cuda', "
        f"'flash_attn'; got {name!r}."
    )
