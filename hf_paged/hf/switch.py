"""The attention switch: a model's attention implementation set to "paged" while paged
forwards run, shared by concurrent users of one model and restored by the last one out.

The switch is on the model's config, which every thread sees: a stock forward on another
thread may build its mask before the switch and run its attention after it, or the reverse.
So the switch remembers the config's own implementation (`original_implementation`), and
"paged" runs exactly that implementation's mask and attention for a forward that is not a
paged one (hf/attention.py): which name such a forward reads makes no difference.
"""

from __future__ import annotations

import contextlib
import threading

from .attention import ATTENTION_NAME, let_go, remember_original
from .falcon import ConfigView
from .register import is_registered, register

# id(config) -> [config, its own attention implementation, users of the switch]
_switched: dict[int, list] = {}
_switch_lock = threading.Lock()


def attention_configs(model, modules: list | None = None) -> list:
    """The configs the model's attention layers read their implementation from: the model's
    own, then any other an attention layer holds (one copied with `copy.deepcopy` holds a
    copy of the config, which a switch of the model's alone would not reach).
    modules: the model's, if the caller has them listed (a wrapper's: a PEFT model's)."""
    configs = {id(model.config): model.config}
    for module in model.modules() if modules is None else modules:
        config = module.__dict__.get("config") if "layer_idx" in module.__dict__ else None
        if isinstance(config, ConfigView):  # (Falcon's: the config it views is switched)
            config = config._config
        if config is not None and id(config) not in configs \
                and hasattr(config, "_attn_implementation_internal"):
            configs[id(config)] = config
    return list(configs.values())


def use_paged_attention(model, swapped: list | None, configs: list | None = None) -> None:
    """Switches the model's attention to "paged". `swapped` records the switch so that
    `release_paged_attention(swapped)` undoes it; None switches for good. configs: the
    model's `attention_configs`, if the caller has them."""
    with _switch_lock:
        if not is_registered():  # after hf_paged.disable(): an engine still needs "paged"
            register()
        for config in configs or attention_configs(model):
            _switch(config, swapped)


def _switch(config, swapped: list | None) -> None:
    entry = _switched.get(id(config))
    if entry is None:
        if config._attn_implementation == ATTENTION_NAME:
            return  # loaded with attn_implementation="paged", or switched for good
        remember_original(config, config._attn_implementation)
        if swapped is None:
            config._attn_implementation_internal = ATTENTION_NAME
            return
        entry = _switched[id(config)] = [config, config._attn_implementation_internal, 0]
        config._attn_implementation_internal = ATTENTION_NAME
    if swapped is not None:
        entry[2] += 1
        swapped.append(entry)


def release_paged_attention(entries: list) -> None:
    with _switch_lock:
        for entry in entries:
            entry[2] -= 1
            if entry[2] == 0:
                config, implementation, _ = _switched.pop(id(entry[0]))
                config._attn_implementation_internal = implementation
                let_go(config)


@contextlib.contextmanager
def paged_attention(model, configs: list | None = None):
    """Inside, the model's attention is "paged" (shared with concurrent generate calls,
    restored by the last one out). configs: as `use_paged_attention`'s."""
    entries: list = []
    use_paged_attention(model, entries, configs)
    try:
        yield
    finally:
        release_paged_attention(entries)
