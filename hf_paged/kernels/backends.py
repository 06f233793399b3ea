"""The GPU backends (Triton, CUDA C++, flash-attn) and the choice of a backend by name.

Each implements `base.Backend` and declares its `Capabilities`; the PyTorch reference is in
`torch_backend.py`.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import replace

import torch

from . import reference
from .base import Backend, Capabilities
from ..kv.quant import KINDS, is_quantized
from .library import define, like_first, tracing
from .torch_backend import TorchBackend


# The GPU kernels as torch ops, called where a forward is traced: a compiled graph (or a
# CUDA graph's CPU stand-in) records each as one opaque op, instead of Dynamo tracing
# into a Triton launch or an extension call. In them the longest row is bounded by the
# block table's width rather than a host int, which a graph would otherwise guard on.
def _decode_out(query: torch.Tensor, *args) -> torch.Tensor:
    return query.new_empty(query.shape)


_DECODE_ARGS = ("(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
                "Tensor seq_lens, float scale, int window, Tensor? alibi_slopes, float softcap, "
                "Tensor? sinks")


@define("triton_decode", _DECODE_ARGS + ") -> Tensor", _decode_out)
def triton_decode(query, k_cache, v_cache, block_tables, seq_lens, scale, window, alibi_slopes,
                  softcap, sinks):
    """`triton_attention.decode_attention`: query [R, Hq, D] -> [R, Hq, D] (contiguous);
    window 0 / softcap 0.0: none."""
    from .triton_attention import decode_attention

    return decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale,
                            window or None, alibi_slopes, softcap=softcap or None, sinks=sinks)


@define("triton_extend", "(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor query_pos, Tensor context_lens, Tensor seq_lens, float scale, int window, "
        "Tensor? alibi_slopes, float softcap, Tensor? sinks) -> Tensor", like_first)
def triton_extend(query, k_cache, v_cache, block_tables, query_pos, context_lens, seq_lens,
                  scale, window, alibi_slopes, softcap, sinks):
    """`triton_attention.extend_attention`: query [R, q, Hq, D] -> out like it."""
    from .triton_attention import extend_attention

    return extend_attention(query, k_cache, v_cache, block_tables, query_pos, context_lens,
                            seq_lens, scale, window or None, alibi_slopes, softcap=softcap or None,
                            sinks=sinks)


@define("cuda_decode", _DECODE_ARGS + ", int partition) -> Tensor", _decode_out)
def cuda_decode(query, k_cache, v_cache, block_tables, seq_lens, scale, window, alibi_slopes,
                softcap, sinks, partition):
    """The CUDA C++ decode kernel (`cuda/paged_attention.cu`), arguments as `triton_decode`."""
    from . import cuda_ops

    return cuda_ops.load().decode(query, k_cache, v_cache, block_tables, seq_lens, alibi_slopes,
                                  scale, window, block_tables.shape[1] * k_cache.shape[1],
                                  partition, softcap, sinks)


class TritonBackend(Backend):
    """Triton kernels: split-KV decode with GQA grouping, extend/prefill, writes, copies."""

    name = "triton"
    # cpu: under TRITON_INTERPRET=1; 8-bit pools: writes quantize in PyTorch
    capabilities = Capabilities(softcap=True, sinks=True, devices=("cuda", "cpu"),
                                kv_dtypes=KINDS)

    def __init__(self, device: torch.device | None = None):
        from . import triton_attention, triton_cache_ops

        self._attn = triton_attention
        self._ops = triton_cache_ops
        if device is not None:  # the 8-bit kinds this device's kernels can convert
            self.capabilities = replace(self.capabilities, kv_dtypes=triton_kv_kinds(device))

    def write_kv(self, k_cache, v_cache, key, value, slot_mapping):
        if is_quantized(k_cache):
            reference.write_kv(k_cache, v_cache, key, value, slot_mapping)
        else:
            self._ops.write_kv(k_cache, v_cache, key, value, slot_mapping)

    def copy_blocks(self, kv, src, dst):
        self._ops.copy_blocks(kv, src, dst)

    def attention(self, query, k_cache, v_cache, meta, scale, sliding_window=None,
                  alibi_slopes=None, caller_mask=None, softcap=None, sinks=None):
        """query [R, Hq, q, D] -> [R, q, Hq, D] (padded layout, see ForwardMetadata)."""
        if query.shape[2] == 1 and meta.is_query is None:
            if tracing():
                out = triton_decode(query[:, :, 0], k_cache, v_cache, meta.block_tables_i32,
                                    meta.seq_lens, scale, sliding_window or 0, alibi_slopes,
                                    softcap or 0.0, sinks)
            else:
                out = self._attn.decode_attention(
                    query[:, :, 0], k_cache, v_cache, meta.block_tables_i32, meta.seq_lens,
                    scale, sliding_window, alibi_slopes, max_seq_len=meta.max_seq_len,
                    softcap=softcap, sinks=sinks)
            return out.unsqueeze(1)
        args = (query.transpose(1, 2), k_cache, v_cache, meta.block_tables_i32, meta.query_pos,
                meta.context_lens, meta.seq_lens, scale)
        if tracing():
            return triton_extend(*args, sliding_window or 0, alibi_slopes, softcap or 0.0, sinks)
        return self._attn.extend_attention(*args, sliding_window, alibi_slopes, softcap=softcap,
                                           sinks=sinks)


class CudaBackend(Backend):
    """The CUDA C++ kernels of `cuda/` for decode, writes and copies; q > 1 (prefill, extend)
    goes through Triton, or the reference where Triton is missing."""

    name = "cuda"
    capabilities = Capabilities(softcap=True, sinks=True, kv_dtypes=KINDS)

    def __init__(self):
        from . import cuda_ops

        self._ops = cuda_ops.load()
        self._partition = cuda_ops.PARTITION
        self._reference = TorchBackend()
        self._extend = (TritonBackend(torch.device("cuda"))
                        if triton_unavailable_reason(torch.device("cuda")) is None
                        else self._reference)

    def write_kv(self, k_cache, v_cache, key, value, slot_mapping):
        if is_quantized(k_cache):  # 8-bit blocks: quantized in PyTorch, read by the kernel
            reference.write_kv(k_cache, v_cache, key, value, slot_mapping)
        else:
            self._ops.write_kv(key, value, k_cache, v_cache, slot_mapping)

    def copy_blocks(self, kv, src, dst):
        if kv.dtype == torch.uint8:  # an 8-bit pool's bytes
            reference.copy_blocks(kv, src, dst)
        else:
            self._ops.copy_blocks(kv, src, dst)

    def attention(self, query, k_cache, v_cache, meta, scale, sliding_window=None,
                  alibi_slopes=None, caller_mask=None, softcap=None, sinks=None):
        if query.shape[2] == 1 and meta.is_query is None:
            if tracing():
                out = cuda_decode(query[:, :, 0], k_cache, v_cache, meta.block_tables_i32,
                                  meta.seq_lens, scale, sliding_window or 0, alibi_slopes,
                                  softcap or 0.0, sinks, self._partition)
            else:
                out = self._ops.decode(query[:, :, 0], k_cache, v_cache, meta.block_tables_i32,
                                       meta.seq_lens, alibi_slopes, scale, sliding_window or 0,
                                       meta.max_seq_len, self._partition, softcap or 0.0, sinks)
            return out.unsqueeze(1)
        extend = self._extend
        if is_quantized(k_cache) and k_cache.dtype not in extend.capabilities.kv_dtypes:
            extend = self._reference  # fp8 blocks before sm_89: Triton cannot convert them
        return extend.attention(query, k_cache, v_cache, meta, scale, sliding_window,
                                alibi_slopes, softcap=softcap, sinks=sinks)


class CpuBackend(Backend):
    """The CPU C++ decode kernel (`cuda/cpu_paged_attention.cpp`): one new token per row,
    read from the pool where it lies (no gathered copy; 8-bit blocks dequantized as read);
    rows with more (prefill, extend) and copies go through the PyTorch reference, writes
    through the native one (`cuda/cpu_cache_ops.cpp`) where it applies."""

    name = "cpu"
    capabilities = Capabilities(softcap=True, sinks=True, devices=("cpu",), kv_dtypes=KINDS)

    def __init__(self):
        from . import cpu_ops

        cpu_ops.load()
        cpu_ops.serve_traced_writes()
        self._decode = cpu_ops.decode
        self._write = cpu_ops.write_kv
        self._reference = TorchBackend()

    def write_kv(self, k_cache, v_cache, key, value, slot_mapping):
        self._write(k_cache, v_cache, key, value, slot_mapping)

    def copy_blocks(self, kv, src, dst):
        reference.copy_blocks(kv, src, dst)

    @property
    def workspace_bytes(self) -> int:
        return self._reference.workspace_bytes

    def attention(self, query, k_cache, v_cache, meta, scale, sliding_window=None,
                  alibi_slopes=None, caller_mask=None, softcap=None, sinks=None):
        if query.shape[2] == 1 and meta.is_query is None:
            return self.decode_packed(query[:, :, 0], k_cache, v_cache, meta, scale,
                                      sliding_window, alibi_slopes, softcap, sinks).unsqueeze(1)
        return self._reference.attention(query, k_cache, v_cache, meta, scale, sliding_window,
                                         alibi_slopes, softcap=softcap, sinks=sinks)

    def decode_packed(self, query, k_cache, v_cache, meta, scale, sliding_window=None,
                      alibi_slopes=None, softcap=None, sinks=None):
        return self._decode(query.contiguous(), k_cache, v_cache, meta.block_tables_i32,
                            meta.seq_lens, scale, sliding_window or 0, softcap or 0.0,
                            alibi_slopes, sinks)


class FlashAttnBackend(Backend):
    """flash-attn 2's paged KV cache (`flash_attn_with_kvcache` with `block_table`); it has
    soft-capping but no attention sinks (those forwards go to the reference under "auto")."""

    name = "flash_attn"
    capabilities = Capabilities(softcap=True, dtypes=(torch.float16, torch.bfloat16))

    def write_kv(self, k_cache, v_cache, key, value, slot_mapping):
        reference.write_kv(k_cache, v_cache, key, value, slot_mapping)

    def copy_blocks(self, kv, src, dst):
        reference.copy_blocks(kv, src, dst)

    def __init__(self):
        from flash_attn import flash_attn_with_kvcache

        self._fn = flash_attn_with_kvcache

    def attention(self, query, k_cache, v_cache, meta, scale, sliding_window=None,
                  alibi_slopes=None, caller_mask=None, softcap=None, sinks=None):
        """Queries are right-aligned to each row's end (flash-attn's causal convention),
        which is where the padded layout puts them; padding columns are discarded."""
        return self._fn(
            query.transpose(1, 2), k_cache, v_cache,
            cache_seqlens=meta.seq_lens.to(torch.int32), block_table=meta.block_tables_i32,
            softmax_scale=scale, causal=True,
            window_size=(sliding_window - 1, 0) if sliding_window else (-1, -1),
            # (flash-attn adds slope * distance unrounded: Falcon's bfloat16 rounding of the
            # term is not reproduced in this half-precision-only backend)
            alibi_slopes=None if alibi_slopes is None else alibi_slopes.float() * scale,
            softcap=softcap or 0.0,
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


def triton_kv_kinds(device: torch.device) -> tuple[torch.dtype, ...]:
    """The 8-bit K/V kinds Triton's kernels read on `device`: fp8 conversions need sm_89 or
    later (the interpreter has them all)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9):
        return KINDS
    return (torch.int8,)


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

    "auto": flash-attn where its constraints hold, else Triton on CUDA, the C++ kernel on CPU
    where it builds, else the reference.
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
        return TritonBackend(device)
    if name == "cuda":
        from . import cuda_ops

        reason = cuda_ops.unavailable_reason()
        if reason is None and device.type != "cuda":
            reason = f"the pool is on {device.type}; the CUDA kernels need a CUDA device"
        if reason is None and num_heads // num_kv_heads not in (1, 2, 4, 8, 16):
            reason = f"the decode kernel takes 1, 2, 4, 8 or 16 query heads per KV head, not {num_heads // num_kv_heads}"
        if reason is not None:
            raise unavailable(reason)
        return CudaBackend()
    if name == "cpu":
        from . import cpu_ops

        reason = (f"the pool is on {device.type}; the CPU kernel needs a CPU pool"
                  if device.type != "cpu" else cpu_ops.build_error())
        if reason is not None:
            raise unavailable(reason)
        return CpuBackend()
    if name == "flash_attn":
        reason = flash_attn_unavailable_reason(device, dtype, block_size)
        if reason is not None:
            raise unavailable(reason)
        return FlashAttnBackend()
    if name == "auto":
        if flash_attn_unavailable_reason(device, dtype, block_size) is None:
            return FlashAttnBackend()
        if device.type == "cuda" and triton_unavailable_reason(device) is None:
            return TritonBackend(device)
        if device.type == "cpu":
            from . import cpu_ops

            if cpu_ops.build_error() is None:  # (built on first use; else the reference)
                return CpuBackend()
        return TorchBackend()
    raise ValueError(
        f"cache_config['backend'] must be one of 'auto', 'torch', 'triton', 'cuda', "
        f"'flash_attn', 'cpu'; got {name!r}."
    )
