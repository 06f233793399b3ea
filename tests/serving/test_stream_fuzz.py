"""Streams carry exactly the response: random completions and chat requests (stop strings,
min_tokens, penalties, biases, bad words, logprobs, echo, structured outputs, tools, n > 1,
seeded sampling) over a byte-level, a SentencePiece-style byte-fallback or a WordPiece
tokenizer (with Transformers' clean-up of spaces), each sent alone without streaming, then all
streamed at once next to streams their clients abandon and requests the server refuses.
Every stream's text, tool calls, finish reasons, logprobs and usage equal its response, and
the engine holds nothing afterwards. `HF_PAGED_STREAM_FUZZ_CASES` sets how many servers
(random engine settings, 2 to 8 requests each) it draws."""

from __future__ import annotations

import asyncio
import json
import os
import random

import httpx
import pytest

from hf_paged.server import build_app
from conftest import (
    EOS, PUNCTUATION, make_byte_fallback_tokenizer, make_byte_tokenizer, make_model,
    make_punctuation_tokenizer,
)
from test_server import ServerThread

CASES = int(os.environ.get("HF_PAGED_STREAM_FUZZ_CASES", "16"))
TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant:{% endif %}")
BYTE_WORDS = ["héllo", "wörld", "café", "naïve", "€5", "日本語", "テスト", "😀", "the", "quick",
              "fox", " ", "é"]
# Each tokenizer with the words its prompts, stop strings and bad words are drawn from.
TOKENIZERS = {
    "byte-level": (lambda: make_byte_tokenizer(300), BYTE_WORDS),
    "byte-fallback": (make_byte_fallback_tokenizer, BYTE_WORDS + [" a", "b c", " quick fox"]),
    "wordpiece": (lambda: make_punctuation_tokenizer("wordpiece", True),
                  PUNCTUATION + [" ", "do n't", "it 's", " . "]),
}
TOOLS = [{"type": "function", "function": {"name": "get_w", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["paris", "café"]}},
    "required": ["city"]}}}]


def draw(rng: random.Random, vocab: int, words: list[str], chat: bool) -> dict:
    text = lambda: "".join(rng.choice(words) for _ in range(rng.randint(1, 10)))  # noqa: E731
    body = {"model": "m", "max_tokens": rng.randint(1, 30)}
    if rng.random() < 0.5:
        body["temperature"] = 0
    else:
        body.update(temperature=rng.choice([0.5, 1.0]), seed=rng.randrange(10**6),
                    n=rng.randint(1, 3), top_p=rng.choice([0.5, 1.0]))
    options = [("stop", lambda: rng.sample(words, 2)), ("include_stop_str_in_output", lambda: True),
               ("min_tokens", lambda: rng.randint(1, 8)), ("presence_penalty", lambda: 1.0),
               ("repetition_penalty", lambda: 1.3), ("ignore_eos", lambda: True),
               ("logit_bias", lambda: {str(rng.randrange(3, vocab)): rng.choice([-100, 5])}),
               ("bad_words", lambda: [rng.choice(words)]),
               ("guided_regex", lambda: rng.choice(["[a-c]{2,5}", "(é|x)+z"]))]
    for name, value in options:
        if rng.random() < 0.2:
            body[name] = value()
    if chat:
        body["messages"] = [{"role": "user", "content": text()} for _ in range(rng.randint(1, 2))]
        if rng.random() < 0.4:
            body.update(logprobs=True, top_logprobs=rng.randint(0, 3))
        if rng.random() < 0.3 and "guided_regex" not in body:
            body.update(tools=TOOLS, max_tokens=40, tool_choice=rng.choice(
                ["auto", "required", {"type": "function", "function": {"name": "get_w"}}]))
    else:
        body["prompt"] = text() if rng.random() < 0.5 else [
            rng.randrange(3, vocab) for _ in range(rng.randint(1, 30))]
        if rng.random() < 0.4:
            body["logprobs"] = rng.randint(0, 3)
        if rng.random() < 0.2:
            body["echo"] = True
    return body


def choices_of(chunks: list, chat: bool) -> dict:
    """Per choice index, what its chunks add up to (stream) or the choice itself."""
    out: dict = {}
    for c in chunks:
        for ch in c.get("choices", []):
            o = out.setdefault(ch["index"], dict(text="", finish=None, tokens=[], calls=[],
                                                 logprobs=[]))
            part = ch.get("delta", ch.get("message", ch))
            o["text"] += (part.get("content") if chat else ch["text"]) or ""
            o["calls"] += [(t["function"].get("name"), t["function"].get("arguments"))
                           for t in part.get("tool_calls") or []]
            lp = ch.get("logprobs") or {}
            entries = lp.get("content") or []
            o["tokens"] += [e["token"] for e in entries] if chat else lp.get("tokens") or []
            o["logprobs"] += ([e["logprob"] for e in entries] if chat
                              else [v or 0.0 for v in lp.get("token_logprobs") or []])
            o["finish"] = ch.get("finish_reason") or o["finish"]
    return out


async def streamed(client, path: str, body: dict) -> tuple[int, list]:
    body = dict(body, stream=True, stream_options={"include_usage": True})
    async with client.stream("POST", path, json=body, timeout=120) as resp:
        if resp.status_code != 200:
            return resp.status_code, []
        lines = [line[6:] async for line in resp.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return 200, [json.loads(x) for x in lines[:-1]]


async def abandoned(client, path: str, body: dict, after: int) -> None:
    async with client.stream("POST", path, json=dict(body, stream=True, max_tokens=30),
                             timeout=120) as resp:
        async for _ in resp.aiter_lines():
            after -= 1
            if after <= 0:
                return


async def run(seed: int) -> None:
    rng = random.Random(seed)
    make_tokenizer, words = TOKENIZERS[rng.choice(sorted(TOKENIZERS))]
    tok = make_tokenizer()
    tok.chat_template = TEMPLATE
    # (a structured output or a tool call the WordPiece vocabulary cannot spell fails its
    # request: the stream must then end in the same error as the response)
    model = make_model(rng.choice(["llama_gqa", "mistral_sw"]), vocab_size=len(tok) + 8,
                       eos_token_id=EOS)
    block = rng.choice([1, 4, 16])
    app = build_app(model, tok, served_model_name="m", block_size=block,
                    num_blocks=(800 if block == 1 else 2000 // block),
                    max_num_seqs=rng.choice([2, 16]), max_num_batched_tokens=rng.choice([16, 512]),
                    async_scheduling=rng.random() < 0.5)
    jobs = []
    for _ in range(rng.randint(2, 8)):
        chat = rng.random() < 0.4
        jobs.append(("/v1/chat/completions" if chat else "/v1/completions", chat,
                     draw(rng, len(tok), words, chat)))
    with ServerThread(app) as server:
        async with httpx.AsyncClient(base_url=server.url) as client:
            alone = [await client.post(path, json=body, timeout=120) for path, _, body in jobs]
            noise = [abandoned(client, path, body, rng.randint(1, 5)) for path, _, body in jobs
                     if rng.random() < 0.3]
            noise += [client.post(path, json=dict(body, n=0)) for path, _, body in jobs[:1]]
            crowd = (await asyncio.gather(*[streamed(client, p, b) for p, _, b in jobs],
                                          *noise))[:len(jobs)]
            engine = app.state.server.llm.engine
            for _ in range(100):  # abandoned streams are aborted as their clients leave
                stats = engine.stats()
                if not (stats.running or stats.waiting or engine.requests):
                    break
                await asyncio.sleep(0.05)
    assert stats.running == stats.waiting == stats.swapped == stats.blocks_used == 0
    for (path, chat, body), response, (status, chunks) in zip(jobs, alone, crowd):
        assert status == response.status_code, body
        if status != 200:
            continue
        got, want = choices_of(chunks, chat), choices_of([response.json()], chat)
        # (a stream's rows share steps with others': logprobs may differ in the last bits)
        assert [v for c in got.values() for v in c.pop("logprobs")] == pytest.approx(
            [v for c in want.values() for v in c.pop("logprobs")], abs=1e-4), body
        assert got == want, body
        whole = response.json()
        usage = [c["usage"] for c in chunks if c.get("usage")][-1]
        for key in ("prompt_tokens", "completion_tokens"):
            assert usage[key] == whole["usage"][key], body


@pytest.mark.parametrize("seed", range(CASES))
def test_streams_equal_responses(seed):
    asyncio.run(run(seed))
