"""Everything hf-paged changes in Transformers (5.23), in one place.

`enable()` (run by `import hf_paged`) registers the "paged" attention and mask functions
and wraps four `GenerationMixin` methods:

- `generate`: takes `cache_implementation="paged"` out of the keywords before Transformers
  reroutes it to continuous batching, and restores attention implementations afterwards;
- `_prepare_generation_config`: puts "paged" back into the call's generation config;
- `_prepare_cache_for_generation`: builds (or reuses) a `PagedCache` for supported models
  and switches them to the "paged" attention for the call;
- `prepare_inputs_for_generation`: hands each forward's 2D padding mask to the cache;
- `_prefill`: runs each distinct prompt once, packed without its pad tokens (prefill.py).

Falcon computes attention inline, so `FalconAttention.forward` is wrapped too
(see `models/falcon.py`). `disable()` undoes all of it.
"""

from __future__ import annotations

import contextvars
import functools
import threading
import warnings

from transformers import GenerationMixin
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface
from transformers.models.falcon import modeling_falcon
from transformers.models.falcon.modeling_falcon import (
    FalconAttention, FalconFlashAttention2, FalconForCausalLM,
)
from transformers.models.llama.modeling_llama import LlamaForCausalLM
from transformers.models.mistral.modeling_mistral import MistralForCausalLM

from .attention import ATTENTION_NAME, paged_attention_forward, paged_mask
from .cache import PagedCache
from .models import kv_layout
from .models.falcon import paged_falcon_attention
from .config import PagedCacheConfig
from .errors import UnsupportedModelError
from .kv_pool import kept_pool
from . import prefill as paged_prefill

CACHE_IMPLEMENTATION = "paged"
SUPPORTED_MODELS = (LlamaForCausalLM, MistralForCausalLM, FalconForCausalLM)
SUPPORTED_ARCHITECTURES = tuple(cls.__name__ for cls in SUPPORTED_MODELS)

# Set while a generate() call that got cache_implementation="paged" as a keyword runs.
_paged_keyword = contextvars.ContextVar("hf_paged_keyword", default=False)
# Configs the current generate() switched to the paged attention, released when it returns.
_swapped = contextvars.ContextVar("hf_paged_swapped", default=None)
# id(config) -> [config, its own attention implementation, generate() calls using "paged"]:
# concurrent calls on one model share the switch, and the last one out restores it.
_switched: dict[int, list] = {}
_switch_lock = threading.Lock()

_originals: dict[tuple[type, str], object] = {}


def is_supported(model) -> bool:
    return isinstance(model, SUPPORTED_MODELS)


def _user_stacklevel() -> int:
    """warnings.warn stacklevel of the first caller outside hf_paged, transformers and torch."""
    import os
    import sys

    skip = tuple(os.path.dirname(sys.modules[name].__file__) + os.sep
                 for name in ("hf_paged", "transformers", "torch"))
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame, level = frame.f_back, level + 1
    return level


def _warn_stock(model, why: str) -> None:
    warnings.warn(f"hf-paged: {why}; {type(model).__name__} runs this call with Transformers' "
                  "default cache instead.", UserWarning, stacklevel=_user_stacklevel())


def _warn_unsupported(model) -> None:
    _warn_stock(model, f"cache_implementation='paged' supports {', '.join(SUPPORTED_ARCHITECTURES)}")


def _use_paged_attention(model) -> None:
    config = model.config
    swapped = _swapped.get()  # None outside generate(): nothing will switch it back
    with _switch_lock:
        entry = _switched.get(id(config))
        if entry is None:
            if config._attn_implementation == ATTENTION_NAME:
                return  # loaded with attn_implementation="paged", or switched for good
            if swapped is None:
                config._attn_implementation_internal = ATTENTION_NAME
                return
            entry = _switched[id(config)] = [config, config._attn_implementation_internal, 0]
            config._attn_implementation_internal = ATTENTION_NAME
        if swapped is not None:
            entry[2] += 1
            swapped.append(entry)


def _release_paged_attention(entries: list) -> None:
    with _switch_lock:
        for entry in entries:
            entry[2] -= 1
            if entry[2] == 0:
                config, implementation, _ = _switched.pop(id(entry[0]))
                config._attn_implementation_internal = implementation


def build_cache(model, generation_config, max_cache_length: int | None) -> PagedCache:
    """A `PagedCache` for `model`.

    A sized pool (num_blocks / max_kv_bytes) is kept for the model and shared by the caches
    of every call with that sizing, concurrent calls and assistant caches included, each
    owning its own blocks. An unsized pool belongs to its call alone.
    """
    cache_config = PagedCacheConfig.from_any(generation_config.cache_config)
    text_config = model.config.get_text_config(decoder=True)
    dtype, device = model.dtype, model.device
    devices = {str(d) for d in (getattr(model, "hf_device_map", None) or {}).values()}
    if len(devices - {"cpu", "disk"}) > 1:
        raise UnsupportedModelError(
            f"hf-paged keeps one KV pool on one device; this model is spread over {sorted(devices)} "
            "(device_map). Load it on a single device to use cache_implementation='paged'."
        )
    pool = None
    if cache_config.is_sized:
        pool = kept_pool(model, cache_config, *kv_layout(text_config), dtype, device)
    return PagedCache(text_config, cache_config, dtype=dtype, device=device, pool=pool,
                      max_cache_len=max_cache_length)


# -- wrappers -------------------------------------------------------------------------------
def _generate(original):
    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        keyword = kwargs.get("cache_implementation") == CACHE_IMPLEMENTATION
        if keyword:
            kwargs = {k: v for k, v in kwargs.items() if k != "cache_implementation"}
        swapped: list = []
        keyword_token, swapped_token = _paged_keyword.set(keyword), _swapped.set(swapped)
        try:
            return original(self, *args, **kwargs)
        finally:
            _paged_keyword.reset(keyword_token)
            _swapped.reset(swapped_token)
            _release_paged_attention(swapped)

    return generate


def _prepare_generation_config(original):
    @functools.wraps(original)
    def prepare(self, *args, **kwargs):
        generation_config, model_kwargs = original(self, *args, **kwargs)
        if _paged_keyword.get():
            generation_config.cache_implementation = CACHE_IMPLEMENTATION
            _paged_keyword.set(False)  # applies to this call's config only
        return generation_config, model_kwargs

    return prepare


def _prepare_cache_for_generation(original):
    @functools.wraps(original)
    def prepare(self, generation_config, model_kwargs, generation_mode, batch_size,
                max_cache_length, *args, **kwargs):
        def stock():
            return original(self, generation_config, model_kwargs, generation_mode, batch_size,
                            max_cache_length, *args, **kwargs)

        cache = model_kwargs.get("past_key_values")
        paged = isinstance(cache, PagedCache)
        if generation_config.cache_implementation != CACHE_IMPLEMENTATION and not paged:
            return stock()
        if not is_supported(self):
            if paged:
                raise UnsupportedModelError(
                    f"A PagedCache was passed to {type(self).__name__}.generate(); supported "
                    f"architectures: {', '.join(SUPPORTED_ARCHITECTURES)}."
                )
            _warn_unsupported(self)
            generation_config.cache_implementation = None
            return stock()
        if cache is not None and not paged:
            return stock()  # a user cache together with cache_implementation: Transformers' error
        if generation_config.output_attentions:
            # Attention weights are never materialized by the paged kernels.
            if paged:
                raise ValueError("output_attentions=True cannot be served from a PagedCache: "
                                 "the paged attention does not materialize attention weights.")
            _warn_stock(self, "output_attentions=True needs attention weights, which the paged "
                              "attention does not materialize")
            generation_config.cache_implementation = None
            return stock()
        if generation_config.use_cache is False:
            return None
        if paged:  # the user's cache, or an assistant's own cache coming back
            cache._is_user_defined = True
            if max_cache_length:  # this call's bound on sequence length
                cache.max_cache_len = max(cache.max_cache_len or 0, max_cache_length)
        else:
            cache = build_cache(self, generation_config, max_cache_length)
            model_kwargs["past_key_values"] = cache
            if generation_config.is_assistant:  # its rejected candidates get cropped
                cache.activate_past_recording()
        cache.begin_generate(model_kwargs.get("attention_mask"))
        _use_paged_attention(self)
        return None

    return prepare


def _prepare_inputs_for_generation(original):
    @functools.wraps(original)
    def prepare(self, *args, **kwargs):
        model_inputs = original(self, *args, **kwargs)
        cache = model_inputs.get("past_key_values")
        if isinstance(cache, PagedCache):
            cache.expect_forward(model_inputs.get("attention_mask"), from_generate=True)
        return model_inputs

    return prepare


def _prefill(original):
    @functools.wraps(original)
    def prefill(self, input_ids, generation_config, model_kwargs, *args, **kwargs):
        if is_supported(self) and paged_prefill.applies(input_ids, generation_config, model_kwargs):
            outputs = paged_prefill.paged_prefill(self, input_ids, generation_config, model_kwargs)
            if outputs is not None:
                return outputs
        return original(self, input_ids, generation_config, model_kwargs, *args, **kwargs)

    return prefill


_WRAPPERS = {
    (GenerationMixin, "generate"): _generate,
    (GenerationMixin, "_prepare_generation_config"): _prepare_generation_config,
    (GenerationMixin, "_prepare_cache_for_generation"): _prepare_cache_for_generation,
    (GenerationMixin, "prepare_inputs_for_generation"): _prepare_inputs_for_generation,
    (GenerationMixin, "_prefill"): _prefill,
    (FalconAttention, "forward"): paged_falcon_attention,
    (FalconFlashAttention2, "forward"): paged_falcon_attention,
}


def enable() -> None:
    """Registers the paged attention and wraps generate (idempotent)."""
    if _originals:
        return
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, paged_mask)
    # Falcon picks its attention class by name when built (from_pretrained(..., "paged")).
    modeling_falcon.FALCON_ATTENTION_CLASSES[ATTENTION_NAME] = FalconAttention
    for (owner, name), wrap in _WRAPPERS.items():
        original = owner.__dict__[name]
        _originals[owner, name] = original
        setattr(owner, name, wrap(original))


def disable() -> None:
    """Restores stock Transformers: unwraps generate and unregisters "paged"."""
    if not _originals:
        return
    for (owner, name), original in _originals.items():
        setattr(owner, name, original)
    _originals.clear()
    ALL_ATTENTION_FUNCTIONS._global_mapping.pop(ATTENTION_NAME, None)
    ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.pop(ATTENTION_NAME, None)
    modeling_falcon.FALCON_ATTENTION_CLASSES.pop(ATTENTION_NAME, None)


def is_enabled() -> bool:
    return bool(_originals)
