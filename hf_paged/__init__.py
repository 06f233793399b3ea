"""hf-paged: PagedAttention KV cache for Hugging Face Transformers' `generate()`.

`import hf_paged`, then `model.generate(..., cache_implementation="paged")`.
"""

from .block_pool import BlockPool
from .block_table import BlockTables
from .cache import PagedCache
from .stats import MemoryStats
from .config import PagedCacheConfig
from .errors import (
    BackwardNotSupportedError, HFPagedError, KVCacheExhaustedError, KVPoolAllocationError,
    UnsupportedModelError,
)
from .integration import SUPPORTED_ARCHITECTURES, disable, enable, is_enabled

__version__ = "0.2.0"

__all__ = [
    "BackwardNotSupportedError", "BlockPool", "BlockTables", "HFPagedError",
    "KVCacheExhaustedError", "KVPoolAllocationError", "MemoryStats",
    "PagedCache", "PagedCacheConfig", "SUPPORTED_ARCHITECTURES", "UnsupportedModelError",
    "disable", "enable", "is_enabled",
]

enable()
