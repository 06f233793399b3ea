"""The wheel a user installs: CUDA sources inside the package, license, type marker."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_ships_cuda_sources_license_and_py_typed(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-q",
                    "-w", str(tmp_path)], check=True)
    (wheel,) = tmp_path.glob("hf_paged-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    cuda = {p.name for p in (ROOT / "cuda").iterdir() if p.suffix in (".cu", ".cpp", ".h")}
    assert cuda and {f"hf_paged/kernels/cuda/{n}" for n in cuda} <= names
    assert "hf_paged/py.typed" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA")))
    assert b"License-Expression: Apache-2.0" in metadata
    assert b"Provides-Extra: triton" in metadata
    # Installed from the wheel (not a checkout), the CUDA build finds its sources.
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    found = subprocess.run(
        [sys.executable, "-c", "from hf_paged.kernels import cuda_ops; print(cuda_ops.source_dir())"],
        cwd=tmp_path, env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, check=True).stdout.strip()
    assert Path(found) == site / "hf_paged" / "kernels" / "cuda"
