"""hf-paged: PagedAttention KV cache for Hugging Face Transformers' `generate()`.

`import hf_paged`, then `model.generate(..., cache_implementation="paged")`.
"""

from .block_pool import BlockPool
from .block_table import BlockTables
from .cache import PagedCache
from .stats import MemoryStats
from .config import PagedCacheConfig
from .errors import HFPagedError, KVCacheExhaustedError, UnsupportedModelError
from .integration import SUPPORTED_ARCHITECTURES, disable, enable, is_enabled

__version__ = "0.1.0"

__all__ = [
    "BlockPool", "BlockTables", "HFPagedError", "KVCacheExhaustedError", "MemoryStats",
    "PagedCache", "PagedCacheConfig", "SUPPORTED_ARCHITECTURES", "UnsupportedModelError",
    "disable", "enable", "is_enabled",
]

enable()
