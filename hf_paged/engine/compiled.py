"""The engine's forward under torch.compile: fullgraph, dynamic token counts, and guards
that leave the model's weights out, in a code object of the model's own."""

from __future__ import annotations

import functools
import itertools
import logging
import types
import weakref

import torch

logger = logging.getLogger("hf_paged")

# model -> {(backend, variant, its weights' names, shapes, dtypes, devices): entry point}.
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


def compile_forward(model, backend: str, variant: tuple = ()):
    """`model(**inputs)` compiled with `backend` (fullgraph, dynamic shapes).

    variant: what else the traced graphs depend on (the engine's pool dtype, block size
    and attention backends): each variant gets an entry point, and a recompile limit, of
    its own. Dynamo's recompile limit is raised process-wide to `RECOMPILE_LIMIT` (it is
    one setting, read when a graph is added).

    Dynamo re-checks a compiled function's guards before every call; those on the model's
    parameters and buffers (a tensor match and five dynamic-shape checks per weight, about
    ten per layer) are left out: the engine holds the same tensors for its life and refuses
    adapter changes under compile. Dynamo keeps graphs and guards per code object, and
    every model of a class shares its forward's, so the entry point is a code object of
    this model's own (and of its weights' shapes, dtypes and devices as they are now):
    engines on the same model share its graphs, and no other model ever finds graphs
    whose guards no longer look at the weights.
    """
    tensors = itertools.chain(model.named_parameters(), model.named_buffers())
    key = (backend, variant, tuple((n, tuple(t.shape), t.dtype, t.device) for n, t in tensors))
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))  # (older torch: the latter)
    compiled = _COMPILED.setdefault(model, {})
    if key not in compiled:
        def forward(module, **inputs):
            return module(**inputs)

        own = types.FunctionType(forward.__code__.replace(), forward.__globals__, "forward",
                                 None, forward.__closure__)
        compiled[key] = torch.compile(own, fullgraph=True, dynamic=True, backend=backend,
                                      options={"guard_filter_fn": not_on_weights})
    return functools.partial(compiled[key], model)


def not_on_weights(entries) -> list[bool]:
    """Keeps every guard but those on a parameter or buffer (by the guard's source name);
    inputs, metadata, modules' structure and attributes, and globals stay guarded."""
    return ["._parameters[" not in e.name and "._buffers[" not in e.name for e in entries]


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
