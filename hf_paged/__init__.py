"""hf-paged: PagedAttention KV cache for Hugging Face Transformers' `generate()`, and a
continuous-batching engine on the same pool.

`import hf_paged`, then `model.generate(..., cache_implementation="paged")`; or serve many
requests together with `hf_paged.LLM(model).generate(prompts, hf_paged.SamplingParams(...))`.
"""

from .utils import MOVED, install_aliases

install_aliases()  # old module paths (hf_paged.engine, hf_paged.server, ...) keep working

from .core.block_pool import BlockPool
from .core.block_table import BlockTables
from .generate.cache import PagedCache
from .generate.stats import DeviceMemory, MemoryStats
from .distributed.placement import model_placement
from .kv.placement import Placement
from .config import PagedCacheConfig
from .errors import (
    BackwardNotSupportedError, EngineDeadError, HFPagedError, InvalidRequestError,
    IsolationError, KVCacheExhaustedError, KVPoolAllocationError, ModelChangedError,
    RequestRejectedError, UnsupportedModelError,
)
from .generate.patches import SUPPORTED_ARCHITECTURES, disable, enable, is_enabled, prepare_model
from .engine.async_llm import AsyncLLM, RequestStream
from .engine.engine import EngineStats, LLMEngine
from .engine.adapters import LoRARequest
from .engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from .engine.llm import LLM
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

__version__ = "0.2.0"

__all__ = [
    "AsyncLLM", "BackwardNotSupportedError", "BeamSearchOutput", "BeamSearchParams",
    "BeamSearchSequence", "BlockPool", "BlockTables", "CompletionOutput",
    "DeviceMemory", "EngineDeadError", "EngineStats", "HFPagedError", "InvalidRequestError",
    "IsolationError", "KVCacheExhaustedError", "KVPoolAllocationError", "LLM", "LLMEngine",
    "LoRARequest", "MemoryStats", "ModelChangedError", "PagedCache", "PagedCacheConfig",
    "Placement", "RequestMetrics", "RequestOutput", "RequestOutputKind",
    "RequestRejectedError", "RequestStream", "SUPPORTED_ARCHITECTURES", "SamplingParams",
    "StructuredOutputsParams", "UnsupportedModelError", "disable", "enable", "is_enabled",
    "model_placement", "prepare_model",
]

enable()


def __getattr__(name: str):
    """`hf_paged.cache`, `hf_paged.integration`, ...: the modules at their new paths."""
    if f"hf_paged.{name}" in MOVED:
        import importlib

        return importlib.import_module(f"hf_paged.{name}")
    raise AttributeError(f"module 'hf_paged' has no attribute {name!r}")
