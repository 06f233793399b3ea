"""Every named error hf-paged raises: caller mistakes, resource limits, engine states, and
the OpenAI-style errors the server answers with."""

from __future__ import annotations


class HFPagedError(Exception):
    """Base class of every error hf-paged raises on purpose."""


class KVCacheExhaustedError(HFPagedError, RuntimeError):
    """The block pool has fewer free blocks than a step needs.

    Raised before the step allocates or writes anything, so every block table stays
    consistent: the cache can be `reset()` and reused, or the call retried with a larger pool.
    """

    def __init__(self, needed: int, free: int, num_blocks: int, block_size: int,
                 held: int | None = None):
        self.needed = needed
        self.free = free
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.held = held  # blocks the failing cache holds (None: not known)
        others = ""
        if held is not None and num_blocks - free - held > 0:
            others = (f" This cache holds {held} of them; {num_blocks - free - held} are held by "
                      "other live caches sharing the pool (the assistant model's in assisted "
                      "decoding, concurrent calls, or returned caches still referenced: "
                      "reset() or drop them to return their blocks).")
        super().__init__(
            f"KV cache exhausted: this step needs {needed} free block(s) of {block_size} tokens "
            f"but only {free} of the pool's {num_blocks} block(s) are free.{others} Raise "
            "cache_config['num_blocks'] or cache_config['max_kv_bytes'] (or leave both unset "
            "to let the pool grow on demand), or lower the batch size / max_new_tokens."
        )


class UnsupportedModelError(HFPagedError, ValueError):
    """A paged cache was asked of a model architecture hf-paged does not patch."""


class PagedRouteError(HFPagedError):
    """A model's layers do not hand the paged KV to the attention as Transformers' attention
    interface does (keywords dropped on the way, keys changed after the cache update)."""


class KVPoolAllocationError(HFPagedError, MemoryError):
    """The device could not hold a KV pool of the size asked for (or grown to)."""


class BackwardNotSupportedError(HFPagedError, RuntimeError):
    """Gradients were asked through a forward on a PagedCache."""


class InvalidRequestError(HFPagedError, ValueError):
    """A request setting is malformed or out of range for this model. `param` names the
    setting (as the OpenAI API names its fields), so a server can say which one."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class RequestRejectedError(HFPagedError, ValueError):
    """A request that can never run: longer than the model's context or than the whole pool
    (`param` None), or an empty prompt ("prompt") or more sequences than run at once ("n")."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class EngineDeadError(HFPagedError, RuntimeError):
    """The engine was shut down."""


class ModelChangedError(HFPagedError, RuntimeError):
    """The model was cast to another dtype or moved to another device after an engine was
    built on it (its KV pool holds the old dtype on the old device), or put back in
    training mode with dropout to apply (its tokens would be random)."""


class IsolationError(HFPagedError, AssertionError):
    """A step would read or write a block its sequence does not hold (debug mode)."""


class CudaKernelsUnavailable(HFPagedError, RuntimeError):
    """The CUDA C++ kernels cannot be built or run on this machine."""


class CpuKernelsUnavailable(HFPagedError, RuntimeError):
    """The CPU C++ kernel cannot be built or loaded on this machine."""


class APIError(Exception):
    """An OpenAI-style error: HTTP status, message, the offending field."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = (status, message, param,
                                                                        kind, code)
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def describe(err: BaseException) -> str:
    """`TypeName: message`, as a failed request's `error` reports an exception."""
    return f"{type(err).__name__}: {err}"
