"""Compile every Triton kernel of hf_paged for real GPU targets, without a GPU.

The interpreter that runs the kernels in CI accepts code that a GPU compile rejects (tile
shapes tl.dot cannot take, dtype mixes, too much shared memory), so this lowers each kernel
through Triton's full pipeline to a cubin for the given architectures and prints what ptxas
reports: registers, spill bytes and shared memory per program.

    python tests/compile_triton.py [sm_80 sm_90 ...]

Runs in its own process: TRITON_INTERPRET must be unset when the kernels are decorated.
Exits non-zero naming the first kernel that fails to compile.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from hf_paged.kernels import triton_attention as attn, triton_cache_ops as ops  # noqa: E402

TORCH_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


def signature(fn, pointers: dict[str, str], constexprs: dict, floats=("scale", "softcap")) -> dict:
    """Triton signature: named pointers typed, floats fp32, every other argument i32."""
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = "*" + pointers[name]
        else:
            sig[name] = "fp32" if name in floats else "i32"
    return sig


def aligned(fn, sig: dict) -> dict:
    """What a launch on real tensors tells the compiler: pointers and strides divisible by
    16 (the JIT specializes on this; without it loads are not vectorized)."""
    return {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
            if sig[name].startswith("*") or name.startswith("stride_")}


def cases(arch: int = 80):
    """(label, kernel, pointer types, constexprs, num_warps) as the wrappers launch them;
    8-bit pools (bytes, QUANT 1 int8, 2 fp8 e4m3 from sm_89 on) for bf16 queries."""
    # dtype: GQA group, block size, head dim, ALiBi, soft-capping, sinks
    configs = {"fp16": (4, 16, 128, False, False, False), "bf16": (1, 8, 64, True, True, False),
               "fp32": (8, 32, 128, False, True, True)}
    quants = [("bf16", 1), ("fp16", 1)] + ([("bf16", 2)] if arch >= 89 else [])
    for dt, quant in [(dt, 0) for dt in configs] + quants:
        group, bs, d, alibi, softcap, sinks = configs[dt]
        cache = "u8" if quant else dt
        cast = dt == "fp32"
        features = dict(HAS_SOFTCAP=softcap, HAS_SINKS=sinks)
        block_m, tile, warps = attn.extend_launch(getattr(torch, TORCH_DTYPES[dt]), quant > 0)
        tile_d, warps_d = attn.decode_launch(getattr(torch, TORCH_DTYPES[dt]), quant > 0, d)
        for single in (False, True):  # split-KV partials, or one split writing the output
            yield (f"decode {dt} group={group} bs={bs} d={d} alibi={alibi} softcap={softcap} "
                   f"sinks={sinks} single={single} quant={quant}",
                   attn._decode_kernel,
                   dict(Q=dt, K=cache, V=cache, BT="i32", SEQ="i64", SLOPES="fp32", SINKS="fp32",
                        O_PART=dt if single else "fp32", LSE_PART="fp32"),
                   dict(GROUP=group, GROUP_P=attn._p2(group), BS=bs,
                        TILE=tile_d, D=d, D_P=attn._p2(d), HAS_ALIBI=alibi, CAST_FP32=cast,
                        STORE_LSE=not single, QUANT=quant, **features),
                   warps_d)
        yield (f"extend {dt} group={group} bs={bs} d={d} alibi={alibi} softcap={softcap} "
               f"sinks={sinks} quant={quant}", attn._extend_kernel,
               dict(Q=dt, K=cache, V=cache, BT="i32", QPOS="i64", CTX="i64", SEQ="i64",
                    SLOPES="fp32", SINKS="fp32", OUT=dt),
               dict(GROUP=group, BLOCK_M=block_m, BS=bs, TILE=tile, D=d, D_P=attn._p2(d),
                    HAS_ALIBI=alibi, CAST_FP32=cast, QUANT=quant, **features), warps)
    yield ("merge bf16 d=128", attn._merge_splits_kernel,
           dict(O_PART="fp32", LSE_PART="fp32", OUT="bf16"), dict(SPLITS=5, SPLITS_P=8, D=128, D_P=128), 4)
    yield ("write_kv fp16", ops._write_kv_kernel,
           dict(KEY="fp16", VALUE="fp16", K_CACHE="fp16", V_CACHE="fp16", SLOTS="i64"),
           dict(ROW=1024, ROW_P=1024), 4)
    yield ("copy_blocks bf16", ops._copy_blocks_kernel, dict(KV="bf16", SRC="i64", DST="i64"),
           dict(BLOCK_NUMEL=16 * 8 * 128, CHUNK=4096), 4)


def resource_usage(cubin: bytes) -> str:
    """ptxas' register / spill / shared-memory line for the cubin, via cuobjdump."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True,
                             text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", out)
    return "REG:? STACK:? SHARED:?" if found is None else found.group(0)


def main(archs: list[str]) -> int:
    for arch in archs:
        target = GPUTarget("cuda", int(arch.removeprefix("sm_")), 32)
        for label, fn, pointers, constexprs, warps in cases(int(arch.removeprefix("sm_"))):
            sig = signature(fn, pointers, constexprs)
            src = ASTSource(fn, sig, constexprs, attrs=aligned(fn, sig))
            try:
                kernel = triton.compile(src, target=target, options={"num_warps": warps})
            except Exception as err:  # noqa: BLE001 - report which kernel, then fail
                print(f"FAILED {arch} {label}: {type(err).__name__}: {err}")
                return 1
            print(f"{arch} {label}: {resource_usage(kernel.asm['cubin'])} "
                  f"warps={kernel.metadata.num_warps}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["sm_80", "sm_90"]))
