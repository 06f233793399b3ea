"""vLLM's `use_beam_search` on a loopback server: the choices of a completions or chat
request are the beams of the same search on stock forwards (tests/engine), best first,
their text without a final EOS; settings the search would ignore, and streaming, are 400s
naming them; the steps' requests go through the server's own admission."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

from hf_paged import BeamSearchParams
from hf_paged.engine.llm import render_chat
from hf_paged.server import build_app
from conftest import EOS, make_model
from test_server import ServerThread, tokenizer_with_template

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from test_beam_search import stock_beam_search  # noqa: E402


@pytest.fixture(scope="module")
def served():
    model = make_model("llama_gqa", max_position_embeddings=512)
    tok = tokenizer_with_template()
    app = build_app(model, tok, served_model_name="tiny", block_size=4, num_blocks=256,
                    max_num_seqs=8)
    with ServerThread(app) as server:
        server.model, server.tok = model, tok
        server.http = httpx.Client(base_url=server.url, timeout=120)
        yield server


@pytest.mark.parametrize("length_penalty, ignore_eos", [(1.0, True), (0.5, False)])
def test_completion_beams_equal_the_search_on_stock_forwards(served, length_penalty,
                                                             ignore_eos):
    prompts = [[3, 4, 5, 6, 7], [9, 30, 31]]
    r = served.http.post("/v1/completions", json={
        "model": "tiny", "prompt": prompts, "max_tokens": 5, "n": 3, "use_beam_search": True,
        "length_penalty": length_penalty, "ignore_eos": ignore_eos})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 6
    params = BeamSearchParams(beam_width=3, max_tokens=5, length_penalty=length_penalty,
                              ignore_eos=ignore_eos)
    for k, prompt in enumerate(prompts):
        ref = stock_beam_search(served.model, prompt, params, set() if ignore_eos else {EOS})
        mine = [c for c in choices if c["index"] // 3 == k] if all(
            "index" in c for c in choices) else choices[3 * k:3 * k + 3]
        for choice, (tokens, _) in zip(mine, ref):
            new = tokens[len(prompt):]
            ended = not ignore_eos and new[-1] == EOS
            assert choice["text"] == served.tok.decode(new[:-1] if ended else new,
                                                       skip_special_tokens=True)
            assert choice["finish_reason"] == ("stop" if ended else "length")
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == sum(len(p) for p in prompts)


def test_chat_beams_are_the_choices(served):
    messages = [{"role": "user", "content": "w5 w6 w7"}]
    r = served.http.post("/v1/chat/completions", json={
        "model": "tiny", "messages": messages, "max_tokens": 4, "n": 2,
        "use_beam_search": True, "ignore_eos": True})
    assert r.status_code == 200, r.text
    _, prompt = render_chat(served.tok, messages, None, add_generation_prompt=True)
    ref = stock_beam_search(served.model, prompt, BeamSearchParams(
        beam_width=2, max_tokens=4, ignore_eos=True), set())
    got = [c["message"]["content"] for c in r.json()["choices"]]
    assert got == [served.tok.decode(t[len(prompt):], skip_special_tokens=True)
                   for t, _ in ref]


def test_beam_logprobs_only_when_asked_and_as_many_as_asked(served):
    base = {"model": "tiny", "max_tokens": 3, "n": 4, "use_beam_search": True,
            "ignore_eos": True}
    r = served.http.post("/v1/completions", json={**base, "prompt": [5, 6]}).json()
    assert all(c["logprobs"] is None for c in r["choices"])
    r = served.http.post("/v1/completions", json={**base, "prompt": [5, 6], "logprobs": 1})
    for choice in r.json()["choices"]:
        tops = choice["logprobs"]["top_logprobs"]
        assert len(tops) == 3 and all(1 <= len(top) <= 2 for top in tops)
    messages = [{"role": "user", "content": "w5"}]
    r = served.http.post("/v1/chat/completions", json={**base, "messages": messages}).json()
    assert all(c["logprobs"] is None for c in r["choices"])
    r = served.http.post("/v1/chat/completions", json={
        **base, "messages": messages, "logprobs": True, "top_logprobs": 2}).json()
    for choice in r["choices"]:
        assert all(len(entry["top_logprobs"]) == 2 for entry in choice["logprobs"]["content"])


@pytest.mark.parametrize("extra, param", [
    ({"stream": True}, "stream"), ({"stop": ["w9"]}, "stop"), ({"top_p": 0.5}, "top_p"),
    ({"n": 11}, "n"), ({"seed": 3}, "seed"), ({"length_penalty": "x"}, "length_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
    # (its text would skip them anyway, and its logprobs name them as shown)
    ({"skip_special_tokens": False}, "skip_special_tokens")])
def test_what_beam_search_would_ignore_is_a_400(served, extra, param):
    r = served.http.post("/v1/completions", json={
        "model": "tiny", "prompt": [3, 4], "max_tokens": 3, "n": 2, "use_beam_search": True,
        **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    ok = served.http.post("/v1/completions", json={"model": "tiny", "prompt": [3, 4],
                                                   "max_tokens": 2})
    assert ok.status_code == 200
