"""The package's shape: folders are concepts, and imports run one way only (ARCHITECTURE.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hf_paged"
TOP = {"errors", "config", "sampling_params", "outputs", "utils"}  # small shared modules
# What each subpackage may import (besides itself and the small top-level modules).
ALLOWED = {
    "core": set(),
    "kv": {"core"},
    "kernels": {"kv", "core"},
    "hf": {"kernels", "kv", "core"},
    "distributed": {"hf", "kv", "core"},
    "generate": {"hf", "kernels", "kv", "core", "distributed"},
    "engine": {"hf", "kernels", "kv", "core", "distributed"},
    "serving": {"engine", "distributed"},
}
# serving speaks to the engine through its public front ends only (and asks torchrun's rank).
SERVING_MAY_USE = {"engine", "engine.async_llm", "engine.llm", "engine.detokenizer",
                   "distributed.tensor_parallel"}
MAX_LINES = 450


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        yield path, parts


def imports(path: Path, parts: tuple[str, ...]):
    """(imported module inside hf_paged as a dotted path relative to the package, or None,
    the top-level name for outside modules) of every import in a file."""
    package = list(parts[:-1])  # the subpackage a relative import starts from
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                target = ".".join(base + ([node.module] if node.module else []))
                if node.module is None:  # from . import x
                    for alias in node.names:
                        yield (f"{target}.{alias.name}" if target else alias.name), None
                    continue
                yield target, None
            elif node.module and node.module.split(".")[0] == "hf_paged":
                yield node.module.partition(".")[2], None
            elif node.module:
                yield None, node.module.split(".")[0]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "hf_paged":
                    yield alias.name.partition(".")[2], None
                else:
                    yield None, alias.name.split(".")[0]


def test_only_a_handful_of_small_top_level_modules():
    top = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    assert top <= TOP, f"top-level modules outside {sorted(TOP)}: {sorted(top - TOP)}"
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(ALLOWED), folders


@pytest.mark.parametrize("path, parts", list(modules()), ids=lambda v: "/".join(v)
                         if isinstance(v, tuple) else None)
def test_imports_run_one_way(path, parts):
    if len(parts) == 1:  # __init__ and the small shared modules
        if parts[0] in TOP:
            for inside, _ in imports(path, parts):
                if inside:
                    assert inside.split(".")[0] in TOP, f"{path.name} imports {inside}"
        return
    folder = parts[0]
    for inside, outside in imports(path, parts):
        if inside is not None:
            head = inside.split(".")[0]
            if head in TOP or head == folder or head == "":
                continue
            assert head in ALLOWED[folder], f"{'/'.join(parts)} imports hf_paged.{inside}"
            if folder == "serving":
                assert inside in SERVING_MAY_USE, f"serving/{parts[-1]} reaches into {inside}"
        elif folder == "core":
            assert outside not in ("torch", "transformers", "numpy"), \
                f"core/{parts[-1]} imports {outside}"


def test_no_module_over_the_size_limit():
    long = {"/".join(parts): n for path, parts in modules()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_nothing_implicit_on_the_attention_path():
    """The attention learns its KV from its arguments: no context variables, no attributes
    stuck on tensors, anywhere between the step plan and the kernels."""
    for folder in ("core", "kv", "kernels", "hf", "engine"):
        for path in (PACKAGE / folder).rglob("*.py"):
            text = path.read_text()
            assert "contextvars" not in text and "ContextVar" not in text, path
            assert "_hf_paged_cache" not in text, path


def test_the_old_module_paths_still_import():
    """0.2's flat module paths are the modules at their new homes (one object, two names)."""
    import importlib
    import sys

    from hf_paged.utils import MOVED

    for old, new in MOVED.items():
        module = importlib.import_module(old)
        assert module is sys.modules[new] and module.__spec__.name == new, old
    from hf_paged.models.falcon import paged_falcon_attention  # an old child of an old path
    from hf_paged.server import build_app  # noqa: F401

    assert paged_falcon_attention.__module__ == "hf_paged.hf.falcon"
