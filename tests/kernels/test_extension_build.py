"""Extension builds survive a builder that was killed: torch's `lock` file it left behind
must not make later loads wait forever (as it did on a GPU machine whose build hit a time
limit: every test and benchmark after it hung)."""

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_paged.kernels import cpu_ops, extension

ROOT = Path(__file__).resolve().parents[2]


def test_a_stale_torch_lock_is_cleared_under_the_build_lock(tmp_path, monkeypatch):
    folder = tmp_path / "cpu-0123"
    folder.mkdir()
    (folder / extension.TORCH_LOCK).write_text("")  # what a killed build leaves
    seen = {}

    def fake_load(name, sources, build_directory, **options):
        seen["stale lock"] = (Path(build_directory) / extension.TORCH_LOCK).exists()
        with open(Path(build_directory) / extension.OWN_LOCK) as other:  # a second builder
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
                seen["held"] = False
            except BlockingIOError:
                seen["held"] = True
        seen["options"] = (name, sources, options)
        return "module"

    monkeypatch.setattr("torch.utils.cpp_extension.load", fake_load)
    assert extension.build("m", folder, [Path("a.cpp")], extra_cflags=["-O3"]) == "module"
    assert seen == {"stale lock": False, "held": True,
                    "options": ("m", ["a.cpp"], {"extra_cflags": ["-O3"], "verbose": False})}
    with open(folder / extension.OWN_LOCK) as other:  # released afterwards
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_a_failed_build_releases_the_build_lock(tmp_path, monkeypatch):
    def failing_load(**_):
        raise RuntimeError("compiler error")

    monkeypatch.setattr("torch.utils.cpp_extension.load", failing_load)
    with pytest.raises(RuntimeError, match="compiler error"):
        extension.build("m", tmp_path / "f", [Path("a.cpp")])
    with open(tmp_path / "f" / extension.OWN_LOCK) as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_the_cpu_kernels_load_past_a_stale_lock_in_their_real_build_folder():
    """Torch's real loader, in a fresh process: it would wait forever on the planted file."""
    if not cpu_ops.available():
        pytest.skip(f"CPU kernels unavailable: {cpu_ops.build_error()}")
    (cpu_ops.build_directory() / extension.TORCH_LOCK).write_text("")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-c", "from hf_paged.kernels import cpu_ops; "
                          "cpu_ops.load(); print('loaded')"],
                         env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "loaded" in run.stdout
    assert not (cpu_ops.build_directory() / extension.TORCH_LOCK).exists()


def test_installs_of_the_same_sources_build_in_folders_of_their_own(tmp_path, monkeypatch):
    """A build's commands name its sources' paths: two installs sharing a folder would each
    rebuild it over the binary the other has loaded."""
    monkeypatch.setenv("HF_PAGED_CACHE", str(tmp_path / "cache"))
    one, other = tmp_path / "one", tmp_path / "other"
    for folder in (one, other):
        folder.mkdir()
        (folder / "a.cpp").write_text("int a;")
    here = extension.build_directory("cpu", [one / "a.cpp"], "-O3")
    assert here == extension.build_directory("cpu", [one / "a.cpp"], "-O3")
    assert here != extension.build_directory("cpu", [other / "a.cpp"], "-O3")
    assert here != extension.build_directory("cpu", [one / "a.cpp"], "-O2")
    assert here.parent == tmp_path / "cache"
    (one / "a.cpp").write_text("int b;")  # an edited source builds anew
    assert here != extension.build_directory("cpu", [one / "a.cpp"], "-O3")
