"""Everything hf-paged changes in Transformers (5.23) for `generate()`, in one place (the
attention and mask registration both paths need is `hf/register.py`).

`enable()` (run by `import hf_paged`) registers the "paged" attention and mask functions
and wraps four `GenerationMixin` methods:

- `generate`: takes `cache_implementation="paged"` out of the keywords before Transformers
  reroutes it to continuous batching, and restores attention implementations afterwards;
- `_prepare_generation_config`: puts "paged" back into the call's generation config;
- `_prepare_cache_for_generation`: builds (or reuses) a `PagedCache` for supported models
  and switches them to the "paged" attention for the call;
- `_prefill`: runs each distinct prompt once, packed without its pad tokens (prefill.py),
  when nothing stands between generate and the model's forward (`runs_plain_forward`).

The forward of every served model class (and of its decoder stack) is wrapped too
(`_paged_forward`; Llama, Mistral and Falcon at `enable()`, any other class the first time
generate or `prepare_model` sees it): on a `PagedCache` it has the cache plan the forward
from the forward's own 2D mask (or a packed plan) and passes the forward's `PagedForward`
down to the attention as the `paged_kv` keyword. Falcon computes attention inline, so
`FalconAttention.forward` is wrapped (see `hf/falcon.py`). `PeftModel.get_prompt` is wrapped
on first use (prefix tuning's virtual tokens go into the paged cache), and so is the
`prepare_inputs_for_generation` of a model whose generate drops its cache at the LongRoPE
switch (Phi-3: its PagedCache is computed anew). `disable()` undoes all of it and leaves a
warning for `cache_implementation="paged"`, which Transformers would route elsewhere.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import sys
import threading
import types
import warnings
from dataclasses import dataclass, field

from transformers import GenerationMixin
from transformers.cache_utils import Cache

from ..config import PagedCacheConfig
from ..distributed.placement import input_device, model_placement
from ..errors import HFPagedError, UnsupportedModelError
from ..hf.architectures import (
    EAGER_MODELS, SUPPORTED_ARCHITECTURES, attention_features, attention_tp_size,
    check_supported, forward_owner, kv_spec, tp_heads, unsupported_reason,
)
from ..hf.attention import ATTENTION_NAME, KWARG
from ..hf.probe import route_reason
from ..hf.register import register, unregister
from ..hf.rope import recomputes_at_switch
from ..hf.switch import paged_attention, release_paged_attention, use_paged_attention
from ..kv.placement import group_layers
from ..kv.pool import kept_pool
from ..utils import user_stacklevel
from . import prefill as paged_prefill
from .cache import PagedCache
from .eligibility import autocast_reason, runs_plain_forward, stock_reason
from .plan import PLAN_KWARG

CACHE_IMPLEMENTATION = "paged"


@dataclass
class _Call:
    """State of one running generate() call (assisted decoding nests the assistant's)."""

    keyword: bool  # cache_implementation="paged" came as a keyword, not in a config
    switched: list = field(default_factory=list)  # attention switches to release at the end
    caches: list = field(default_factory=list)  # PagedCaches this call generates on


_call: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("hf_paged_call", default=None)
_patch_lock = threading.Lock()

_originals: dict[tuple[type, str], object] = {}


def _warn_stock(model, why: str) -> None:
    warnings.warn(f"hf-paged: {why}; {type(model).__name__} runs this call with Transformers' "
                  "default cache instead.", UserWarning, stacklevel=user_stacklevel())


def _warn_unsupported(model, reason: str) -> None:
    _warn_stock(model, f"cache_implementation='paged' cannot serve this model: {reason}")


def _use_paged_attention(model) -> None:
    """Switches the model's attention to "paged" until the running generate call ends."""
    call = _call.get()
    use_paged_attention(model, call.switched if call is not None else None)


def build_cache(model, generation_config, max_cache_length: int | None) -> PagedCache:
    """A `PagedCache` for `model`.

    A sized pool (num_blocks / max_kv_bytes) is kept for the model and shared by the caches
    of every call with that sizing, concurrent calls and assistant caches included, each
    owning its own blocks. An unsized pool belongs to its call alone.
    """
    cache_config = PagedCacheConfig.from_any(generation_config.cache_config)
    text_config = model.config.get_text_config(decoder=True)
    spec = kv_spec(text_config)
    # A model spread by device_map keeps each layer's KV on that layer's device.
    placement = model_placement(model, spec.num_layers)
    tp_size = attention_tp_size(model)
    pool = None
    if cache_config.is_sized:
        groups, where = group_layers(spec.windows, placement)
        pool = kept_pool(model, cache_config, groups.slots, tp_heads(text_config, tp_size)[1],
                         spec.head_dim, model.dtype, where,
                         v_head_dim=spec.v_head_dim, model_layers=spec.num_layers)
    return PagedCache(text_config, cache_config, dtype=model.dtype, device=placement.primary,
                      pool=pool, max_cache_len=max_cache_length, tp_size=tp_size,
                      placement=placement, features=attention_features(model))


# -- wrappers -------------------------------------------------------------------------------
def _generate(original):
    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        keyword = kwargs.get("cache_implementation") == CACHE_IMPLEMENTATION
        if keyword:
            kwargs = {k: v for k, v in kwargs.items() if k != "cache_implementation"}
        call = _Call(keyword)
        token = _call.set(call)
        try:
            return original(self, *args, **kwargs)
        finally:
            _call.reset(token)
            for cache in call.caches:
                cache.end_generate()
            release_paged_attention(call.switched)

    return generate


def _prepare_generation_config(original):
    @functools.wraps(original)
    def prepare(self, *args, **kwargs):
        generation_config, model_kwargs = original(self, *args, **kwargs)
        call = _call.get()
        if call is not None and call.keyword:
            generation_config.cache_implementation = CACHE_IMPLEMENTATION
            call.keyword = False  # applies to this call's config only
        return generation_config, model_kwargs

    return prepare


def _prepare_cache_for_generation(original):
    @functools.wraps(original)
    def prepare(self, generation_config, model_kwargs, generation_mode, batch_size,
                max_cache_length, *args, **kwargs):
        def stock():
            return original(self, generation_config, model_kwargs, generation_mode, batch_size,
                            max_cache_length, *args, **kwargs)

        def stock_instead():  # (warned): the call and the assistant's calls run stock
            generation_config.cache_implementation = None
            if _is_paged_cache_config(generation_config.cache_config):
                generation_config.cache_config = None  # (or each assistant call warns again)
            return stock()

        cache = model_kwargs.get("past_key_values")
        paged = isinstance(cache, PagedCache)
        if generation_config.cache_implementation != CACHE_IMPLEMENTATION and not paged:
            if _is_paged_cache_config(generation_config.cache_config):
                warnings.warn(
                    "hf-paged: cache_config "
                    f"{generation_config.cache_config!r} has no effect without "
                    "cache_implementation='paged' (this call runs on "
                    f"{generation_config.cache_implementation or 'the default cache'!s}).",
                    UserWarning, stacklevel=user_stacklevel())
            return stock()
        reason = unsupported_reason(self)
        if reason is None:
            reason = route_reason(self, lambda: model_placement(
                self, kv_spec(self.config.get_text_config(decoder=True)).num_layers),
                input_device(self))
        if reason is not None:
            if paged:
                raise UnsupportedModelError(
                    f"A PagedCache was passed to {type(self).__name__}.generate(), which it "
                    f"cannot serve: {reason}.")
            _warn_unsupported(self, reason)
            return stock_instead()
        if cache is not None and not paged:
            return stock()  # a user cache together with cache_implementation: Transformers' error
        if generation_config.output_attentions:
            # Attention weights are never materialized by the paged kernels.
            if paged:
                raise ValueError("output_attentions=True cannot be served from a PagedCache: "
                                 "the paged attention does not materialize attention weights.")
            _warn_stock(self, "output_attentions=True needs attention weights, which the paged "
                              "attention does not materialize")
            return stock_instead()
        reason = stock_reason(self)
        if reason is not None:
            if paged:
                raise HFPagedError(f"This PagedCache cannot serve the call: {reason[0]}. Use "
                                   f"{reason[1]}, or pass no cache.")
            _warn_stock(self, f"{reason[0]}; {reason[1]} brings the paged cache back")
            return stock_instead()
        if generation_config.use_cache is False:
            return None
        if paged:  # the user's cache, or an assistant's own cache coming back
            cache._is_user_defined = True
            if cache.pool is None and cache.placement is None:  # its pool is made later
                cache.placement = model_placement(self, cache.num_layers)
            if max_cache_length:  # this call's bound on sequence length
                cache.max_cache_len = max(cache.max_cache_len or 0, max_cache_length)
        else:
            cache = build_cache(self, generation_config, max_cache_length)
            model_kwargs["past_key_values"] = cache
            if generation_config.is_assistant:  # its rejected candidates get cropped
                cache.activate_past_recording()
        _wrap_peft()
        _wrap_forwards(self)
        cache.begin_generate(model_kwargs.get("attention_mask"), runs_plain_forward(self))
        call = _call.get()
        if call is not None:
            call.caches.append(cache)
        _use_paged_attention(self)
        return None

    return prepare


def _prefill(original):
    @functools.wraps(original)
    def prefill(self, input_ids, generation_config, model_kwargs, *args, **kwargs):
        if (paged_prefill.applies(input_ids, generation_config, model_kwargs)
                and runs_plain_forward(self)):
            outputs = paged_prefill.paged_prefill(self, input_ids, generation_config, model_kwargs)
            if outputs is not None:
                return outputs
        return original(self, input_ids, generation_config, model_kwargs, *args, **kwargs)

    return prefill


def _paged_forward(original):
    """Wraps a supported model's forward (`LlamaForCausalLM.forward`, and `LlamaModel.forward`
    under it, ...): on a PagedCache, the cache plans the forward from its explicit inputs
    (the 2D mask, or a packed plan given as `paged_plan`) before any layer runs, and the
    forward's `PagedForward` travels down to every attention call as the `paged_kv` keyword.
    The inner wrapper of a forward the outer one started only passes the keyword on."""
    signature = inspect.signature(original)
    names = list(signature.parameters)
    cache_at = names.index("past_key_values") - 1  # position among the arguments after self

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        plan = kwargs.pop(PLAN_KWARG, None)
        if len(args) > cache_at:  # rare: the cache given by position
            kwargs = dict(signature.bind_partial(self, *args, **kwargs).arguments)
            kwargs.pop(names[0])
            kwargs.update(kwargs.pop("kwargs", {}))
            args = ()
        cache = kwargs.get("past_key_values")
        if not isinstance(cache, PagedCache):
            return original(self, *args, **kwargs)
        if cache.in_forward:  # the head's wrapper started this forward
            kwargs.setdefault(KWARG, cache.current_forward())
            return original(self, *args, **kwargs)
        if self.config._attn_implementation != ATTENTION_NAME:
            raise HFPagedError(
                "A PagedCache was passed to a model whose attention implementation is not "
                f"'paged' (it is {self.config._attn_implementation!r}). Load the model with "
                "attn_implementation='paged' (or call model.set_attn_implementation('paged'), "
                "where the model allows changing it after loading; Falcon does not), or use "
                "generate(..., cache_implementation='paged'), which switches it."
            )
        reason = autocast_reason(self)
        if reason is not None:
            raise HFPagedError(f"A PagedCache cannot serve this forward: {reason}.")
        inputs = args[0] if args else kwargs.get("input_ids")  # input_ids comes first
        if inputs is None:
            inputs = kwargs.get("inputs_embeds")
        rows, q_len = inputs.shape[:2]
        kwargs[KWARG] = cache.begin_forward(rows, q_len, kwargs.get("attention_mask"), plan)
        try:
            return original(self, *args, **kwargs)
        finally:
            cache.end_forward()

    return forward


def _refilled_at_switch(original):
    """Phi-3's `prepare_inputs_for_generation` drops the cache to compute a sequence anew
    once it grows past the LongRoPE switch: a PagedCache dropped there is emptied (its pool
    kept) and given to that forward to fill again. (Other forwards without a cache, such as
    classifier-free guidance's, are not generate's steps and keep none.)"""

    @functools.wraps(original)
    def prepare(self, input_ids, *args, **kwargs):
        inputs = original(self, input_ids, *args, **kwargs)
        cache = args[0] if args else kwargs.get("past_key_values")
        if isinstance(cache, PagedCache) and inputs.get("past_key_values") is None \
                and inputs.get("use_cache") is not False:
            cache.recompute()
            inputs["past_key_values"] = cache
        return inputs

    return prepare


def _is_paged_cache_config(cache_config) -> bool:
    """A non-empty dict of hf-paged settings only (other caches take cache_config too)."""
    return (isinstance(cache_config, dict) and bool(cache_config)
            and set(cache_config) <= set(PagedCacheConfig.__dataclass_fields__))


def _peft_get_prompt(original):
    """PEFT prefix tuning injects its virtual keys and values as a fresh DynamicCache at the
    first step; on a paged call they become the paged cache's first tokens, shared by all
    rows, and the paged cache is what the model gets."""

    @functools.wraps(original)
    def get_prompt(self, batch_size, *args, **kwargs):
        prompt = original(self, batch_size, *args, **kwargs)
        call = _call.get()
        cache = call.caches[-1] if call is not None and call.caches else None
        if not isinstance(prompt, Cache) or cache is None or cache.get_seq_length():
            return prompt
        try:
            cache.load_prefix([layer.keys for layer in prompt.layers],
                              [layer.values for layer in prompt.layers])
        except ValueError as err:
            _warn_stock(self, f"PEFT prefix tuning's virtual tokens do not fit the paged cache: {err}")
            return prompt
        return cache

    return get_prompt


def _wrap_once(owner: type, name: str, wrap) -> None:
    """Puts wrap(original) in place of `owner.name`, once (`disable` puts it back)."""
    if (owner, name) not in _originals:
        with _patch_lock:
            if (owner, name) not in _originals:
                _originals[owner, name] = original = owner.__dict__[name]
                setattr(owner, name, wrap(original))


def _wrap_peft() -> None:
    """Wraps `PeftModel.get_prompt` once PEFT is loaded (a PEFT model exists only then)."""
    owner = getattr(sys.modules.get("peft.peft_model"), "PeftModel", None)
    if owner is not None and _originals:
        _wrap_once(owner, "get_prompt", _peft_get_prompt)


def _paged_requested(model, kwargs) -> bool:
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    return CACHE_IMPLEMENTATION in (kwargs.get("cache_implementation"),
                                    getattr(config, "cache_implementation", None))


def _disabled_notice(original):
    """What `disable()` leaves on generate: Transformers' own behaviour, plus a warning when
    "paged" is asked for, since Transformers then reroutes it to its continuous batching."""

    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        if _paged_requested(self, kwargs):
            warnings.warn(
                "hf-paged is disabled (hf_paged.disable()): cache_implementation='paged' now runs "
                "Transformers' own continuous batching or cache, not hf-paged. Call "
                "hf_paged.enable() to use the paged cache.",
                UserWarning, stacklevel=user_stacklevel())
        return original(self, *args, **kwargs)

    generate._hf_paged_notice = original
    return generate


_WRAPPERS = {
    (GenerationMixin, "generate"): _generate,
    (GenerationMixin, "_prepare_generation_config"): _prepare_generation_config,
    (GenerationMixin, "_prepare_cache_for_generation"): _prepare_cache_for_generation,
    (GenerationMixin, "_prefill"): _prefill,
    **{(model, "forward"): _paged_forward for model in EAGER_MODELS},
}


def _wrap_forwards(model) -> None:
    """Wraps the forward of `model`'s class and of its decoder stack's (`model.model`), once
    per class, so that a PagedCache passed to them is prepared (see `_paged_forward`), and
    the step preparation of a class whose generate drops its cache at the LongRoPE switch."""
    if not _originals:  # disabled
        return
    if recomputes_at_switch(model):
        _wrap_once(next(c for c in type(model).__mro__
                        if "prepare_inputs_for_generation" in c.__dict__),
                   "prepare_inputs_for_generation", _refilled_at_switch)
    for module in (model, getattr(model, "base_model", model)):
        owner = forward_owner(module)
        if owner is None:
            continue
        _wrap_once(owner, "forward", _paged_forward)
        # accelerate's hooks (device_map, offload) call the forward the module had when they
        # were attached, bound to it: one bound before the class was wrapped ran unwrapped.
        hooked = module.__dict__.get("_old_forward")
        if getattr(hooked, "__func__", None) is _originals[owner, "forward"]:
            module._old_forward = types.MethodType(owner.forward, module)


def prepare_model(model) -> None:
    """Makes `model`'s forward prepare a `PagedCache` passed to it directly (generate() and
    the engine do this themselves). Raises `UnsupportedModelError` naming the reason when
    the paged cache cannot serve the model."""
    check_supported(model)
    enable()
    _wrap_forwards(model)


def enable() -> None:
    """Registers the paged attention and wraps generate (idempotent)."""
    if _originals:
        return
    stock_generate = GenerationMixin.__dict__["generate"]
    if hasattr(stock_generate, "_hf_paged_notice"):  # left by disable()
        GenerationMixin.generate = stock_generate._hf_paged_notice
    register()
    for (owner, name), wrap in _WRAPPERS.items():
        original = owner.__dict__[name]
        _originals[owner, name] = original
        setattr(owner, name, wrap(original))


def disable() -> None:
    """Restores stock Transformers: unwraps generate and unregisters "paged". A generate call
    asking for cache_implementation="paged" afterwards gets a warning saying so."""
    if not _originals:
        return
    for (owner, name), original in _originals.items():
        setattr(owner, name, original)
    _originals.clear()
    GenerationMixin.generate = _disabled_notice(GenerationMixin.__dict__["generate"])
    unregister()


def is_enabled() -> bool:
    return bool(_originals)


__all__ = ["CACHE_IMPLEMENTATION", "SUPPORTED_ARCHITECTURES", "build_cache", "disable", "enable",
           "is_enabled", "paged_attention", "prepare_model", "runs_plain_forward"]
