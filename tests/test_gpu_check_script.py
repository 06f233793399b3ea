"""`benchmarks/gpu_check.sh`, the one command a lent GPU runs, checked where there is none:
it must parse, fit one device call (10 minutes, machine start-up and wheel install
included) in its worst case, and run only the steps asked for."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.sh"


def test_the_script_parses():
    if shutil.which("bash") is None:
        pytest.skip("bash is not installed")
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_its_worst_case_fits_one_device_call():
    text = SCRIPT.read_text()
    one_gpu = text[:text.index('if [ "$gpus" -ge 2 ]')]
    limits = [int(s) for s in re.findall(r"^step [\w-]+ (\d+) ", one_gpu, re.M)]
    build = int(re.search(r"\( timeout (\d+) python3", one_gpu).group(1))
    before_wait = one_gpu[:one_gpu.index('wait "$build"')]
    overlapped = sum(int(s) for s in re.findall(r"^step [\w-]+ (\d+) ", before_wait, re.M))
    worst = sum(limits) + max(build - overlapped, 0)
    assert len(limits) >= 8 and worst <= 560, (limits, build, worst)


def test_only_the_selected_steps_run(tmp_path):
    if shutil.which("bash") is None:
        pytest.skip("bash is not installed")
    env = dict(os.environ, GPU_CHECK_STEPS="env")
    run = subprocess.run(["bash", str(SCRIPT), str(tmp_path)], env=env, capture_output=True,
                         text=True, timeout=120)
    summary = (tmp_path / "log.txt").read_text().split("=== summary")[-1]
    assert re.findall(r"^([\w-]+):", summary, re.M) == ["env"], run.stdout
    assert not (tmp_path / "cuda_build.txt").exists()
