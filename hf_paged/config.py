"""User-facing settings of the paged cache (`cache_config={...}` in generate)."""

from __future__ import annotations

import operator
import os
from dataclasses import dataclass, fields
from typing import Any, Mapping

#: Attention backends by name; whether one can run on a device is decided by
#: `kernels.backends.select_backend`.
KNOWN_BACKENDS = ("auto", "torch", "triton", "cuda", "flash_attn", "cpu")
BACKEND_ENV_VAR = "HF_PAGED_BACKEND"
#: K/V storage: the model's dtype, or 8 bits with a scale per token and head (kv/quant.py).
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")


def _positive_int(name: str, value: Any, allow_none: bool) -> int | None:
    """`value` as a positive int; integral numbers of other types (numpy, 0-d tensors) count."""
    if value is None and allow_none:
        return None
    try:
        number = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        number = None
    if number is None or number <= 0:
        allowed = "a positive integer" + (" or None" if allow_none else "")
        raise ValueError(f"cache_config[{name!r}] must be {allowed}; got {value!r}.")
    return number


def positive(name: str, value, default: int | None = None) -> int:
    """An engine option that is a positive integer (`default` when None; 0 is refused)."""
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer; got {value!r}.")
    return value


def fraction(name: str, value) -> float:
    """An engine option that is a number in (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"{name} must be a number in (0, 1]; got {value!r}.")
    return value


def flag(name: str, value) -> bool:
    """An engine option that is True or False."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False; got {value!r}.")
    return value


@dataclass(frozen=True)
class PagedCacheConfig:
    """Settings of one paged cache: `generate(..., cache_config={...})` takes them as a dict
    (or `PagedCacheConfig(...)`), and so does `PagedCache(model.config, {...})`.

    block_size:   tokens per block (vLLM's default is 16). An unsized pool never uses blocks
                  longer than its call's longest sequence (rounded up to a power of two, at
                  least 16 tokens), so a large value cannot inflate a short call.
    num_blocks:   fixed pool size in blocks; the pool is allocated once and reused.
    max_kv_bytes: fixed pool size in bytes (K+V over all layers); converted to blocks.
    backend:      attention backend ("auto" picks the best available one).
    kv_cache_dtype: "auto" (the model's dtype) or 8-bit blocks: "int8", "fp8_e4m3" ("fp8"),
                  "fp8_e5m2", each head of each token with a bfloat16 scale of its own.
    Without `num_blocks` and `max_kv_bytes` the pool grows on demand.
    """

    block_size: int = 16
    num_blocks: int | None = None
    max_kv_bytes: int | None = None
    backend: str = "auto"
    kv_cache_dtype: str = "auto"

    def __post_init__(self):
        for name in ("block_size", "num_blocks", "max_kv_bytes"):
            value = _positive_int(name, getattr(self, name), allow_none=name != "block_size")
            object.__setattr__(self, name, value)
        if self.num_blocks is not None and self.max_kv_bytes is not None:
            raise ValueError(
                "cache_config accepts one of 'num_blocks' and 'max_kv_bytes', not both; got "
                f"num_blocks={self.num_blocks!r} and max_kv_bytes={self.max_kv_bytes!r}."
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"cache_config['kv_cache_dtype'] must be one of {KV_CACHE_DTYPES}; "
                             f"got {self.kv_cache_dtype!r}.")
        if self.backend not in KNOWN_BACKENDS:
            raise ValueError(
                f"cache_config['backend'] must be one of {KNOWN_BACKENDS}; got {self.backend!r}."
            )

    @property
    def is_sized(self) -> bool:
        """True when the pool has a fixed size (allocated once, reused across calls)."""
        return self.num_blocks is not None or self.max_kv_bytes is not None

    @classmethod
    def from_any(cls, value: "PagedCacheConfig | Mapping[str, Any] | None") -> "PagedCacheConfig":
        """Builds a config from a dict (generate's `cache_config`), a config, or None."""
        if isinstance(value, cls):
            return value
        if value is None:
            value = {}
        if not isinstance(value, Mapping):
            raise ValueError(
                f"cache_config must be a dict of paged-cache settings; got {type(value).__name__}."
            )
        allowed = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - allowed)
        if unknown:
            raise ValueError(
                f"cache_config got unknown setting(s) {unknown}; allowed settings: {sorted(allowed)}."
            )
        settings = dict(value)
        if "backend" not in settings and os.environ.get(BACKEND_ENV_VAR):
            settings["backend"] = os.environ[BACKEND_ENV_VAR]
            if settings["backend"] not in KNOWN_BACKENDS:
                raise ValueError(
                    f"The environment variable {BACKEND_ENV_VAR} must be one of "
                    f"{KNOWN_BACKENDS}; got {settings['backend']!r}."
                )
        return cls(**settings)
