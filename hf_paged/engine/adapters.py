"""LoRA adapters loaded and unloaded while the engine runs (vLLM's runtime LoRA updates).

`load` adds a PEFT LoRA adapter from a folder: into the PEFT model the engine serves, or,
for a plain model, by wrapping the engine's own copy of its modules (sharing its weights)
in one: requests without an adapter keep running on the base model, and so does the
caller's model object, which PEFT never touches. `unload` is two-phased: the adapter first
stops taking new requests; it is deleted, and its prefix-cache blocks dropped (a later
adapter of the same name must not find them), only once no request of it is left.
Everything here runs between steps on the engine's thread; a forward never sees an adapter
change under it.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import os
import types

import torch

from ..core.prefix_cache import namespace
from ..errors import InvalidRequestError, ModelChangedError, UnsupportedModelError, describe

BASE = "__base__"  # the adapter name of a PEFT model's base model (PEFT's own name for it)
_SHARED = ("_parameters", "_buffers")  # what `private_copy`'s modules share with the caller's


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """vLLM's name for an adapter a request runs (`LLM.generate(..., lora_request=...)`):
    the adapter in folder `lora_path`, loaded as `lora_name` by the first call that names
    it (as `engine.lora.load` loads one), run by name from then on. `lora_int_id` is
    vLLM's positive id; adapters are told apart by name here."""

    lora_name: str
    lora_int_id: int = 1
    lora_path: str = ""


def load_requested(engine, request: LoRARequest | None) -> str | None:
    """The adapter name of a `LoRARequest` (None: none), its folder loaded first if no
    adapter of that name is (on the thread that steps `engine`, between steps)."""
    if request is None:
        return None
    if request.lora_name not in engine.runner.adapters:
        engine.lora.load(request.lora_name, request.lora_path)
    return request.lora_name


def default_adapter(runner) -> str | None:
    """The adapter a request that names none runs, by name, so that its prefix-cache
    blocks and its hold on the adapter are that adapter's: the base model for a plain
    model wrapped to load adapters, else the model as given."""
    return BASE if runner.none_means_base else as_given(runner)


def as_given(runner) -> str | None:
    """The adapter the runner's model runs called as it is: PEFT's one active adapter
    (BASE with none active); None for a plain model, or several adapters active at once
    (no one name for their sum)."""
    if not runner.adapters:
        return None
    active = getattr(runner.model, "active_adapters", None)
    active = [active] if isinstance(active, str) else list(active or [])
    if not active:
        return BASE
    return active[0] if len(active) == 1 and active[0] in runner.adapters else None


def forward_adapter(runner, adapter: str | None) -> str | None:
    """What a forward of `adapter`'s requests asks the model for: None to call it as it is
    (compiled, where it is), or an adapter name for PEFT to pick per row."""
    if adapter is None and runner.none_means_base:  # (admitted before the model was wrapped)
        adapter = BASE
    return None if adapter is not None and adapter == as_given(runner) else adapter


def drop_row_hooks(model) -> None:
    """After a forward naming adapters per row raised: PEFT hands the names to its layers
    through pre-hooks that it removes after the forward, but not when the forward raises (a
    merged adapter, ...). Left in place, they would run the failed forward's adapters in
    every later forward of the model."""
    from peft.tuners.lora import model as lora

    stale = {getattr(lora, name, None) for name in (
        "_adapter_names_pre_forward_hook", "_alora_offsets_pre_forward_hook")} - {None}
    for module in model.modules():
        hooks = module._forward_pre_hooks
        for key in [k for k, h in hooks.items() if getattr(h, "func", None) in stale]:
            del hooks[key]
            module._forward_pre_hooks_with_kwargs.pop(key, None)


class RuntimeAdapters:
    """The engine's adapters, changeable at runtime."""

    def __init__(self, engine):
        self.engine = engine
        self.unloading: set[str] = set()  # adapters taking no new requests
        if engine.runner.adapters and engine.runner.tp_size == 1:  # (a forward: no collectives)
            check_side_by_side(engine.runner)  # those of a PEFT model given to the engine

    def _check(self) -> None:
        runner = self.engine.runner
        if runner.compiled is not None:
            raise InvalidRequestError("adapters cannot be loaded or unloaded under compile=True "
                                      "(the compiled forward holds the model as it was).",
                                      "lora_name")
        if runner.tp_size > 1:
            raise InvalidRequestError("adapters cannot be loaded or unloaded under tensor "
                                      "parallelism.", "lora_name")

    def load(self, name: str, path: str) -> None:
        """Loads the LoRA adapter in folder `path` as `name`. InvalidRequestError (nothing
        changed) for a name in use, a missing folder or an adapter that is not LoRA-style."""
        self._check()
        runner = self.engine.runner
        if not isinstance(name, str) or not name or name == BASE:
            raise InvalidRequestError(f"lora_name must be a non-empty string other than "
                                      f"{BASE!r}; got {name!r}.", "lora_name")
        if name in runner.adapters:
            raise InvalidRequestError(f"The adapter {name!r} is already loaded.", "lora_name")
        if not os.path.isfile(os.path.join(str(path), "adapter_config.json")):
            raise InvalidRequestError(f"lora_path {path!r} is not a PEFT adapter folder (no "
                                      "adapter_config.json).", "lora_path")
        if runner.model is runner.base and getattr(runner.model, "peft_config", None):
            raise InvalidRequestError(
                "This model holds adapters that Transformers' own load_adapter put in, which "
                "run on every request as part of the model; PEFT could not pick one per "
                "request beside them. Serve a peft.PeftModel instead (its adapters are named "
                "per request), or the model without adapters.", "lora_path")
        from peft import PeftConfig, PeftModel

        try:
            config = PeftConfig.from_pretrained(path)
        except Exception as err:  # noqa: BLE001 (not JSON, not an object, an unknown type)
            raise InvalidRequestError(f"lora_path {path!r} holds an adapter_config.json PEFT "
                                      f"cannot read: {describe(err)}", "lora_path") from err
        if getattr(config, "is_prompt_learning", False) or config.peft_type != "LORA":
            raise InvalidRequestError(f"The engine loads LoRA adapters; {path!r} is "
                                      f"{config.peft_type}.", "lora_path")
        with self._own_change():
            before = (_snapshot(runner.model), runner.model, runner.copied)
            try:
                if hasattr(runner.model, "load_adapter") and hasattr(runner.model, "peft_config"):
                    runner.model.load_adapter(path, adapter_name=name)
                else:  # a plain model: wrapped, its requests without an adapter stay on the base
                    trainable = [(p, p.requires_grad) for p in runner.model.parameters()]
                    copied = []
                    try:  # (PEFT freezes every base parameter: shared with the caller's model)
                        runner.model = PeftModel.from_pretrained(
                            private_copy(runner.model, copied), path, adapter_name=name).eval()
                    finally:
                        for parameter, flag in trainable:
                            parameter.requires_grad_(flag)
                    runner.copied = copied
                runner.adapters.append(name)
                check_side_by_side(runner)
            except Exception as err:  # noqa: BLE001 (shapes that do not fit this model, ...)
                # PEFT put the adapter's layers in before its weights failed (or before it
                # turned out not to run beside the others): the model goes back as it was.
                _restore(before[0])
                runner.model, runner.copied = before[1:]
                if name in runner.adapters:
                    runner.adapters.remove(name)
                if isinstance(err, UnsupportedModelError):
                    raise InvalidRequestError(str(err), "lora_path") from err
                raise InvalidRequestError(f"The adapter {name!r} could not be loaded from "
                                          f"{path!r}: {err}", "lora_path") from err
        self.engine.model = runner.model

    def begin_unload(self, name: str) -> None:
        """`name` takes no new requests; the ones it has finish."""
        self._check()
        if name not in self.engine.runner.adapters or name in self.unloading:
            raise InvalidRequestError(f"The adapter {name!r} is not loaded; loaded: "
                                      f"{self.live}.", "lora_name")
        self.unloading.add(name)

    def in_use(self, name: str) -> bool:
        # (a request with no adapter's name runs the sum of several active ones)
        return any(r.adapter in (name, None) and not r.finished
                   for r in self.engine.requests.values())

    def finish_unload(self, name: str) -> bool:
        """Deletes `name` and drops its prefix-cache blocks, once no request of it is left:
        False (nothing done) while one is. (Checked here, on the stepping thread, not only
        before: a request prepared before `begin_unload` may be queued after a check.)"""
        if self.in_use(name):
            return False
        runner = self.engine.runner
        with self._own_change():
            active = [a for a in runner.model.active_adapters if a != name]
            trainable = [(p, p.requires_grad) for p in runner.model.parameters()]
            runner.model.delete_adapter(name)  # (which marks an adapter it activates trainable)
            runner.adapters.remove(name)
            self.unloading.discard(name)
            if runner.model.peft_config:  # every layer runs what the model runs unnamed
                _activate(runner.model, active or [next(iter(runner.model.peft_config))])
                for parameter, flag in trainable:
                    parameter.requires_grad_(flag)
            else:
                # The last one: back to the plain model. (PEFT keeps the deleted adapter as
                # the active one, and every forward after a later load then fails on its name.)
                runner.model = runner.base if runner.none_means_base else \
                    runner.model.base_model.unload().eval()
                runner.copied = None
                self.engine.model = runner.model
        for adapter in (name, None):  # every salt of it; None: blocks of the sum of several
            self.engine.scheduler.prefix.forget(namespace(adapter)[:-1])
        return True

    @contextlib.contextmanager
    def _own_change(self):
        """Around the engine's own change of its adapters: a change the model's owner made
        before it still makes the scheduler forget its prefixes (`ModelWatch`); this one
        does not (the prefix cache keeps adapters apart by name)."""
        runner = self.engine.runner
        if runner.model_changed():
            self.engine.scheduler.forget_prefixes()
        try:
            yield
        finally:
            runner.watch.changed(runner.model)  # (the new baseline)

    def check_name(self, adapter: str) -> None:
        """InvalidRequestError unless a request may name `adapter`: a live one, or BASE (the
        served model; with adapters Transformers put in, the model with them, as it runs)."""
        if adapter not in self.live + [BASE]:
            runner = self.engine.runner
            built_in = runner.model is runner.base and getattr(runner.model, "peft_config", None)
            raise InvalidRequestError(
                f"unknown adapter {adapter!r}; the model has {self.live}." + (
                    f" (Its adapters {list(built_in)}, which Transformers' load_adapter put "
                    "in, run on every request as part of the model: serve a peft.PeftModel "
                    "to name one per request.)" if built_in else ""), "model")

    @property
    def live(self) -> list[str]:
        """Adapters that take requests."""
        return [a for a in self.engine.runner.adapters if a not in self.unloading]


def _activate(model, active: list[str]) -> None:
    """Makes `active` the adapters of every layer of a PEFT model. After a delete, PEFT
    moves each layer that ran the deleted adapter to one of that layer's own (or keeps the
    deleted name as the model's): layers would disagree, and the model's name for what it
    runs unnamed would be wrong."""
    model.base_model.set_adapter(active if len(active) > 1 else active[0])
    model.active_adapter = active[0]  # (PeftModel's own: the config its forward reads)


def check_side_by_side(runner) -> None:
    """Runs a one-token forward of the base model and of each loaded adapter as the engine
    calls them (by name per row, or as the model is); UnsupportedModelError if one fails.
    PEFT cannot run some adapters beside others: a DoRA adapter named per row, or an
    adapter beside one with `modules_to_save`. Refused when loaded, they would fail every
    request of theirs instead."""
    ids = torch.zeros(1, 1, dtype=torch.long, device=runner.device)
    for adapter in [default_adapter(runner), *runner.adapters]:
        name = forward_adapter(runner, adapter)
        try:
            with torch.inference_mode():
                runner.model(input_ids=ids, use_cache=False,
                             **({} if name is None else {"adapter_names": [name]}))
        except Exception as err:  # noqa: BLE001
            what = "the base model" if adapter in (None, BASE) else f"the adapter {adapter!r}"
            raise UnsupportedModelError(
                f"PEFT cannot run {what} beside the others of {runner.adapters} "
                f"({type(err).__name__}: {str(err).rstrip('.')}): PEFT runs an adapter named "
                "per request only if it is LoRA without DoRA, none is merged into the weights "
                "and no adapter loaded beside it has modules_to_save. Serve it apart, unmerge, "
                "or load it first (the first adapter runs unnamed).") from err


def private_copy(model, copied: list | None = None):
    """A copy of `model`'s module tree for PEFT to put adapter layers into: new module
    objects sharing every parameter, buffer and config with `model`, and each module's
    dicts of them (a parameter or buffer the caller puts in place of another is the copy's
    too). Each copy's other dicts, lists and sets are copied, with references to modules of
    the tree turned into the copies' and methods and partials bound to a module
    (accelerate's device hooks) rebound to its copy. copied: gets (module, its children
    now, its name) for each (`follow`)."""
    copies = {id(m): object.__new__(type(m)) for m in model.modules()}
    if copied is not None:
        copied += [(m, dict(m._modules), name) for name, m in model.named_modules()]

    def mapped(value, module):
        if isinstance(value, (dict, list, set)):
            container = copy.copy(value)  # (its own type: OrderedDict, defaultdict, ...)
            container.clear()
            if isinstance(value, dict):
                container.update((k, mapped(v, module)) for k, v in value.items())
            elif isinstance(value, set):
                container.update(mapped(v, module) for v in value)
            else:
                container.extend(mapped(v, module) for v in value)
            return container
        if isinstance(value, torch.nn.Module):
            return copies.get(id(value), value)
        if isinstance(value, types.MethodType) and value.__self__ is module:
            return types.MethodType(value.__func__, copies[id(module)])
        if isinstance(value, functools.partial) and value.args and value.args[0] is module:
            bound = functools.partial(value.func, copies[id(module)], *value.args[1:],
                                      **value.keywords)
            return functools.update_wrapper(bound, value)
        return value

    for module in model.modules():
        copies[id(module)].__dict__.update(
            (key, value if key in _SHARED else mapped(value, module))
            for key, value in module.__dict__.items())
    return copies[id(model)]


def follow(copied: list) -> None:
    """ModelChangedError for a module the caller put into its model in place of another,
    added or removed since the engine copied its modules (`private_copy`): the copy, with
    PEFT's layers in it, cannot follow. (Parameters and buffers need nothing: shared.)"""
    for module, children, name in copied:
        if module._modules != children:
            changed = sorted(k for k in module._modules.keys() | children.keys()
                             if module._modules.get(k) is not children.get(k))
            raise ModelChangedError(
                f"the model's {', '.join(f'{name}.{k}' if name else k for k in changed)} "
                "changed (a module put in, replaced or removed) since this engine loaded a "
                "runtime adapter into its own copy of the model's modules, which cannot "
                "follow. Build a new LLM (or LLMEngine) on the model as it is now, or put "
                "the module back.")


def _snapshot(model) -> list:
    """What loading an adapter may change in `model`, to put back when the load fails:
    each module's attributes, children, parameters and buffers (PEFT replaces layers,
    adds entries to their adapter dicts and a `peft_config` to the model in place)."""
    return [(m, dict(m.__dict__), {k: dict(v) for k, v in m.__dict__.items()
                                   if isinstance(v, dict)}) for m in model.modules()]


def _restore(snapshot: list) -> None:
    for module, attributes, dicts in snapshot:
        module.__dict__.clear()
        module.__dict__.update(attributes)
        for key, saved in dicts.items():
            attributes[key].clear()
            attributes[key].update(saved)
