"""cuda/*.cu built for the CPU against this folder's emulator headers (see cuda_runtime.h),
and `EmulatedCudaOps`, the same calls as the torch binding (cuda/paged_ops_binding.cpp) on
CPU tensors.

Two source rewrites make the CUDA C++ plain C++: `kernel<<<grid, block, smem, stream>>>(args)`
becomes `hf_emu::launch(grid, block, smem, stream, kernel, args)`, and `extern __shared__`
arrays point at the emulator's per-block dynamic shared memory. Nothing else is changed.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import torch

from hf_paged.kv.quant import CODES  # DecodeArgs::kv_quant

HERE = Path(__file__).resolve().parent
CUDA_DIR = HERE.parents[2] / "cuda"
KERNEL_SOURCES = ("paged_attention.cu", "cache_ops.cu")

_LAUNCH = re.compile(r"([A-Za-z_][\w:]*(?:<[^<>;]*>)?)\s*<<<(.*?)>>>\s*\(", re.S)
_EXTERN_SHARED = re.compile(r"extern\s+__shared__\s+(\w+)\s+(\w+)\s*\[\s*\]\s*;")


def to_cpp(source: str) -> str:
    source = _LAUNCH.sub(r"::hf_emu::launch(\2, \1, ", source)
    return _EXTERN_SHARED.sub(
        r"\1* \2 = reinterpret_cast<\1*>(::hf_emu::dynamic_shared());", source)


def compiler() -> str | None:
    return shutil.which("g++")


def build(out_dir: Path) -> Path:
    """Compiles the rewritten kernels and harness.cpp into a shared library in out_dir."""
    sources = []
    for name in KERNEL_SOURCES:
        target = out_dir / (Path(name).stem + ".cpp")
        target.write_text(to_cpp((CUDA_DIR / name).read_text()))
        sources.append(str(target))
    lib = out_dir / "libhf_paged_emu.so"
    cmd = [compiler(), "-std=c++17", "-O2", "-shared", "-fPIC", "-Wall", "-Werror",
           "-Wno-unused-function", "-Wno-unknown-pragmas", f"-I{HERE}", f"-I{CUDA_DIR}", *sources,
           str(HERE / "harness.cpp"), "-o", str(lib)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"building the emulated CUDA kernels failed:\n{result.stderr}")
    return lib


DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # hf_paged::DType


def _ptr(t: torch.Tensor | None):
    return ctypes.c_void_p(0 if t is None else t.data_ptr())


class EmulatedCudaOps:
    """decode / write_kv / copy_blocks / swap_blocks with the binding's signatures and
    checks, running cuda/'s kernels on CPU tensors through the emulator."""

    def __init__(self, lib_path: Path):
        self.lib = ctypes.CDLL(str(lib_path))
        self.lib.emu_last_message.restype = ctypes.c_char_p

    def _check(self, err: int, what: str) -> None:
        if err != 0:
            raise RuntimeError(f"{what} failed ({err}): {self.lib.emu_last_message().decode()}")

    def decode(self, query, k_cache, v_cache, block_tables, seq_lens, alibi_slopes, scale,
               window, max_seq_len, partition, softcap, sinks):
        query = query.contiguous()
        assert block_tables.dtype == torch.int32 and block_tables.stride(1) == 1
        seq_lens = seq_lens.to(torch.int64).contiguous()
        rows, heads, dim = query.shape
        parts = max(1, -(-max_seq_len // partition))
        out = torch.empty_like(query)
        part_out = torch.empty(rows, heads, parts, dim) if parts > 1 else None
        part_max = torch.empty(rows, heads, parts) if parts > 1 else None
        part_sum = torch.empty(rows, heads, parts) if parts > 1 else None
        slopes = None if alibi_slopes is None else alibi_slopes.float().contiguous()
        sinks = None if sinks is None else sinks.float().contiguous()
        c_int, c_float = ctypes.c_int, ctypes.c_float
        self._check(self.lib.emu_decode(
            _ptr(query), _ptr(k_cache), _ptr(v_cache), _ptr(block_tables), _ptr(seq_lens),
            _ptr(slopes), _ptr(out), _ptr(part_out), _ptr(part_max), _ptr(part_sum),
            c_int(rows), c_int(heads), c_int(k_cache.shape[2]), c_int(dim),
            c_int(k_cache.shape[1]), c_int(block_tables.stride(0)), c_int(partition),
            c_int(parts), c_float(scale), c_int(window), c_int(DTYPES[query.dtype]),
            c_float(softcap), _ptr(sinks), c_int(CODES.get(k_cache.dtype, 0))),
            "paged_decode")
        return out

    def write_kv(self, key, value, k_cache, v_cache, slots):
        key, value = key.contiguous(), value.contiguous()
        slots = slots.to(torch.int64).contiguous()
        row = key.shape[1] * key.shape[2]
        self._check(self.lib.emu_write_kv(
            _ptr(key), _ptr(value), _ptr(k_cache), _ptr(v_cache), _ptr(slots),
            ctypes.c_int64(key.shape[0]), ctypes.c_int(row), ctypes.c_int64(row),
            ctypes.c_int(DTYPES[key.dtype])), "write_kv")

    def copy_blocks(self, kv, src, dst):
        src, dst = src.to(torch.int64).contiguous(), dst.to(torch.int64).contiguous()
        i64 = ctypes.c_int64
        self._check(self.lib.emu_copy_blocks(
            _ptr(kv), _ptr(src), _ptr(dst), i64(src.numel()), i64(kv.shape[0] * kv.shape[1]),
            i64(kv.stride(1)), i64(kv.stride(2)), ctypes.c_int(DTYPES[kv.dtype])), "copy_blocks")

    def swap_blocks(self, src_cache, dst_cache, pairs, to_host=True):
        pairs = pairs.to(torch.int64).contiguous()
        src, dst = pairs[:, 0].contiguous(), pairs[:, 1].contiguous()
        block_bytes = src_cache.stride(0) * src_cache.element_size()
        self._check(self.lib.emu_swap_blocks(
            _ptr(src_cache), _ptr(dst_cache), _ptr(src), _ptr(dst), ctypes.c_int64(src.numel()),
            ctypes.c_int64(block_bytes), ctypes.c_int(int(to_host))), "swap_blocks")
