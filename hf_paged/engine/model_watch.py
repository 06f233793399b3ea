"""What the engine watches of the caller's model while it serves.

The engine runs the model object it was given, so what its owner does to that model later
reaches the engine's steps: an optimizer step or `load_state_dict` between calls (the RL
loop), a layer replaced, added or removed, a cast or a move, `model.train()`, and on a PEFT
model an adapter loaded, switched, disabled, merged or rescaled. A cast, a move, dropout in
training mode or a layer beyond those the pool holds is an error (the pool holds the K/V
of those layers, in one dtype on one device); any other change makes the K/V cached before
it stale (the scheduler forgets its prefixes), and one that changes which tensors or which
path the forward takes makes captured decode graphs stale too.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from ..errors import ModelChangedError
from ..hf.switch import attention_configs

# (how often the modules were listed; each parameter slot's (id, version, data_ptr) or None;
# the adapters' names and state)
State = tuple[int, list, tuple | None]


class ModelWatch:
    """The model's dtype, device, dropout and weights as the engine last saw them, and the
    configs its attention layers read (`configs`: what the attention switch sets)."""

    def __init__(self, model, base):
        self.base = base
        # Randomness the model would draw if put back in training mode: (a module whose
        # `training` says, what): a dropout module, or one its forward applies from the
        # config (Falcon's `hidden_dropout` through `dropout_add`, an MoE router's jitter).
        self.randomness = next(((m, f"dropout (p={m.p})") for m in model.modules()
                             if isinstance(m, torch.nn.Dropout) and m.p > 0), None) \
            or _config_randomness(model)
        # One parameter: a model cast or moved after this would write keys and values of
        # another dtype, or on another device, into the pool.
        self.watched = next((p for p in base.parameters() if p.is_floating_point()), None)
        self.built_for = self.watched is not None and (self.watched.dtype,
                                                       self.watched.device)
        self._listed = None  # (the model, its adapters) whose parameter slots `_slots` lists
        self._layouts = 0  # how often they were listed
        self._state = self.state(model)
        self.layer_limit = self.layers  # the pool holds these layers' K/V

    def check(self) -> None:
        """ModelChangedError if the model was cast or moved since the pool was built, or put
        back in training mode with dropout to apply."""
        p = self.watched
        if p is not None and (p.dtype, p.device) != self.built_for:
            raise ModelChangedError(
                f"the model is now {p.dtype} on {p.device}, but this engine was built for "
                f"{self.built_for[0]} on {self.built_for[1]}: its KV pool holds that. Build a "
                "new LLM (or LLMEngine) on the model as it is now, or cast or move it back.")
        if self.randomness is not None and self.randomness[0].training:
            raise ModelChangedError(
                f"the model is in training mode (model.train()) and has {self.randomness[1]}: "
                "its tokens would be random. Call model.eval() first.")

    def changed(self, model) -> tuple[bool, bool]:
        """(whether the model's weights or adapters changed since the last look (or since
        the engine was built): K/V cached before came from another model; whether the
        forward's tensors or path did: a parameter replaced or re-stored (its identity or
        storage), a module replaced, an adapter loaded, switched, disabled, merged or
        rescaled, which graphs captured before would not see). ModelChangedError if it
        now has layers beyond those the pool holds (added since)."""
        state = self.state(model)
        if self.layers > self.layer_limit:  # (an error before anything runs)
            raise ModelChangedError(
                f"the model now has attention layers up to layer_idx {self.layers - 1}, but "
                f"this engine's KV pool holds {self.layer_limit} layers. Build a new LLM (or "
                "LLMEngine) on the model as it is now.")
        old, self._state = self._state, state
        if state == old:
            return False, False
        (layout, weights, adapters), (old_layout, old_weights, old_adapters) = state, old
        return True, layout != old_layout or adapters != old_adapters or (
            [w and w[::2] for w in weights] != [w and w[::2] for w in old_weights])

    def state(self, model) -> State:
        """How often the model's modules were listed (again whenever one was put in place of
        another, or adapters were added or removed); each parameter's identity, version
        (bumped by in-place updates: an optimizer step, load_state_dict) and storage, None
        for one on "meta" (offloaded: its hooks load a new tensor for each forward, from
        weights nothing updates); then the state of a PEFT model's adapters
        (`adapters_state`)."""
        adapters = getattr(model, "peft_config", None)
        names = None if adapters is None else tuple(adapters)
        # Listed once per model, set of adapters and set of modules: walking the modules
        # costs more than reading every parameter and every module's place.
        if self._listed is None or self._listed[0] is not model or self._listed[1] != names \
                or [places.get(name) for places, name in self._places] != self._children \
                or [len(places) for places in self._parents] != self._sizes:
            self._listed, self._layouts = (model, names), self._layouts + 1
            modules = list(model.modules())
            # Each module's children by name (one replaced) and how many (one added).
            self._parents = [m._modules for m in modules]
            self._sizes = [len(places) for places in self._parents]
            self._places = [(m._modules, name) for m in modules for name in m._modules]
            self._children = [places.get(name) for places, name in self._places]
            self._slots = [(m._parameters, name) for m in modules
                           for name, p in m._parameters.items() if p is not None]
            self.configs = attention_configs(self.base, modules)
            # Layers the forward indexes its K/V by (added layers: more than the pool holds).
            self.layers = 1 + max((m.__dict__["layer_idx"] for m in modules
                                   if isinstance(m.__dict__.get("layer_idx"), int)), default=-1)
            self._tuners = () if names is None else tuner_layers(modules)
        params = [slots.get(name) for slots, name in self._slots]  # (None: deleted since)
        try:
            weights = [None if p is None or p.is_meta else (id(p), p._version, p.data_ptr())
                       for p in params]
        except RuntimeError:  # an inference tensor (made under inference_mode) has no version
            weights = [None if p is None or p.is_meta else (
                id(p), -1 if p.is_inference() else p._version, p.data_ptr()) for p in params]
        return (self._layouts, weights,
                None if names is None else (names, adapters_state(self._tuners)))


def tuner_layers(modules) -> list:
    """A PEFT model's adapter layers. Each is watched: an adapter may sit on some layers
    only, and `set_scale` or a merge can reach one layer alone."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in modules if isinstance(m, BaseTunerLayer)]


def adapters_state(layers: list) -> tuple | None:
    """What decides which adapters a PEFT model's layers add, and how: the active ones,
    whether they are disabled (`with model.disable_adapter()`) and those merged into the
    base weights, as the first layer has them (PEFT switches every layer at once), and each
    layer's scalings and merges (`set_scale` and a merge can reach one layer alone)."""
    if not layers:
        return None
    first = layers[0]
    return (tuple(first.active_adapters), first.disable_adapters,
            tuple(first.merged_adapters),
            [(len(layer.merged_adapters), tuple(layer.scaling.values())
              if isinstance(getattr(layer, "scaling", None), dict) else None)
             for layer in layers])


def _config_randomness(model) -> tuple | None:
    """(model, what) for a config setting the forward draws random numbers with in training
    mode (dropout, layer drop, router jitter; nested settings such as DBRX's `ffn_config`
    included), outside attention (the paged attention applies no dropout) and outside the
    heads of other tasks (`classifier_dropout`, `summary_first_dropout`), or None."""
    todo = [("", model.config.get_text_config(decoder=True))]
    while todo:
        prefix, config = todo.pop()
        items = config.items() if isinstance(config, dict) else vars(config).items()
        for name, value in sorted((str(k), v) for k, v in items):
            if isinstance(value, (dict, PretrainedConfig)):
                todo.append((f"{prefix}{name}.", value))
            elif any(part in name for part in ("dropout", "pdrop", "jitter", "layerdrop")) \
                    and not any(part in name for part in ("att", "classifier", "summary")) \
                    and isinstance(value, float) and value > 0:
                return model, f"{prefix}{name}={value}"
    return None
