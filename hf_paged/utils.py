"""Small helpers shared by every layer of the package (torch-free), and the old module paths.

Modules moved into subpackages in 0.3 (`hf_paged.engine` became `hf_paged.engine.engine`,
`hf_paged.server` became `hf_paged.serving.server`, ...). `install_aliases` keeps every old
path importable: importing one loads the new module and returns it under the old name too,
so `from hf_paged.server import build_app` and `monkeypatch.setattr(hf_paged.cache, ...)`
keep working.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.util
import os
import sys


def user_stacklevel() -> int:
    """warnings.warn stacklevel of the first caller outside hf_paged, transformers and torch."""
    skip = tuple(os.path.dirname(sys.modules[name].__file__) + os.sep
                 for name in ("hf_paged", "transformers", "torch"))
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame, level = frame.f_back, level + 1
    return level


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints: blocks of `b` slots that hold `a` tokens."""
    return -(-a // b)


@contextlib.contextmanager
def set_on_thread(state, name: str, value):
    """Inside, attribute `name` of `state` (a `threading.local`) is `value` on this thread;
    the thread's own value after."""
    outer = getattr(state, name)
    setattr(state, name, value)
    try:
        yield
    finally:
        setattr(state, name, outer)


def out_of_vocab(ids, vocab_size: int) -> list[int]:
    """The first five of `ids` (ints) outside [0, vocab_size); [] if none. A million ids in
    range are checked at C speed (min and max)."""
    ids = list(ids)
    if not ids or 0 <= min(ids) and max(ids) < vocab_size:
        return []
    return [t for t in ids if not 0 <= t < vocab_size][:5]


# Old module path -> where it lives now. (`hf_paged.engine` is a package now; its old
# names are re-exported by `hf_paged/engine/__init__.py`.)
MOVED = {
    "hf_paged.block_pool": "hf_paged.core.block_pool",
    "hf_paged.block_table": "hf_paged.core.block_table",
    "hf_paged.prefix_cache": "hf_paged.core.prefix_cache",
    "hf_paged.sequence": "hf_paged.core.sequence",
    "hf_paged.scheduler": "hf_paged.core.scheduler",
    "hf_paged.kv_pool": "hf_paged.kv.pool",
    "hf_paged.metadata": "hf_paged.kv.metadata",
    "hf_paged.placement": "hf_paged.distributed.placement",
    "hf_paged.pool_access": "hf_paged.kernels.dispatch",
    "hf_paged.attention": "hf_paged.hf.attention",
    "hf_paged.models": "hf_paged.hf.architectures",
    "hf_paged.models.falcon": "hf_paged.hf.falcon",
    "hf_paged.cache": "hf_paged.generate.cache",
    "hf_paged.masking": "hf_paged.generate.plan",
    "hf_paged.prefill": "hf_paged.generate.prefill",
    "hf_paged.integration": "hf_paged.generate.patches",
    "hf_paged.stats": "hf_paged.generate.stats",
    "hf_paged.llm": "hf_paged.engine.llm",
    "hf_paged.async_llm": "hf_paged.engine.async_llm",
    "hf_paged.sampler": "hf_paged.engine.sampler",
    "hf_paged.request": "hf_paged.engine.request",
    "hf_paged.detokenizer": "hf_paged.engine.detokenizer",
    "hf_paged.server": "hf_paged.serving.server",
    "hf_paged.protocol": "hf_paged.serving.protocol",
    "hf_paged.metrics": "hf_paged.serving.metrics",
    "hf_paged.sse": "hf_paged.serving.sse",
    "hf_paged.guard": "hf_paged.serving.guard",
    "hf_paged.serve": "hf_paged.serving.serve",
    "hf_paged.cli": "hf_paged.serving.cli",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module path and hands back the module at its new path (the same module
    object, so a change made through either name is seen through both)."""

    def __init__(self):
        self._specs: dict = {}

    def find_spec(self, name, path=None, target=None):
        if name in MOVED:
            parent = any(old.startswith(name + ".") for old in MOVED)
            return importlib.util.spec_from_loader(name, self, is_package=parent)
        return None

    def create_module(self, spec):
        module = importlib.import_module(MOVED[spec.name])
        self._specs[spec.name] = module.__spec__  # the import machinery sets the alias's
        sys.modules[spec.name] = module
        return module

    def exec_module(self, module):
        # Already executed under its new name: give it back its own spec (an old path with
        # old children, hf_paged.models, keeps the __path__ the alias spec gave it).
        alias = module.__spec__.name
        if alias in self._specs:
            module.__spec__ = self._specs.pop(alias)

    def get_code(self, name):
        """`python -m <old path>` runs the module at its new path as __main__."""
        return compile(f"import runpy; runpy.run_module({MOVED[name]!r}, run_name='__main__', "
                       "alter_sys=True)", f"<{name}>", "exec")


def install_aliases() -> None:
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())
