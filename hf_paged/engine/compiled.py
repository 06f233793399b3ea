"""The engine's forward under torch.compile: fullgraph, dynamic token counts, and guards
on the inputs only, in a code object of the model's own keyed by the model's state."""

from __future__ import annotations

import functools
import itertools
import logging
import re
import types
import weakref

import torch
from torch.fx.experimental import _config as fx_config
from torch.nn.modules import module as module_hooks

logger = logging.getLogger("hf_paged")

# model -> {(backend, variant, `model_state`): entry point}.
# The entry points take the model as an argument: none keeps it alive.
_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

# Graphs one entry point may hold. A varied workload takes 7 to 10 (decode-only, prompt-only
# and mixed steps, each with or without split parts, and the sizes of 1 Dynamo specializes
# on): Dynamo's default of 8 would fail a step's requests (fullgraph) past it.
RECOMPILE_LIMIT = 64

# What tracing or compiling a forward raises (a compiled graph that runs raises its op's own
# error): the model's code does what one graph cannot hold (DBRX's experts loop over the
# experts a batch hit, a data-dependent count), or the recompile limit was reached.
COMPILE_ERRORS = tuple(e for e in (torch._dynamo.exc.TorchDynamoException,
                                   getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", None))
                       if e is not None)


def compile_forward(model, backend: str, variant: tuple = (), model_guards: bool = False):
    """`model(**inputs)` compiled with `backend` (fullgraph, dynamic shapes).

    variant: what else the traced graphs depend on (the engine's pool dtype, block size,
    linear layers through oneDNN or not, attention backends): each variant gets an entry
    point, and a recompile limit, of its own. Dynamo's recompile limit is raised
    process-wide to `RECOMPILE_LIMIT` (it is one setting, read when a graph is added).

    Dynamo re-checks a compiled function's guards before every call, some 500 for a small
    model, which cost as much as the rest of a small decode step's host work. Only those on
    the inputs (ids, positions, the metadata: what tells one step's graph from another's)
    and the ambient state (grad mode, torch's global settings, the relations of symbolic
    sizes) are kept. Those on the model (its weights, modules, hooks, plain attributes and
    config) and on Transformers' globals are left out, as vLLM leaves out every guard: the
    engine holds the model unchanged for its life (an adapter change is refused under
    compile), and the entry point is keyed by what they would have checked as it is when
    the engine starts (`model_state`). Dynamo keeps graphs and guards per code object, and
    every model of a class shares its forward's, so the entry point is a code object of
    this model's own: engines on the same, unchanged model share its graphs; a model
    changed between engines (a hook added, an attribute or its config set, its weights
    resized) gets graphs of its own, and no other model ever finds graphs whose guards do
    not look at it. model_guards: keep the guards on the model too (not its weights), for
    a model changed in place while it serves (a PEFT model's adapters are switched,
    disabled, merged), whose graphs guard its modules' hooks too (`_traced`).
    """
    key = (backend, variant, model_state(model), model_guards)
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))  # (older torch: the latter)
    compiled = _COMPILED.setdefault(model, {})
    if key not in compiled:
        def forward(module, **inputs):
            return module(**inputs)

        own = types.FunctionType(forward.__code__.replace(), forward.__globals__, "forward",
                                 None, forward.__closure__)
        options = {"guard_filter_fn": not_on_weights if model_guards else on_inputs}
        if backend == "inductor":
            # Inductor computes a fused kernel's float16 / bfloat16 intermediates in float32
            # unless told to round them where eager does: a half-precision model (whose
            # RMSNorm, rotary and softmax round between float32 ops) drifted from eager.
            options["emulate_precision_casts"] = True
        compiled[key] = torch.compile(own, fullgraph=True, dynamic=True, backend=backend,
                                      options=options)
    return functools.partial(_traced, compiled[key], model, model_guards)


def model_state(model) -> tuple:
    """What the guards `on_inputs` leaves out would check, as it is now: each weight's
    name, shape, dtype and device; each module's class, hooks and plain attributes (the
    `training` flag, a layer's scaling, PEFT's active adapters: `_plain`); the config; the
    process-wide module hooks."""
    tensors = itertools.chain(model.named_parameters(), model.named_buffers())
    weights = tuple((n, tuple(t.shape), t.dtype, t.device) for n, t in tensors)
    modules = tuple(
        (name, type(m), tuple(len(h) for h in (m._forward_hooks, m._forward_pre_hooks)),
         tuple(sorted((k, p) for k, v in vars(m).items() if (p := _plain(v)) is not _SKIP)))
        for name, m in model.named_modules())
    config = getattr(model, "config", None)
    global_hooks = tuple(len(h) for h in (module_hooks._global_forward_hooks,
                                          module_hooks._global_forward_pre_hooks))
    return weights, modules, None if config is None else repr(config.to_dict()), global_hooks


_PLAIN = (bool, int, float, str, type(None))
_SKIP = object()


def _plain(value, depth: int = 0):
    """A hashable copy of a plain value: a number, string or None, or a list, tuple, set or
    dict of them (PEFT's active adapters are a list); `_SKIP` for anything else."""
    if isinstance(value, _PLAIN):
        return value
    if depth > 3 or not isinstance(value, (list, tuple, set, frozenset, dict)):
        return _SKIP
    if isinstance(value, dict):
        items = [(_plain(k, depth + 1), _plain(v, depth + 1)) for k, v in value.items()]
        flat = [x for item in items for x in item]
    else:
        items = flat = [_plain(v, depth + 1) for v in value]
    if any(x is _SKIP for x in flat):
        return _SKIP
    unordered = isinstance(value, (set, frozenset, dict))
    return type(value).__name__, frozenset(items) if unordered else tuple(items)


def not_on_weights(entries) -> list[bool]:
    """Keeps every guard but those on a parameter or buffer: the filter of a model changed
    in place while it serves (`model_guards`), whose weights the engine still holds for its
    life (adapter loads are refused under compile)."""
    return ["._parameters[" not in e.name and "._buffers[" not in e.name for e in entries]


def on_inputs(entries) -> list[bool]:
    """Keeps the guards on the forward's inputs and the ambient ones (unnamed: grad mode,
    global state, symbolic sizes); leaves out those on the model and on globals."""
    return [e.name == "" or (_INPUT.match(e.name) is not None and "G[" not in e.name)
            for e in entries]


_INPUT = re.compile(r"(L\[')?inputs\b")  # (torch 2.13 names it inputs[..], older L['inputs'][..])


def _traced(entry, model, hook_guards: bool, **inputs):
    """`entry(model, **inputs)` with the settings its graphs are traced under: a size of 1
    or one equal to another (1 decode row, a pool as large as the step) is as symbolic as
    any other, so that step sizes do not each compile a graph of their own (a few cover
    every step: decodes only, prompt chunks only, both); a float (a layer's scaling, an
    epsilon: the model's, none an input's) is a constant, as in eager, not a symbol that
    Inductor makes a tensor or, failing that, restarts the whole trace to make a constant
    (a third of a compile); hook_guards: module hooks are guarded too, which Dynamo leaves
    out by default. Any call may trace, so they are set around every call, by hand:
    `fx_config.patch` costs twice as much."""
    dynamo = torch._dynamo.config
    old = (fx_config.backed_size_oblivious, fx_config.use_duck_shape,
           dynamo.specialize_float)
    fx_config.backed_size_oblivious, fx_config.use_duck_shape = True, False
    dynamo.specialize_float = True
    if hook_guards:
        skipped, dynamo.skip_nnmodule_hook_guards = dynamo.skip_nnmodule_hook_guards, False
    try:
        return entry(model, **inputs)
    finally:
        (fx_config.backed_size_oblivious, fx_config.use_duck_shape,
         dynamo.specialize_float) = old
        if hook_guards:
            dynamo.skip_nnmodule_hook_guards = skipped


def run_eagerly(runner, err: BaseException) -> None:
    """The runner's compiled forward failed to trace or compile (`COMPILE_ERRORS`): from now
    on its forwards run eagerly, with the same tokens, rather than fail every request. An
    error of an eager forward (the runner's `compiled` is None) is raised again."""
    if runner.compiled is None:
        raise err
    runner.compile_error = f"{type(err).__name__}: {err}"
    runner.compiled = None
    logger.warning("hf-paged engine: the model's forward does not compile (%s); it runs "
                   "eagerly from now on (compile=False gives the same without trying).",
                   runner.compile_error.splitlines()[0][:500])
