"""`hf-paged serve` on a loopback port, driven with the `openai` client and raw HTTP:
completions and chat (streaming or not) equal stock `generate`, sampling settings, usage,
concurrency, disconnects, bad requests, metrics, adapters, auth, the CLI and shutdown."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
import uvicorn
from peft import LoraConfig, TaskType, get_peft_model
from prometheus_client.parser import text_string_to_metric_families
from transformers import LlamaForCausalLM

from hf_paged.server import build_app
from conftest import free_port, make_model, make_tokenizer, wait_healthy
from test_engine import long_model

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['content'] }} </s> {% endfor %}"
                 "{% if add_generation_prompt %}<s>{% endif %}")
KEY = "secret"


class ServerThread:
    """uvicorn serving `app` on 127.0.0.1 in a thread, for the length of a test module."""

    def __init__(self, app):
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=30)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def tokenizer_with_template():
    tok = make_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tok


def lora_model():
    # A model of its own: the engine tests wrap the shared one in adapters of theirs.
    base = make_model("llama_gqa", sliding_window=24, max_position_embeddings=1400)
    model = get_peft_model(LlamaForCausalLM(base.config), LoraConfig(
        task_type=TaskType.CAUSAL_LM, r=4, target_modules="all-linear", init_lora_weights=False),
        adapter_name="tuned")
    model.base_model.model.load_state_dict(base.state_dict(), strict=False)
    return model.eval()


@pytest.fixture(scope="module")
def served():
    model = lora_model()
    tok = tokenizer_with_template()
    app = build_app(model, tok, served_model_name="tiny", api_key=KEY, block_size=4,
                    num_blocks=300, max_num_seqs=16, max_num_batched_tokens=64)
    with ServerThread(app) as server:
        server.model, server.tok = model, tok
        server.client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        yield server


def stock_text(server, prompt_ids, max_tokens, adapter=None, **kw):
    """Stock generate of the base model (or the adapter) on one prompt: its text."""
    model = server.model
    ids = torch.tensor([prompt_ids])
    if adapter is None:
        with model.disable_adapter():
            out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, pad_token_id=0,
                                 **kw)
    else:
        model.set_adapter(adapter)
        out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, pad_token_id=0, **kw)
    new = out[0, len(prompt_ids):].tolist()
    return server.tok.decode(new, skip_special_tokens=True), new


def test_completion_greedy_equals_stock(served):
    prompt = "w5 w6 w7 w8 w9"
    ids = served.tok(prompt)["input_ids"]
    text, new = stock_text(served, ids, 10)
    out = served.client.completions.create(model="tiny", prompt=prompt, max_tokens=10,
                                           temperature=0)
    assert out.choices[0].text == text
    assert out.choices[0].finish_reason == ("stop" if new[-1] == 1 else "length")
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == len(new)
    batch = served.client.completions.create(model="tiny", prompt=[prompt, [3, 4, 5]],
                                             max_tokens=6, temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text == stock_text(served, ids, 6)[0]
    assert batch.choices[2].text == stock_text(served, [3, 4, 5], 6)[0]


def test_chat_greedy_and_streaming_equal_stock(served):
    messages = [{"role": "system", "content": "w10 w11"}, {"role": "user", "content": "w5 w6"}]
    ids = served.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    text, new = stock_text(served, ids, 8)
    out = served.client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                                temperature=0)
    assert out.choices[0].message.content == text and out.choices[0].message.role == "assistant"
    assert out.usage.prompt_tokens == len(ids)
    stream = served.client.chat.completions.create(
        model="tiny", messages=messages, max_completion_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(new)
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and
              c.choices[0].finish_reason]
    assert len(finals) == 1
    ended = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert ended[0].model_extra["stop_reason"] == out.choices[0].model_extra["stop_reason"]


def test_streamed_completion_with_stop_and_logprobs(served):
    prompt = "w20 w21 w22"
    ids = served.tok(prompt)["input_ids"]
    text, _ = stock_text(served, ids, 12, eos_token_id=None)
    words = text.split()
    # A word first seen at position 3 or later: the text up to it has 3 words at least.
    stop = next(w for i, w in enumerate(words) if i >= 3 and w not in words[:i])
    kw = dict(model="tiny", prompt=prompt, max_tokens=12, temperature=0, stop=[stop],
              logprobs=2, extra_body={"ignore_eos": True})
    whole = served.client.completions.create(**kw)
    streamed = list(served.client.completions.create(**kw, stream=True))
    expected = text[:text.index(stop)]
    assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].text for c in streamed) == expected
    # The stop string that ended it, in the stream's last chunk as in the response.
    assert whole.choices[0].stop_reason == streamed[-1].choices[0].stop_reason == stop
    assert all(c.choices[0].stop_reason is None for c in streamed[:-1])
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) >= 4
    assert all(len(t) >= 2 for t in lp.top_logprobs) and all(x <= 0 for x in lp.token_logprobs)
    chat = served.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=3, temperature=0,
        logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 3 for c in content)


def test_seed_repeats_and_n_varies(served):
    kw = dict(model="tiny", prompt="w5 w6", max_tokens=8, temperature=1.0, n=3, seed=42,
              extra_body={"ignore_eos": True, "top_k": 50})
    a = served.client.completions.create(**kw)
    b = served.client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1
    assert a.usage.completion_tokens == 24


def test_adapter_is_served_by_name(served):
    names = [m.id for m in served.client.models.list().data]
    assert names == ["tiny", "tuned"]
    ids = served.tok("w30 w31 w32")["input_ids"]
    base = served.client.completions.create(model="tiny", prompt="w30 w31 w32", max_tokens=6,
                                            temperature=0)
    tuned = served.client.completions.create(model="tuned", prompt="w30 w31 w32", max_tokens=6,
                                             temperature=0)
    assert base.choices[0].text == stock_text(served, ids, 6)[0]
    assert tuned.choices[0].text == stock_text(served, ids, 6, adapter="tuned")[0]
    assert base.choices[0].text != tuned.choices[0].text


def test_concurrent_streaming_clients(served):
    prompts = [" ".join(f"w{3 + (i * 7 + j) % 90}" for j in range(1 + i % 9)) for i in range(32)]
    expected = [stock_text(served, served.tok(p)["input_ids"], 10, eos_token_id=None)[0]
                for p in prompts]
    client = openai.AsyncOpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0)

    async def one(prompt):
        stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=10,
                                                 temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True})
        return "".join([c.choices[0].text async for c in stream])

    async def main():
        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await client.close()

    assert asyncio.run(main()) == expected


def metrics(served) -> dict:
    text = httpx.get(served.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_disconnect_frees_blocks_and_metrics_parse(served):
    body = {"model": "tiny", "prompt": "w5 w6 w7", "max_tokens": 300, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", served.url + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as r:
        lines = 0
        for line in r.iter_lines():
            lines += bool(line.startswith("data:"))
            if lines == 3:
                break  # the client leaves mid-stream
    deadline = time.time() + 20
    while True:
        m = metrics(served)
        if m["hf_paged_num_requests_running"] == 0 and m["hf_paged_kv_blocks_used"] == 0:
            break
        assert time.time() < deadline, m
        time.sleep(0.05)
    assert m["hf_paged_requests_total"] >= 1 or any(k.startswith("hf_paged_requests") for k in m)
    assert m["hf_paged_generation_tokens_total"] > 0
    assert m["hf_paged_time_to_first_token_seconds_count"] > 0
    assert 0 <= m["hf_paged_kv_usage_ratio"] <= 1


def test_logit_bias_allowed_tokens_and_vllm_text_options(served):
    prompt = "w20 w21 w22"
    ids = served.tok(prompt)["input_ids"]
    bias = {5: 3.0, 9: -100.0}
    text, new = stock_text(served, ids, 8, eos_token_id=None,
                           sequence_bias={(t,): b for t, b in bias.items()})
    kw = dict(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
    out = served.client.completions.create(**kw, logit_bias={str(t): b for t, b in bias.items()},
                                           extra_body={"ignore_eos": True})
    assert out.choices[0].text == text and 9 not in new
    # only the allowed tokens, the model's EOS among them, shown with special tokens
    allowed = dict(allowed_token_ids=[1, 7, 8], skip_special_tokens=False,
                   include_stop_str_in_output=True)
    out = served.client.completions.create(**kw, logit_bias={"1": 4.0}, extra_body=allowed)
    words = out.choices[0].text.split()
    assert words and set(words) <= {"w7", "w8", "</s>"} and words[-1] == "</s>"
    streamed = list(served.client.completions.create(**kw, logit_bias={"1": 4.0}, stream=True,
                                                     extra_body=allowed))
    assert "".join(c.choices[0].text for c in streamed) == out.choices[0].text
    # a stop string kept at the end of the text
    plain, _ = stock_text(served, ids, 8, eos_token_id=None)
    stop = plain.split()[2]
    out = served.client.completions.create(
        **kw, stop=[stop], extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert out.choices[0].text == plain[:plain.index(stop) + len(stop)]
    # bad words and a truncated prompt
    out = served.client.completions.create(
        **kw, extra_body={"ignore_eos": True, "bad_words": [plain.split()[0]],
                          "truncate_prompt_tokens": 2})
    word = served.tok.encode(plain.split()[0], add_special_tokens=False)
    short, _ = stock_text(served, ids[-2:], 8, eos_token_id=None, bad_words_ids=[word])
    assert out.choices[0].text == short and out.usage.prompt_tokens == 2
    # the echo is the prompt as it ran
    out = served.client.completions.create(**kw, echo=True, extra_body={
        "ignore_eos": True, "truncate_prompt_tokens": 2})
    tail, _ = stock_text(served, ids[-2:], 8, eos_token_id=None)
    assert out.choices[0].text == served.tok.decode(ids[-2:]) + tail

    # the text tool calls are parsed from leaves out the EOS or stop token that ended it
    from hf_paged import CompletionOutput
    from hf_paged.serving.tools import raw_text

    for reason, stop_reason in (("stop", None), ("stop", 9), ("stop", "w9"), ("length", None)):
        c = CompletionOutput(0, token_ids=[7, 8, 9], finish_reason=reason,
                             stop_reason=stop_reason)
        kept = [7, 8] if not isinstance(stop_reason, str) and reason == "stop" else [7, 8, 9]
        assert raw_text(served.tok, c) == served.tok.decode(kept, skip_special_tokens=False)


def test_a_truncated_chat_prompt_leaves_room_for_its_default_max_tokens():
    tok = tokenizer_with_template()
    app = build_app(long_model("llama_gqa"), tok, served_model_name="tiny", block_size=4,
                    num_blocks=200, max_model_len=64)
    with ServerThread(app) as server:
        for words in (40, 100):  # a prompt that fits, and one longer than the context
            content = " ".join(f"w{5 + i % 80}" for i in range(words))
            r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json=dict(
                model="tiny", messages=[{"role": "user", "content": content}], temperature=0,
                ignore_eos=True, truncate_prompt_tokens=4))
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            assert usage["prompt_tokens"] == 4 and usage["completion_tokens"] == 64 - 4 - 4

BAD = [
    (dict(model="nope", prompt="w5", max_tokens=2), 404, "model"),
    (dict(model="tiny", prompt="w5", max_tokens=-1), 400, "max_tokens"),
    (dict(model="tiny", prompt="w5", max_tokens=2, n=0), 400, "n"),
    (dict(model="tiny", prompt="w5", max_tokens="many"), 400, "max_tokens"),
    (dict(model="tiny", prompt=[3] * 1390, max_tokens=50), 400, "prompt"),  # > context
    (dict(model="tiny", prompt=[3] * 1250, max_tokens=10), 400, "prompt"),  # > the pool
    (dict(model="tiny", prompt="w5", temperature=5), 400, "temperature"),
    (dict(model="tiny", prompt="", max_tokens=2), 400, "prompt"),
    (dict(model="tiny", prompt=[3, 10**6], max_tokens=2), 400, "prompt"),
    (dict(model="tiny", prompt="w5", logit_bias={"five": 1.0}), 400, "logit_bias"),
    (dict(model="tiny", prompt="w5", logit_bias={"5": 101}), 400, "logit_bias"),
    (dict(model="tiny", prompt="w5", logit_bias={"100000000": 1}), 400, "logit_bias"),
    (dict(model="tiny", prompt="w5", allowed_token_ids=[]), 400, "allowed_token_ids"),
    (dict(model="tiny", prompt="w5", allowed_token_ids=[10**6]), 400, "allowed_token_ids"),
    (dict(prompt="w5"), 400, "model"),
    (dict(model="tiny", prompt="w5", max_tokens=2, n=17), 400, "n"),  # > max_num_seqs
]


@pytest.mark.parametrize("body, status, param", BAD)
def test_bad_requests_get_4xx_and_the_server_goes_on(served, body, status, param):
    r = httpx.post(served.url + "/v1/completions", json=body,
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"]
    too_long = isinstance(body.get("prompt"), list) and len(body["prompt"]) > 1000
    assert (error.get("code") == "context_length_exceeded") == too_long
    good = served.client.completions.create(model="tiny", prompt="w5", max_tokens=2)
    assert good.choices[0].finish_reason in ("stop", "length")


def test_invalid_json_auth_and_busy(served):
    r = httpx.post(served.url + "/v1/completions", content=b"{not json",
                   headers={"Authorization": f"Bearer {KEY}", "content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(served.url + "/v1/completions", json={"model": "tiny", "prompt": "w5"})
    assert r.status_code == 401
    assert httpx.get(served.url + "/health").status_code == 200  # not behind the key
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=served.url + "/v1", api_key="wrong",
                      max_retries=0).models.list()
    busy = build_app(llm=served.client and _llm_of(served), served_model_name="tiny",
                     max_waiting_requests=0)
    with ServerThread(busy) as other:
        r = httpx.post(other.url + "/v1/completions", json={"model": "tiny", "prompt": "w5"})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert "0 sequences waiting and this request adds 1" in r.json()["error"]["message"]


def _llm_of(served):
    return served.server.config.app.state.server.llm


def test_chat_without_a_template_is_a_clear_400():
    app = build_app(long_model("llama_gqa"), make_tokenizer(), served_model_name="plain",
                    block_size=4, num_blocks=50)
    with ServerThread(app) as server:
        r = httpx.post(server.url + "/v1/chat/completions", json={
            "model": "plain", "messages": [{"role": "user", "content": "w5"}]})
        assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]
        ok = httpx.post(server.url + "/v1/completions", json={"model": "plain", "prompt": "w5",
                                                              "max_tokens": 2})
        assert ok.status_code == 200


def test_cli_serves_a_trained_lora_and_stops_on_sigterm(tmp_path):
    """`python -m hf_paged.serve FOLDER --lora NAME=DIR`: the fine-tune example's adapter,
    queried with the openai client; SIGTERM ends the server cleanly."""
    from test_finetune import load_example

    ex = load_example()
    tok = ex.build_tokenizer()
    ex.build_base_model().save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    ex.train_adapter(ex.build_base_model(), 40, tmp_path / "counting")
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "hf_paged.serve", str(tmp_path / "base"), "--port", str(port),
         "--served-model-name", "base", "--lora", f"counting={tmp_path / 'counting'}",
         "--num-blocks", "100", "--block-size", "8", "--log-level", "warning"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(proc, port)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               max_retries=0)
        assert [m.id for m in client.models.list().data] == ["base", "counting"]
        out = client.completions.create(model="counting", prompt="n5 n6 n7", max_tokens=4,
                                        temperature=0)
        assert out.choices[0].text.split()[0] == "n8"  # it learned to count
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=60)
        finally:
            proc.kill()
    assert code == 0
