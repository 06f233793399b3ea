"""`hf-paged serve` against a hostile client: every attack runs next to victim streams,
which must finish with exactly their solo tokens, while /health keeps answering; the
attacker alone gets a 4xx (or finish_reason "error" with a message); the blocks come back.
Also: keys and tenants (several keys, salted prefix caches, per-tenant counters, /metrics
and the docs behind the key), request limits, deadlines, disconnects, streams whose text
equals the final text with a byte-level tokenizer, and SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hf_paged.server import ServerLimits, build_app
from conftest import VOCAB, free_port, make_byte_tokenizer, make_model, wait_healthy
from test_engine import long_model, stock_greedy
from test_server import ServerThread, tokenizer_with_template

KEYS = ["key-alpha", "key-beta"]
A = {"Authorization": f"Bearer {KEYS[0]}"}
B = {"Authorization": f"Bearer {KEYS[1]}"}


@pytest.fixture(scope="module")
def hostile():
    model, tok = long_model("llama_gqa"), tokenizer_with_template()
    app = build_app(model, tok, served_model_name="tiny", api_key=KEYS, block_size=4,
                    num_blocks=300, max_num_seqs=16, max_num_batched_tokens=64,
                    limits=ServerLimits(max_waiting_sequences=40, max_stop_strings=8,
                                        max_stop_chars=200, request_timeout=30.0))
    with ServerThread(app) as server:
        server.model, server.tok = model, tok
        server.llm = app.state.server.llm
        yield server


def post(server, body, headers=A, path="/v1/completions", **kw):
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60, **kw)


def blocks_back(server, timeout=20):
    deadline = time.time() + timeout
    while True:
        stats = server.llm.stats()
        if stats.running == stats.waiting == stats.blocks_used == 0:
            return
        assert time.time() < deadline, stats
        time.sleep(0.05)


class Victims:
    """Greedy streams running while an attack happens; they must get their solo text."""

    PROMPTS = [[3 + i, 10 + i, 20 + i, 30 + i] for i in range(4)]

    def __init__(self, server, max_tokens=40):
        self.server, self.max_tokens = server, max_tokens
        self.refs = [stock_greedy(server.model, p, max_tokens) for p in self.PROMPTS]
        self.texts: list = [None] * len(self.PROMPTS)
        self.health: list[float] = []
        self.threads = [threading.Thread(target=self._one, args=(i,)) for i in
                        range(len(self.PROMPTS))]
        self._stop = threading.Event()
        self.threads.append(threading.Thread(target=self._probe))

    def _one(self, i):
        body = {"model": "tiny", "prompt": self.PROMPTS[i], "max_tokens": self.max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}
        parts = []
        with httpx.stream("POST", self.server.url + "/v1/completions", json=body, headers=B,
                          timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    parts.append(json.loads(line[6:])["choices"][0]["text"])
        self.texts[i] = "".join(parts)

    def _probe(self):
        while not self._stop.is_set():
            t = time.perf_counter()
            assert httpx.get(self.server.url + "/health", timeout=10).status_code == 200
            self.health.append(time.perf_counter() - t)
            time.sleep(0.05)

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        for t in self.threads[:-1]:
            t.join(timeout=120)
        self._stop.set()
        self.threads[-1].join(timeout=30)
        if exc[0] is None:
            tok = self.server.tok
            assert self.texts == [tok.decode(r, skip_special_tokens=True) for r in self.refs]
            assert max(self.health) < 0.5, max(self.health)


ATTACKS = [  # (body, status, param): status 200 means it must run (and not hurt anyone)
    (dict(top_k=10**9, temperature=1.0, seed=1), 200, None),
    (dict(temperature=1e-41), 200, None),
    (dict(stop_token_ids=[10**6], min_tokens=1), 400, "stop_token_ids"),
    (dict(stop_token_ids=[-1], min_tokens=1), 400, "stop_token_ids"),
    (dict(seed=2**64), 400, "seed"),
    (dict(seed=-2**63 - 1), 400, "seed"),
    (dict(repetition_penalty=1e-41), 400, "repetition_penalty"),
    (dict(stop=[f"s{i}" for i in range(9)]), 400, "stop"),
    (dict(stop=["x" * 201]), 400, "stop"),
    (dict(prompt=[[5, 6]] * 11, n=4), 400, "n"),  # 44 sequences > 40
    (dict(cache_salt=""), 400, "cache_salt"),
    (dict(timeout=-1), 400, "timeout"),
    (dict(bad_words=[f"w{i}" for i in range(9)]), 400, "bad_words"),
    (dict(bad_words=["x" * 201]), 400, "bad_words"),
    (dict(allowed_token_ids=list(range(10**5))), 400, "allowed_token_ids"),
    (dict(logit_bias={str(i): 100 for i in range(90)}, temperature=1.0), 200, None),
]


@pytest.mark.parametrize("attack, status, param", ATTACKS)
def test_an_attack_next_to_victims(hostile, attack, status, param):
    body = {"model": "tiny", "prompt": [7, 8, 9], "max_tokens": 30, **attack}
    with Victims(hostile):
        r = post(hostile, body)
    assert r.status_code == status, r.text
    if status == 200:
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] in ("stop", "length")
    else:
        error = r.json()["error"]
        assert error["param"] == param and error["message"]
    blocks_back(hostile)


RAW = [  # raw bodies: (bytes, status)
    (b'{"model": "tiny", "prompt": "w5 \\ud800 w6", "max_tokens": 3}', 400),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}', 400),
    (b'{"model": "tiny", "prompt": "w5 \xff\xfe", "max_tokens": 3}', 400),
    (b'{"model": "tiny", "prompt": [5], "temperature": NaN}', 400),
    (b'{"model": "tiny", "prompt": [5], "top_p": Infinity}', 400),
    (b"[" * 100_000 + b"]" * 100_000, 400),
    (b'{"model": "tiny", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400),
    (b'{"model": "tiny", "prompt": "' + b"w5 " * 1_600_000 + b'"}', 413),
]


@pytest.mark.parametrize("raw, status", RAW, ids=["surrogate", "chat-surrogate", "utf8",
                                                   "nan", "inf", "deep", "deep-field", "huge"])
def test_malformed_bodies_get_openai_errors(hostile, raw, status):
    path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    r = httpx.post(hostile.url + path, content=raw, timeout=60,
                   headers={**A, "content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"]


def test_a_streaming_request_with_a_bad_seed_is_a_400_not_an_empty_200(hostile):
    r = post(hostile, {"model": "tiny", "messages": [{"role": "user", "content": "w5"}],
                       "seed": 2**64, "stream": True}, path="/v1/chat/completions")
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed"


def test_a_huge_prompt_is_tokenized_off_the_event_loop(hostile):
    prompt = "w5 " * 1_200_000  # 3.6 MB: under the body limit, over the context
    with Victims(hostile):
        r = post(hostile, {"model": "tiny", "prompt": prompt, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_a_body_of_a_million_token_ids_is_parsed_off_the_event_loop(hostile):
    """Parsing and validating a body of megabytes takes most of a second: on a worker, so
    that /health and the victims' streams keep going (three such bodies at once)."""
    body = json.dumps({"model": "tiny", "prompt": [5] * 900_000, "max_tokens": 2}).encode()
    with Victims(hostile):
        with ThreadPoolExecutor(3) as pool:
            codes = list(pool.map(lambda _: httpx.post(
                hostile.url + "/v1/completions", content=body, timeout=60,
                headers={**A, "content-type": "application/json"}).json()["error"]["code"],
                range(3)))
    assert codes == ["context_length_exceeded"] * 3


def test_tokenizing_a_huge_text_holds_up_no_stream(hostile):
    text = "w5 " * 1_000_000  # 3 MB, a million tokens and their strings
    with Victims(hostile):
        r = post(hostile, {"prompt": text, "return_token_strs": True}, path="/tokenize")
    assert r.status_code == 200 and r.json()["count"] == len(r.json()["token_strs"]) >= 10**6


def test_constraints_that_compile_for_long_hold_up_no_other_request(hostile, monkeypatch):
    """Eight requests whose constraints compile until released (a pathological regex
    compiles for minutes, and cannot be stopped) fill the compile threads and queue; text
    prompts, chats and /tokenize, which need the other workers, answer meanwhile."""
    release, compile_constraint = threading.Event(), hostile.llm.compile_constraint
    monkeypatch.setattr(hostile.llm, "compile_constraint",
                        lambda spec: (release.wait(60), compile_constraint(spec)))
    pool = ThreadPoolExecutor(8)
    slow = [pool.submit(post, hostile, {"model": "tiny", "prompt": [5], "max_tokens": 2,
                                        "guided_regex": f"w5( w{i + 3})?"}) for i in range(8)]
    try:
        time.sleep(0.3)
        started = time.time()
        assert post(hostile, {"model": "tiny", "prompt": "w5 w6", "max_tokens": 3}
                    ).status_code == 200
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "w5"}],
                "max_tokens": 3}
        assert post(hostile, chat, path="/v1/chat/completions").status_code == 200
        assert post(hostile, {"prompt": "w5 w6"}, path="/tokenize").json()["count"] >= 2
        assert time.time() - started < 10 and not any(f.done() for f in slow)
    finally:
        release.set()
    assert [f.result().status_code for f in slow] == [200] * 8
    blocks_back(hostile)


BAD_BODIES = [  # (raw body, param, what the message must say)
    (b"[1, 2]", None, "must be a JSON object; got an array"),
    (b"model=tiny&prompt=w5", None, "not valid JSON"),
    (b'{"model": "tiny", "prompt": 5}', "prompt", "array of token ids (integers)"),
    (b'{"model": "tiny", "prompt": [1.5, 2]}', "prompt", "got [1.5, 2]"),
    (b'{"model": "tiny", "prompt": "w5", "n": 1000000}', "n", "got 1000000"),
    (b'{"model": "tiny", "prompt": "w5", "stop": 5}', "stop", "expected str or list[str]; got 5"),
    (b'{"prompt": "w5"}', "model", "model: this field is required"),
]


@pytest.mark.parametrize("raw, param, says", BAD_BODIES)
def test_a_bad_body_is_a_400_saying_what_was_expected_and_given(hostile, raw, param, says):
    r = httpx.post(hostile.url + "/v1/completions", content=raw, timeout=60,
                   headers={**A, "content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error


def test_metrics_and_docs_need_a_key(hostile):
    for path in ("/metrics", "/docs", "/redoc", "/openapi.json", "/v1/models",
                 "/v1/models/tiny"):
        assert httpx.get(hostile.url + path).status_code == 401, path
        assert httpx.get(hostile.url + path, headers=B).status_code == 200, path
    assert httpx.get(hostile.url + "/health").status_code == 200
    schema = httpx.get(hostile.url + "/openapi.json", headers=B).json()  # bodies documented
    body = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]
    assert body["application/json"]["schema"]["$ref"].endswith("/ChatCompletionRequest")
    assert "messages" in schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    r = httpx.get(hostile.url + "/v1/models", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def tenant_hits(server) -> dict:
    text = httpx.get(server.url + "/metrics", headers=A).text
    return {s.labels["tenant"]: s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == "hf_paged_tenant_prefix_cache_hit_tokens_total"}


def test_tenants_never_share_cached_prompts(hostile):
    prompt = [random.Random(3).randrange(3, VOCAB) for _ in range(60)]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0}

    def cached(headers, **extra):
        r = post(hostile, {**body, **extra}, headers=headers)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    before = tenant_hits(hostile)
    assert cached(A) == 0
    assert cached(B) == 0  # the same prompt, another key: nothing shared
    assert cached(A) == 56  # its own prompt again: 14 blocks of 4
    assert cached(A, cache_salt="private") == 0  # a salt of its own
    assert cached(B) == 56
    after = tenant_hits(hostile)
    assert after["key-0"] - before.get("key-0", 0) == 56
    assert after["key-1"] - before.get("key-1", 0) == 56


def counters(server) -> dict:
    """The request counters of /metrics: {(name, finish reason or tenant): value}."""
    text = httpx.get(server.url + "/metrics", headers=A).text
    return {(s.name, s.labels.get("finish_reason") or s.labels.get("tenant")): s.value
            for f in text_string_to_metric_families(text) for s in f.samples
            if s.name in ("hf_paged_requests_total", "hf_paged_tenant_requests_total")}


def test_a_client_that_leaves_aborts_its_request_which_is_counted(hostile):
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 1100, "ignore_eos": True}
    before, counted = hostile.llm.stats().generation_tokens, counters(hostile)
    for _ in range(2):
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes
            httpx.post(hostile.url + "/v1/completions", json=body, headers=A, timeout=0.6)
    with httpx.stream("POST", hostile.url + "/v1/completions", json={**body, "stream": True},
                      headers=A, timeout=60) as r:
        next(r.iter_lines())  # one event, then the client is gone
    blocks_back(hostile)
    assert hostile.llm.stats().generation_tokens - before < 3 * 1100
    deadline = time.time() + 20
    while True:  # counted as they end, unread (the stream's last output comes a step later)
        now = counters(hostile)
        added = {k: now[k] - counted.get(k, 0) for k in now if now[k] != counted.get(k, 0)}
        if added == {("hf_paged_requests_total", "abort"): 3,
                     ("hf_paged_tenant_requests_total", "key-0"): 3} or time.time() > deadline:
            break
        time.sleep(0.05)
    assert added == {("hf_paged_requests_total", "abort"): 3,
                     ("hf_paged_tenant_requests_total", "key-0"): 3}


def test_too_many_prompts_are_refused_before_any_is_checked(hostile, monkeypatch):
    checked = []
    monkeypatch.setattr(hostile.llm, "prepare", lambda *args: checked.append(args))
    r = post(hostile, {"model": "tiny", "prompt": [[5]] * 5000, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = post(hostile, {"model": "tiny", "prompt": [[5]] * 2500, "max_tokens": 2, "n": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert not checked


def test_a_response_is_built_off_the_event_loop(hostile, monkeypatch):
    from hf_paged.serving import server as module

    built, build = [], module.completion_response

    def recorded(*args):
        built.append(threading.current_thread().name)
        return build(*args)

    monkeypatch.setattr(module, "completion_response", recorded)
    r = post(hostile, {"model": "tiny", "prompt": [5, 6], "max_tokens": 2, "logprobs": 2})
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["tokens"]) == 2
    assert len(built) == 1 and built[0].startswith("hf-paged-worker")


@pytest.mark.parametrize("extra", [
    dict(tools=[{"type": "function", "function": {"name": "f"}}],
         tool_choice={"type": "function", "function": "f"}),
    dict(messages=[{"role": "assistant", "content": "w5", "tool_calls": "abc"}]),
    dict(messages=[{"role": "assistant", "content": "w5", "tool_calls": [1]}]),
    dict(messages=[{"role": "assistant", "content": "w5", "tool_calls": [{"function": "f"}]}]),
    dict(tools=[{"type": "function", "function": "f"}]),
    dict(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]),
], ids=["tool_choice", "calls-string", "calls-number", "function-string", "tool-string",
        "tool-parameters"])
def test_malformed_tool_fields_are_400s(hostile, extra):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "w5"}], "max_tokens": 3,
            **extra}
    param = next(k for k in ("tool_choice", "tools", "messages") if k in extra)
    paths = ["/v1/chat/completions"] + (["/tokenize"] if param != "tool_choice" else [])
    for path in paths:
        r = post(hostile, body, path=path)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, r.text)


def test_deadlines(hostile):
    r = post(hostile, {"model": "tiny", "prompt": [5, 6], "max_tokens": 1100,
                       "ignore_eos": True, "timeout": 0.3})
    choice = r.json()["choices"][0]
    assert r.status_code == 200 and choice["finish_reason"] == "timeout"
    assert 0 < r.json()["usage"]["completion_tokens"] < 1100
    blocks_back(hostile)
    limits = hostile.server.config.app.state.server  # --request-timeout 30 is a cap
    assert (limits.timeout_for(None), limits.timeout_for(100.0), limits.timeout_for(2.0)) == \
        (30.0, 30.0, 2.0)


def test_random_mix_with_invalid_requests(hostile):
    """200 concurrent requests, 10% invalid or pathological: every valid one gets its solo
    tokens."""
    rng = random.Random(9)
    bad = [dict(stop_token_ids=[999], min_tokens=1), dict(seed=2**65), dict(top_p=0),
           dict(repetition_penalty=0), dict(n=0), dict(max_tokens=10**6),
           dict(prompt=[3, 10**7]), dict(stop=["a"] * 50), dict(logprobs=99)]
    jobs = []
    for i in range(200):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 20))]
        body = {"model": "tiny", "prompt": prompt, "max_tokens": rng.randint(1, 12),
                "temperature": 0, "ignore_eos": True}
        if rng.random() < 0.1:
            body.update(rng.choice(bad))
            jobs.append((body, None))
        else:
            jobs.append((body, stock_greedy(hostile.model, prompt, body["max_tokens"])))

    async def main():
        async with httpx.AsyncClient(base_url=hostile.url, headers=A, timeout=120) as client:
            sem = asyncio.Semaphore(24)

            async def one(body):
                async with sem:
                    return await client.post("/v1/completions", json=body)

            return await asyncio.gather(*(one(b) for b, _ in jobs))

    answers = asyncio.run(main())
    for (body, ref), r in zip(jobs, answers):
        if ref is None:
            assert 400 <= r.status_code < 500, (body, r.text)
        else:
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == hostile.tok.decode(ref, skip_special_tokens=True)
    blocks_back(hostile)


# -- streams whose text is the final text -----------------------------------------------------------
@pytest.fixture(scope="module")
def bytes_server():
    tok = make_byte_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    model = make_model("llama_gqa", vocab_size=len(tok), max_position_embeddings=400)
    app = build_app(model, tok, served_model_name="bytes", block_size=4, num_blocks=200)
    with ServerThread(app) as server:
        server.tok = tok
        yield server


@pytest.mark.parametrize("seed", range(4))
def test_streamed_text_equals_the_final_text_with_a_byte_level_tokenizer(bytes_server, seed):
    prompt = [random.Random(seed).randrange(3, 300) for _ in range(5)]
    body = {"model": "bytes", "prompt": prompt, "max_tokens": 40, "temperature": 1.0,
            "seed": seed, "ignore_eos": True, "logprobs": 5}
    whole = post(bytes_server, body, headers={}).json()["choices"][0]
    parts, tokens = [], []
    with httpx.stream("POST", bytes_server.url + "/v1/completions",
                      json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                parts.append(choice["text"])
                tokens += choice["logprobs"]["tokens"]
    assert "".join(parts) == whole["text"]
    lp = whole["logprobs"]
    assert tokens == lp["tokens"]
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert top[token] == value  # the chosen token's own value, under its own string
        assert len(top) >= 5  # nothing collapsed
    chat = post(bytes_server, {"model": "bytes", "messages": [{"role": "user", "content": "é"}],
                               "max_tokens": 30, "temperature": 1.0, "seed": seed,
                               "logprobs": True, "top_logprobs": 3},
                headers={}, path="/v1/chat/completions").json()["choices"][0]
    streamed = []
    with httpx.stream("POST", bytes_server.url + "/v1/chat/completions", timeout=60, json={
            "model": "bytes", "messages": [{"role": "user", "content": "é"}], "max_tokens": 30,
            "temperature": 1.0, "seed": seed, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                streamed.append(json.loads(line[6:])["choices"][0]["delta"].get("content") or "")
    assert "".join(streamed) == chat["message"]["content"]
    for entry in chat["logprobs"]["content"]:
        if entry["token"].startswith("bytes:"):  # part of a character: its own bytes
            assert entry["token"] == "bytes:" + "".join(f"\\x{b:02x}" for b in entry["bytes"])


# -- SIGTERM ------------------------------------------------------------------------------------
def test_sigterm_ends_open_streams_with_an_error_and_done(tmp_path):
    """Streams end with an error event and [DONE]; a running request without streaming
    gets its answer so far with the error; one still compiling its constraint a 503."""
    model, tok = long_model("llama_gqa"), tokenizer_with_template()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "hf_paged.serve", str(tmp_path), "--port", str(port),
         "--served-model-name", "tiny", "--num-blocks", "400", "--block-size", "4",
         "--shutdown-grace", "1", "--log-level", "warning", "--api-key", "k1",
         "--api-key", "k2"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(proc, port)
        lines = []
        body = {"model": "tiny", "prompt": [5, 6], "max_tokens": 1300, "ignore_eos": True,
                "stream": True}
        started = time.time()
        url = f"http://127.0.0.1:{port}"
        assert httpx.post(url + "/v1/completions", json=body).status_code == 401
        # A constraint that compiles for minutes (and cannot be stopped) is open too.
        compiling = ThreadPoolExecutor(1).submit(
            httpx.post, url + "/v1/completions", timeout=60, headers={"Authorization": "Bearer k1"},
            json={"model": "tiny", "prompt": [5, 6], "guided_regex": "(w5*)*" * 3000})
        # A request without streaming, running: its partial answer, with the error.
        running = ThreadPoolExecutor(1).submit(
            httpx.post, url + "/v1/completions", timeout=60, headers={"Authorization": "Bearer k1"},
            json={**body, "stream": False})
        time.sleep(0.5)
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60,
                          headers={"Authorization": "Bearer k2"}) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    lines.append(line)
                if len(lines) == 5:
                    proc.send_signal(signal.SIGTERM)
        assert time.time() - started < 30
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2][6:])["error"]
        assert "shutting down" in error["message"]
        finals = [json.loads(x[6:])["choices"][0]["finish_reason"] for x in lines[:-2]]
        assert finals[-1] == "error" and len(finals) < 1300
        assert proc.wait(timeout=60) == 0
        assert time.time() - started < 30  # nothing waited for the compile
        r = compiling.result()
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
        r = running.result()
        assert r.status_code == 200 and "shutting down" in r.json()["error"]["message"]
        assert r.json()["choices"][0]["finish_reason"] == "error"
    finally:
        proc.kill()


def test_a_stream_of_several_prompts_adds_up_to_the_whole(hostile):
    body = {"model": "tiny", "prompt": [[5, 6], [7, 8, 9], [10]], "n": 2, "max_tokens": 12,
            "temperature": 0.9, "seed": 4, "stop": ["w7"], "ignore_eos": True}
    whole = post(hostile, body).json()["choices"]
    texts: dict = {}
    with httpx.stream("POST", hostile.url + "/v1/completions", json={**body, "stream": True},
                      headers=A, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {c["index"]: c["text"] for c in whole} and len(texts) == 6
