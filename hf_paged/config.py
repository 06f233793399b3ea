"""User-facing settings of the paged cache (`cache_config={...}` in generate)."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any, Mapping

#: Attention backends by name; whether one can run on a device is decided by
#: `kernels.backends.select_backend`.
KNOWN_BACKENDS = ("auto", "torch", "triton", "cuda", "flash_attn")
BACKEND_ENV_VAR = "HF_PAGED_BACKEND"


def _positive_int(name: str, value: Any, allow_none: bool) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        allowed = "a positive integer" + (" or None" if allow_none else "")
        raise ValueError(f"cache_config[{name!r}] must be {allowed}; got {value!r}.")
    return value


@dataclass(frozen=True)
class PagedCacheConfig:
    """Settings of one paged cache.

    block_size:   tokens per block (vLLM's default is 16).
    num_blocks:   fixed pool size in blocks; the pool is allocated once and reused.
    max_kv_bytes: fixed pool size in bytes (K+V over all layers); converted to blocks.
    backend:      attention backend ("auto" picks the best available one).
    Without `num_blocks` and `max_kv_bytes` the pool grows on demand.
    """

    block_size: int = 16
    num_blocks: int | None = None
    max_kv_bytes: int | None = None
    backend: str = "auto"

    def __post_init__(self):
        _positive_int("block_size", self.block_size, allow_none=False)
        _positive_int("num_blocks", self.num_blocks, allow_none=True)
        _positive_int("max_kv_bytes", self.max_kv_bytes, allow_none=True)
        if self.num_blocks is not None and self.max_kv_bytes is not None:
            raise ValueError(
                "cache_config accepts one of 'num_blocks' and 'max_kv_bytes', not both; got "
                f"num_blocks={self.num_blocks!r} and max_kv_bytes={self.max_kv_bytes!r}."
            )
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
