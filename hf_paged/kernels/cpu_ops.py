"""The CPU C++ kernels, built on first use and cached: the decode attention
(`cuda/cpu_paged_attention.cpp`), the pool write (`cuda/cpu_cache_ops.cpp`), the
sampler's greedy argmax (`cuda/cpu_sampling.cpp`) and the engine's rotary embedding
(`cuda/cpu_rotary.cpp`).

Building needs a C++ compiler and ninja (`pip install ninja`); `load()` raises
`CpuKernelsUnavailable` saying what is missing, and `available()` answers without raising
(the "auto" backend then stays with the PyTorch reference).
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import shutil
from pathlib import Path
from typing import Callable

import torch

from ..errors import CpuKernelsUnavailable
from .cuda_ops import source_dir
from . import extension, reference
from ..kv.pool import split_layer
from .library import define, impl_on, like_first, tracing

SOURCES = ("cpu_paged_attention.cpp", "cpu_cache_ops.cpp", "cpu_sampling.cpp", "cpu_rotary.cpp",
           "cpu_ops_binding.cpp")
logger = logging.getLogger("hf_paged")


def unavailable_reason() -> str | None:
    """Why the kernel cannot be built here, or None."""
    if os.environ.get("HF_PAGED_CPU_KERNELS", "1") == "0":
        return "HF_PAGED_CPU_KERNELS=0 turns them off"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler}) is installed"
    if shutil.which("ninja") is None:
        return "ninja is not installed (pip install ninja)"
    return None


def _machine() -> str:
    """What the build is specific to: it is compiled for this CPU's instruction set."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line
                break
    except OSError:
        pass
    return f"{torch.__version__}-{platform.machine()}-{flags}"


# -fopenmp: at::parallel_for is OpenMP pragmas in ATen's headers (without it the kernel
# runs on one thread); -fno-math-errno: libm calls (tanh) need not set errno.
CFLAGS = ["-O3", "-march=native", "-std=c++17", "-fopenmp", "-fno-math-errno"]


def build_directory() -> Path:
    return extension.build_directory("cpu", [source_dir() / name for name in SOURCES],
                                     _machine() + " ".join(CFLAGS))


@functools.lru_cache(maxsize=1)
def load():
    """Builds (once per source version, torch version and CPU) and imports the extension."""
    reason = unavailable_reason()
    if reason is not None:
        raise CpuKernelsUnavailable(f"hf-paged CPU kernels unavailable: {reason}.")
    try:
        sources = [source_dir() / name for name in SOURCES]
    except Exception as err:  # noqa: BLE001 (the CUDA loader's error names the sources)
        raise CpuKernelsUnavailable(str(err)) from err
    try:  # (a read-only home: the reference)
        return extension.build("hf_paged_cpu", build_directory(), sources,
                               extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"])
    except Exception as err:  # noqa: BLE001 (a failed build: the reference serves instead)
        raise CpuKernelsUnavailable(f"hf-paged CPU kernels failed to build: {err}") from err


@define("cpu_decode", "(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, int window, float softcap, Tensor? alibi_slopes, "
        "Tensor? sinks) -> Tensor", like_first)
def decode_op(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, window: int,
              softcap: float, alibi_slopes: torch.Tensor | None,
              sinks: torch.Tensor | None) -> torch.Tensor:
    """query [R, Hq, D] -> [R, Hq, D] (see the source's header). A torch op, so that a
    compiled forward traces it (and runs the same kernel as an eager one)."""
    return load().decode(query, k_cache, v_cache, block_tables, seq_lens, scale, window,
                         softcap, alibi_slopes, sinks)


def decode(query, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap,
           alibi_slopes, sinks):
    """The decode kernel (arguments as `decode_op`): the torch op wherever a forward is
    being traced (torch.compile, make_fx and fake tensors see it as one op), the extension
    itself otherwise (the op's Python dispatch costs about as much as a small call)."""
    if tracing():
        return decode_op(query, k_cache, v_cache, block_tables, seq_lens, scale, window,
                         softcap, alibi_slopes, sinks)
    return load().decode(query, k_cache, v_cache, block_tables, seq_lens, scale, window,
                         softcap, alibi_slopes, sinks)


def write_kv(k_cache, v_cache, key, value, slot_mapping) -> None:
    """`reference.write_kv` in one native call, where it applies: caches and new tokens of
    one floating dtype (8-bit pools quantize through the reference), each head contiguous,
    outside traced code (which must see the write's ops: a compiled forward writes through
    its own op, a CPU stand-in for a CUDA graph records aten ops)."""
    if (key.dtype == k_cache.dtype == value.dtype == v_cache.dtype and key.element_size() > 1
            and k_cache.stride(3) == 1 and v_cache.stride(3) == 1 and key.stride(2) == 1
            and value.stride(2) == 1 and not tracing()):
        load().write_kv(k_cache, v_cache, key, value, slot_mapping)
    else:
        reference.write_kv(k_cache, v_cache, key, value, slot_mapping)


@functools.lru_cache(maxsize=1)
def serve_traced_writes() -> None:
    """A compiled forward writes the pool through `hf_paged::write_layer_kv`; from now on
    that op takes the native write on CPU tensors too (`write_kv`: where it applies)."""
    impl_on("write_layer_kv", "CPU", _write_layer_kv)


def _write_layer_kv(kv, index, key, value, slot_mapping, split, kv_dtype) -> None:
    """`reference.write_layer_kv` on CPU."""
    write_kv(*split_layer(kv[index], split, kv_dtype), key, value, slot_mapping)


def build_error() -> str | None:
    """Why the kernel cannot be had here, or None once it is built and loaded."""
    reason = unavailable_reason()
    return f"hf-paged CPU kernels unavailable: {reason}." if reason else _built()


@functools.lru_cache(maxsize=1)
def _built() -> str | None:
    """A build's error, or None (tried once: a failed build is not retried per call)."""
    try:
        load()
        return None
    except CpuKernelsUnavailable as err:
        logger.info("%s The PyTorch reference computes CPU attention.", err)
        return str(err)


def available() -> bool:
    """Whether the kernel builds and loads here."""
    return build_error() is None


def greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(tokens [R] int64, valid [R] bool) of logits [R, V] (see `cuda/cpu_sampling.cpp`), or
    None where the kernel does not serve: not float32 rows on the CPU, or the extension not
    loaded (it is never built for this alone; the caller then takes torch.max)."""
    if (logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2
            or logits.stride(-1) != 1 or not load.cache_info().currsize):
        return None
    return load().greedy(logits)


def rotary() -> Callable | None:
    """Llama's `apply_rotary_pos_emb(q, k, cos, sin)` in one native pass, bit for bit (see
    `cuda/cpu_rotary.cpp`): q [B, Hq, N, D], k [B, Hk, N, D], cos, sin [B, N, D] -> the
    rotated (q, k), laid out as q and k, or None where it does not serve (other shapes or
    dtypes, tensors off the CPU: the caller then runs Transformers' ops). None itself when
    the extension cannot be had here."""
    return load().rotary if available() else None
