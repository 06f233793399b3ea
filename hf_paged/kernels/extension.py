"""Building the C++ extensions of `cuda/`: one cached build folder per source version, and a
build that a killed process left half done never blocks the next one.

Torch's JIT loader guards a build folder with a `lock` file that only the building process
removes. If that process is killed (a timeout, an OOM kill, Ctrl-C twice), the file stays
and every later load of that folder waits for it forever. Here every build of a folder
first takes an OS lock (`flock`, released by the kernel when its holder dies); whoever
holds it knows that no live process is building, so a `lock` file it finds is stale.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path

TORCH_LOCK = "lock"  # torch.utils.cpp_extension's FileBaton in the build folder
OWN_LOCK = ".hf_paged_build.flock"


def build_directory(kind: str, files: list[Path], settings: str) -> Path:
    """`$HF_PAGED_CACHE/<kind>-<hash>` (default cache: ~/.cache/hf_paged), hashed from every
    input the binary depends on: the `files` it is built from (contents and where they lie)
    and `settings` (flags, torch version, target machine). The build's commands name the
    files' paths, so two installs of the same version (two environments, a checkout beside
    a wheel) build apart: sharing a folder, each load would rebuild it over the binary the
    other has loaded."""
    cache = Path(os.environ.get("HF_PAGED_CACHE", Path.home() / ".cache" / "hf_paged"))
    digest = hashlib.sha256(settings.encode())
    for file in files:
        digest.update(str(Path(file).resolve()).encode() + b"\0" + Path(file).read_bytes())
    return cache / f"{kind}-{digest.hexdigest()[:16]}"


@contextlib.contextmanager
def exclusive(folder: Path):
    """Holds the folder's OS lock (waits for another live builder to finish), then clears a
    `lock` file that a dead builder left."""
    try:
        import fcntl
    except ImportError:  # (no flock: Windows) torch's own lock alone
        yield
        return
    with open(folder / OWN_LOCK, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (folder / TORCH_LOCK).unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build(name: str, folder: Path, sources: list[Path], **options):
    """Builds `sources` into `folder` (or reuses the build there) and imports the module."""
    from torch.utils import cpp_extension

    folder.mkdir(parents=True, exist_ok=True)
    with exclusive(folder):
        return cpp_extension.load(name=name, sources=[str(s) for s in sources],
                                  build_directory=str(folder), verbose=False, **options)
