"""hf-paged: PagedAttention KV cache for Hugging Face Transformers' `generate()`, and a
continuous-batching engine on the same pool.

`import hf_paged`, then `model.generate(..., cache_implementation="paged")`; or serve many
requests together with `hf_paged.LLM(model).generate(prompts, hf_paged.SamplingParams(...))`.
"""

from .block_pool import BlockPool
from .block_table import BlockTables
from .cache import PagedCache
from .stats import DeviceMemory, MemoryStats
from .placement import Placement, model_placement
from .config import PagedCacheConfig
from .errors import (
    BackwardNotSupportedError, HFPagedError, InvalidRequestError, KVCacheExhaustedError,
    KVPoolAllocationError, UnsupportedModelError,
)
from .integration import SUPPORTED_ARCHITECTURES, disable, enable, is_enabled
from .async_llm import AsyncLLM, EngineDeadError, RequestStream
from .engine import EngineStats, IsolationError, LLMEngine
from .llm import LLM
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .sampling_params import SamplingParams
from .scheduler import RequestRejectedError

__version__ = "0.2.0"

__all__ = [
    "AsyncLLM", "BackwardNotSupportedError", "BlockPool", "BlockTables", "CompletionOutput",
    "DeviceMemory", "EngineDeadError", "EngineStats", "HFPagedError", "InvalidRequestError",
    "IsolationError", "KVCacheExhaustedError", "KVPoolAllocationError", "LLM", "LLMEngine",
    "MemoryStats", "PagedCache", "PagedCacheConfig", "Placement", "RequestMetrics",
    "RequestOutput", "RequestRejectedError", "RequestStream",
    "SUPPORTED_ARCHITECTURES", "SamplingParams", "UnsupportedModelError", "disable", "enable",
    "is_enabled", "model_placement",
]

enable()
