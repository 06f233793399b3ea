"""The CUDA C++ kernels of `cuda/`, built on first use and cached.

Building needs a CUDA GPU, a CUDA build of torch and a CUDA toolkit (nvcc, CUDA_HOME);
`load()` raises `CudaKernelsUnavailable` saying which is missing.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from ..errors import CudaKernelsUnavailable
from . import extension

SOURCES = ("paged_ops_binding.cpp", "paged_attention.cu", "cache_ops.cu")
HEADERS = ("paged_ops.h",)
PARTITION = 512  # tokens per split-KV partition of the decode kernel



def source_dir() -> Path:
    """`cuda/` of a source checkout, or the copy installed next to the package."""
    here = Path(__file__).resolve()
    for candidate in (here.parents[2] / "cuda", here.parent / "cuda"):
        if (candidate / SOURCES[1]).exists():
            return candidate
    raise CudaKernelsUnavailable("the CUDA sources (cuda/*.cu) are not found next to hf_paged")


def unavailable_reason() -> str | None:
    """Why the kernels cannot be built here, or None."""
    if not torch.cuda.is_available():
        return "no CUDA device is available"
    if torch.version.cuda is None:
        return "this torch build has no CUDA support"
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None:
        return "no CUDA toolkit found (install nvcc and set CUDA_HOME)"
    return None


@functools.lru_cache(maxsize=1)
def load():
    """Builds (once per source version, torch version and GPU arch) and imports the extension."""
    reason = unavailable_reason()
    if reason is not None:
        raise CudaKernelsUnavailable(f"hf-paged CUDA kernels unavailable: {reason}.")
    src = source_dir()
    major, minor = torch.cuda.get_device_capability()
    folder = extension.build_directory("cuda", [src / name for name in SOURCES + HEADERS],
                                       f"{torch.__version__}-{major}{minor}")
    return extension.build(
        "hf_paged_cuda", folder,
        [src / name for name in SOURCES],
        extra_include_paths=[str(src)],
        extra_cflags=["-O3", "-std=c++17"],
        extra_cuda_cflags=["-O3", "-std=c++17", f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"],
    )
