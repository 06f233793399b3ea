"""Tensor parallelism: a model loaded with tp_plan="auto" under torchrun (2 processes,
gloo on CPU) generates on the paged cache exactly as stock TP generate and as one process
without TP. Each rank's cache holds only its own KV heads."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import free_port, make_model, wait_healthy

HERE = Path(__file__).resolve().parent
# The ranks run on the CPU with gloo even where GPUs exist (Transformers would put a TP
# model on them), so that they compare with the CPU references here.
CPU_ONLY = dict(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")


def torchrun(script: str, *args, nproc: int = 2, timeout: int = 300, check: bool = True):
    env = dict(os.environ, PYTHONPATH=str(HERE.parents[1]), **CPU_ONLY)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--master-port={free_port()}", str(HERE / script), *map(str, args)]
    # A session of its own: a run past its timeout takes its ranks down with it (killing
    # torchrun alone would leave them waiting in their collectives).
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    done = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    if check:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def mistral_two_kv_heads():
    """Mistral with a sliding window shorter than the sequences and 2 KV heads (Transformers'
    TP splits whole heads: 1 KV head cannot go to 2 ranks, stock TP fails on it too)."""
    from transformers import MistralConfig, MistralForCausalLM

    from conftest import _common

    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(**_common(num_attention_heads=4,
                                                       num_key_value_heads=2, sliding_window=7)))
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model.eval()


@pytest.mark.parametrize("kind", ["llama_gqa", "llama_mha", "mistral_sw"])
def test_tp_generate_equals_stock_tp_and_one_process(kind, tmp_path):
    model = mistral_two_kv_heads() if kind == "mistral_sw" else make_model(kind)
    if kind == "llama_gqa":
        assert model.config.num_key_value_heads == 2  # one KV head per rank
    model.save_pretrained(tmp_path / "model")
    torchrun("tp_generate.py", tmp_path / "model", tmp_path / "out.json")
    results = json.loads((tmp_path / "out.json").read_text())
    single = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    ids = torch.tensor([[0, 0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15],
                        [0, 0, 0, 0, 0, 3, 4]])
    mask = (ids != 0).long()
    for name, row in results.items():
        assert row["paged"] == row["stock"], name
    alone = single.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                            cache_implementation="paged")
    assert results["greedy"]["paged"] == alone.tolist()


def test_heads_that_do_not_divide_are_a_clear_error():
    from hf_paged import PagedCache, UnsupportedModelError

    model = make_model("mistral_sw")  # one KV head
    assert model.config.num_key_value_heads == 1
    with pytest.raises(UnsupportedModelError, match="do not divide by 2"):
        PagedCache(model.config, tp_size=2)


@pytest.mark.parametrize("kind", ["llama_gqa", "gemma2"])
def test_tp_engine_equals_the_single_process_engine(kind, tmp_path):
    """Rank 0 schedules and broadcasts each step; both ranks run the forwards; preemptions
    (a 20-block pool) and prefix caching keep working; gemma2: hybrid KV groups and
    soft-capping on every rank."""
    sys.path.insert(0, str(HERE))
    from tp_engine import OPTIONS, prompts
    from zoo import make_arch

    from hf_paged import LLM, SamplingParams

    model = make_model(kind) if kind == "llama_gqa" else make_arch(kind)
    model.save_pretrained(tmp_path / "model")
    torchrun("tp_engine.py", tmp_path / "model", tmp_path / "out.json")
    got = json.loads((tmp_path / "out.json").read_text())
    llm = LLM(AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval(), **OPTIONS)
    greedy = llm.generate(prompts(), SamplingParams(temperature=0, max_tokens=12,
                                                    ignore_eos=True), use_tqdm=False)
    sampled = llm.generate(prompts()[:3], SamplingParams(temperature=1.0, seed=3, max_tokens=8,
                                                         n=2), use_tqdm=False)
    assert got["greedy"] == [o.outputs[0].token_ids for o in greedy]
    assert got["sampled"] == [[c.token_ids for c in o.outputs] for o in sampled]
    assert got["kv_heads"] == 1
    assert got["preemptions"] > 0 or kind != "llama_gqa"


def test_options_rank_0_refuses_every_rank_refuses(tmp_path):
    """A speculative_config, an engine flag or an unknown option that rank 0's LLM refuses,
    the other ranks' run_worker refuses too, with the same message, instead of waiting for
    steps that never come (the group then went on, and deadlocked, when rank 0 built
    another LLM)."""
    make_model("llama_gqa").save_pretrained(tmp_path / "model")
    torchrun("tp_engine.py", tmp_path / "model", tmp_path / "out.json", "refuse", timeout=240)
    rank0 = json.loads((tmp_path / "out.json").read_text())
    rank1 = json.loads((tmp_path / "out.json.1").read_text())
    assert rank0["refused"] == rank1 and "accepted" not in rank1
    assert "one device" in rank1[1] and "enable_prefix_caching" in rank1[2]
    assert "unknown options ['bogus_option']" in rank1[3]
    assert len(rank0["greedy"]) == 10  # the group serves the next LLM


@pytest.mark.parametrize("how", ["die", "fail"])
def test_a_rank_that_dies_or_fails_brings_the_group_down(how, tmp_path):
    """die: rank 1 exits in the middle of serving. fail: a step raises on rank 0 after the
    workers started it (they wait in its collectives; no later step could pair with
    theirs). Either way the whole group stops, promptly (well inside the subprocess
    timeout, far from the process group's 30-minute one), and torchrun names the rank."""
    import time

    make_model("llama_gqa").save_pretrained(tmp_path / "model")
    start = time.monotonic()
    done = torchrun("tp_engine.py", tmp_path / "model", tmp_path / "out.json", how,
                    timeout=240, check=False)
    assert done.returncode != 0
    assert time.monotonic() - start < 240
    assert not (tmp_path / "out.json").exists()
    if how == "die":
        assert "exitcode  : 7" in done.stderr and "rank      : 1" in done.stderr, \
            done.stderr[-3000:]
    else:
        assert "a tensor-parallel step failed on rank 0" in done.stderr, done.stderr[-3000:]
        assert "exitcode  : 1" in done.stderr and "rank      : 0" in done.stderr


def test_tp_server_answers_like_stock_and_stops(tmp_path):
    """`torchrun --nproc-per-node 2 -m hf_paged.serve MODEL`: rank 0 serves HTTP."""
    import signal

    import httpx

    from conftest import make_tokenizer

    model = make_model("llama_gqa")
    model.save_pretrained(tmp_path / "model")
    make_tokenizer().save_pretrained(tmp_path / "model")
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(HERE.parents[1]), **CPU_ONLY)
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
         f"--master-port={free_port()}", "-m", "hf_paged.serving.serve", str(tmp_path / "model"),
         "--port", str(port), "--served-model-name", "tiny", "--num-blocks", "64",
         "--block-size", "8", "--log-level", "warning"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(proc, port)
        body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}
        texts = [httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body,
                            timeout=60).json()["choices"][0]["text"] for _ in range(2)]
        ref = model.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=8, do_sample=False)
        assert texts == [make_tokenizer().decode(ref[0, 4:], skip_special_tokens=True)] * 2
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        finally:
            proc.kill()


def test_attention_split_follows_the_tp_plan():
    """Heads are split only where the plan splits the key projection (Transformers' rule for
    its own caches); a plan that splits only the MLPs leaves every head on every rank."""
    import types

    from hf_paged.models import attention_tp_size

    config = make_model("llama_gqa").config

    def fake(tp_size, plan):
        return types.SimpleNamespace(tp_size=tp_size, tp_plan=plan, config=config)

    split = {"model.layers.*.self_attn.k_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise"}
    assert attention_tp_size(fake(2, split)) == 2
    assert attention_tp_size(fake(2, {"model.layers.*.mlp.up_proj": "colwise"})) == 1
    assert attention_tp_size(fake(None, split)) == 1
    assert attention_tp_size(make_model("llama_gqa")) == 1


def test_tp_generate_for_every_architecture_with_a_tp_plan(tmp_path):
    """Each zoo architecture whose config has a TP plan, loaded with tp_plan="auto" over two
    ranks: paged TP generate equals stock TP generate (greedy on a padded batch, sampling),
    each rank's cache holding its share of the KV heads (a latent KV: the whole latent)."""
    from zoo import ARCHITECTURES, NAMES, make_arch

    import transformers

    folders = {}
    for name in NAMES:
        config_cls = getattr(transformers, ARCHITECTURES[name][0])
        if not getattr(config_cls, "base_model_tp_plan", None):
            continue  # gpt-oss: Transformers has no TP plan for it
        folders[name] = tmp_path / name
        make_arch(name).save_pretrained(folders[name])
    torchrun("tp_zoo.py", tmp_path / "out.json", *folders.values(), timeout=600)
    results = json.loads((tmp_path / "out.json").read_text())
    compared = []
    for name, folder in folders.items():
        got = results[str(folder)]
        if "stock_error" in got:  # stock TP cannot run it either
            continue
        compared.append(name)
        assert got["cache"] == "PagedCache", name
        for case in ("greedy", "sampling"):
            assert got[case]["paged"] == got[case]["stock"], (name, case)
    assert compared == list(folders), sorted(set(folders) - set(compared))  # stock TP ran all


def _rank0(module, monkeypatch, period):
    """`module`'s LLMEngine as rank 0 of a group of 2 (nothing is sent: the runner has no
    group); its heartbeats and stops are recorded."""
    import time

    calls = {"heartbeat": [], "stop": 0}

    class Rank0(module.LLMEngine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.tp_size = 2

        def heartbeat(self):
            calls["heartbeat"].append(time.monotonic())

        def stop_workers(self):
            calls["stop"] += 1

    monkeypatch.setattr(module, "LLMEngine", Rank0)
    owner = module.AsyncLLM if hasattr(module, "AsyncLLM") else module.LLM
    monkeypatch.setattr(owner, "HEARTBEAT_S", period)
    return calls


def test_an_idle_async_rank_0_pings_however_often_it_is_woken(monkeypatch):
    """Wakes that run no step (an abort of an unknown id, a call) must not put the
    heartbeat off: the other ranks' wait would time out."""
    import time

    from hf_paged.engine import async_llm

    calls = _rank0(async_llm, monkeypatch, 0.2)
    llm = async_llm.AsyncLLM(make_model("llama_gqa"), block_size=4, num_blocks=16)
    try:
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            llm.abort("no-such-request")
            time.sleep(0.05)
    finally:
        llm.shutdown()
    assert len(calls["heartbeat"]) >= 4 and calls["stop"] == 1


def test_an_idle_llm_rank_0_pings_and_stops_the_others_once(monkeypatch):
    import gc
    import time

    from hf_paged import SamplingParams
    from hf_paged.engine import llm as module

    calls = _rank0(module, monkeypatch, 0.1)
    llm = module.LLM(make_model("llama_gqa"), block_size=4, num_blocks=16)
    time.sleep(0.6)  # between calls
    assert len(calls["heartbeat"]) >= 3
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False)
    assert out[0].outputs[0].finish_reason is not None
    llm.shutdown()
    llm.shutdown()
    assert calls["stop"] == 1
    beats = len(calls["heartbeat"])
    time.sleep(0.3)
    assert len(calls["heartbeat"]) == beats  # no pings after the stop
    module.LLM(make_model("llama_gqa"), block_size=4, num_blocks=16)  # collected at once
    gc.collect()
    assert calls["stop"] == 2
