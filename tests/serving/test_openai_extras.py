"""The OpenAI surface beyond completions and chat, on a loopback server: `echo` with
prompt log-probabilities (what lm-evaluation-harness's loglikelihood tasks send), the
`max_tokens=0` scoring call, streaming echo, and /tokenize and /detokenize. Log-probabilities
are compared with one stock forward of the same model."""

from __future__ import annotations

import json
import math

import httpx
import openai
import pytest
import torch

from hf_paged.server import build_app
from conftest import make_model
from test_server import ServerThread, tokenizer_with_template

KEY = "k"


@pytest.fixture(scope="module")
def served():
    model = make_model("llama_gqa", max_position_embeddings=512)
    tok = tokenizer_with_template()
    app = build_app(model, tok, served_model_name="tiny", api_key=KEY, block_size=4,
                    num_blocks=256, max_num_seqs=8, max_num_batched_tokens=16)
    with ServerThread(app) as server:
        server.model, server.tok = model, tok
        server.client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        server.http = httpx.Client(base_url=server.url,
                                   headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        yield server


def stock_logprobs(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def check_prompt_part(served, ids, lp_obj, k):
    """The echoed prompt's logprobs: first null, then each token's own and its top k."""
    lp = stock_logprobs(served.model, ids)
    n = len(ids)
    assert lp_obj["token_logprobs"][0] is None and lp_obj["top_logprobs"][0] is None
    assert lp_obj["tokens"][:n] == [served.tok.convert_ids_to_tokens(t) for t in ids] or \
        len(lp_obj["tokens"]) >= n
    for p in range(1, n):
        want = lp[p - 1, ids[p]].item()
        assert math.isclose(lp_obj["token_logprobs"][p], want, abs_tol=1e-4), p
        top = lp_obj["top_logprobs"][p]
        best = lp[p - 1].topk(k).values.tolist()
        assert math.isclose(max(top.values()), max(best[0], want), abs_tol=1e-4)
        assert len(top) in (k, k + 1)  # the prompt token, and the k best (it may be one)


def test_echo_scores_the_prompt_like_lm_eval(served):
    """lm-eval's loglikelihood request: token ids, echo, logprobs=1, max_tokens=1; it
    reads token_logprobs[ctxlen:-1] and compares each with max(top_logprobs)."""
    ids = [5, 9, 14, 3, 22, 40, 7, 61, 33, 12, 18]
    body = dict(model="tiny", prompt=[ids, ids[:6]], echo=True, logprobs=1, max_tokens=1,
                temperature=0, seed=1234)
    r = served.http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1]
    for choice, prompt in zip(out["choices"], (ids, ids[:6])):
        lps = choice["logprobs"]
        assert len(lps["token_logprobs"]) == len(prompt) + 1  # the prompt, then one token
        check_prompt_part(served, prompt, lps, 1)
        greedy = stock_logprobs(served.model, prompt)[-1]
        assert math.isclose(lps["token_logprobs"][-1], greedy.max().item(), abs_tol=1e-4)
        prompt_text = served.tok.decode(prompt)
        assert choice["text"].startswith(prompt_text)
        offsets = lps["text_offset"]
        assert offsets == sorted(offsets) and offsets[0] == 0
        assert offsets[len(prompt)] == len(prompt_text)
        # lm-eval's greedy check: a greedy continuation's token is the top one.
        assert lps["token_logprobs"][-1] == max(lps["top_logprobs"][-1].values())
    assert out["usage"]["completion_tokens"] == 2


def test_max_tokens_zero_returns_the_prompt_alone(served):
    prompt = "w5 w6 w7 w8"
    ids = served.tok(prompt)["input_ids"]
    out = served.client.completions.create(model="tiny", prompt=prompt, echo=True, logprobs=3,
                                           max_tokens=0)
    choice = out.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    assert len(choice.logprobs.token_logprobs) == len(ids)
    check_prompt_part(served, ids, choice.logprobs.model_dump(), 3)
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)
    plain = served.client.completions.create(model="tiny", prompt=prompt, max_tokens=0)
    assert plain.choices[0].text == "" and plain.choices[0].logprobs is None


def test_streamed_echo_adds_up_to_the_whole(served):
    prompt = "w20 w21 w22"
    whole = served.client.completions.create(model="tiny", prompt=prompt, echo=True,
                                             logprobs=2, max_tokens=5, temperature=0)
    chunks = list(served.client.completions.create(model="tiny", prompt=prompt, echo=True,
                                                   logprobs=2, max_tokens=5, temperature=0,
                                                   stream=True))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text and text.startswith(prompt)
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs
              for t in c.choices[0].logprobs.token_logprobs]
    assert tokens == whole.choices[0].logprobs.token_logprobs
    offsets = [o for c in chunks if c.choices and c.choices[0].logprobs
               for o in c.choices[0].logprobs.text_offset]
    assert offsets == whole.choices[0].logprobs.text_offset
    scoring = list(served.client.completions.create(model="tiny", prompt=prompt, echo=True,
                                                    max_tokens=0, stream=True))
    assert [c.choices[0].text for c in scoring if c.choices] == [prompt]


def test_echo_without_logprobs_and_with_n(served):
    out = served.client.completions.create(model="tiny", prompt="w9 w8", echo=True,
                                           max_tokens=3, n=2, temperature=0.9, seed=3)
    assert all(c.text.startswith("w9 w8") and c.logprobs is None for c in out.choices)


def test_tokenize_and_detokenize(served):
    prompt = "w5 w6 w7"
    r = served.http.post("/tokenize", json={"model": "tiny", "prompt": prompt,
                                            "return_token_strs": True})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["tokens"] == served.tok(prompt)["input_ids"] and got["count"] == len(got["tokens"])
    assert got["max_model_len"] == 512
    assert got["token_strs"] == served.tok.convert_ids_to_tokens(got["tokens"])
    messages = [{"role": "user", "content": "w5 w6"}]
    chat = served.http.post("/tokenize", json={"messages": messages}).json()
    want = served.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert chat["tokens"] == list(want["input_ids"] if hasattr(want, "keys") else want)
    back = served.http.post("/detokenize", json={"model": "tiny", "tokens": got["tokens"]})
    assert back.status_code == 200 and back.json()["prompt"] == served.tok.decode(got["tokens"])


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"model": "tiny"}, "prompt"),
    ("/tokenize", {"prompt": "w5", "messages": [{"role": "user", "content": "x"}]}, "prompt"),
    ("/tokenize", {"model": "nope", "prompt": "w5"}, "model"),
    ("/detokenize", {"tokens": [1, 10**7]}, "tokens"),
    ("/detokenize", {"tokens": "w5"}, "tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "echo": True, "logprobs": 21},
     "logprobs"),
])
def test_bad_extras_get_400s(served, path, body, param):
    r = served.http.post(path, json=body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param
    assert served.http.post("/tokenize", json={"prompt": "w5"}).status_code == 200


@pytest.mark.parametrize("raw, param", [
    ('{"prompt": "w5 \\ud800"}', "prompt"),
    ('{"messages": [{"role": "user", "content": "\\udc00"}]}', "messages"),
])
def test_a_lone_surrogate_is_a_400_for_the_extras_too(served, raw, param):
    r = served.http.post("/tokenize", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_extras_need_the_key(served):
    r = httpx.post(served.url + "/tokenize", json={"prompt": "w5"}, timeout=30)
    assert r.status_code == 401
    assert json.loads(r.text)["error"]


def test_lm_eval_local_completions_scores_like_stock(served):
    """lm-evaluation-harness's `local-completions` model with the server's own tokenizer
    (/tokenizer_info, /tokenize, /detokenize): loglikelihoods equal one stock forward's,
    greedy flags too, and generate_until returns the greedy text."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(model="tiny", base_url=served.url + "/v1/completions",
                             tokenizer_backend="remote", auth_token=KEY,
                             header={"Authorization": f"Bearer {KEY}"}, num_concurrent=2,
                             max_retries=1, batch_size=2)
    pairs = [("w5 w6 w7", " w8 w9"), ("w10 w11 w12 w13", " w14"), ("w3", " w4 w5 w6"),
             ("w20 w21", " w22")]
    results = lm.loglikelihood([Instance("loglikelihood", {}, pair, i)
                                for i, pair in enumerate(pairs)], disable_tqdm=True)
    tok = served.tok
    for (context, continuation), (score, greedy) in zip(pairs, results):
        whole = tok(context + continuation, add_special_tokens=False)["input_ids"]
        ctx = len(tok(context, add_special_tokens=False)["input_ids"])
        lp = stock_logprobs(served.model, whole)
        want = [lp[p - 1, whole[p]].item() for p in range(ctx, len(whole))]
        assert math.isclose(score, sum(want), abs_tol=1e-3)
        assert greedy == all(lp[p - 1].argmax().item() == whole[p]
                             for p in range(ctx, len(whole)))
    [text] = lm.generate_until([Instance("generate_until", {}, (
        "w5 w6 w7", {"until": ["zzz"], "max_gen_toks": 4}), 0)], disable_tqdm=True)
    ids = tok("w5 w6 w7", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        new = served.model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False,
                                    pad_token_id=0)[0, len(ids):].tolist()
    assert text == tok.decode(new, skip_special_tokens=True)


@pytest.mark.parametrize("backend", ["huggingface", "remote"])
def test_lm_eval_matches_its_own_hf_backend(tmp_path, backend):
    """The same model folder scored by lm-eval's `hf` backend (Transformers, in process)
    and by `local-completions` against `hf-paged serve` on it: per-sample log-likelihoods
    within 1e-4, the same greedy flags, and the same generate_until strings."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    folder = tmp_path / "model"
    make_model("llama_gqa", max_position_embeddings=512).save_pretrained(folder)
    tokenizer_with_template().save_pretrained(folder)
    pairs = [("w5 w6 w7", " w8"), ("w5 w6 w7", " w9 w10"), ("w40 w41 w42 w43 w44", " w45"),
             ("w3", " w4 w5 w6 w7"), ("w60 w61", " w62")]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    gen = [Instance("generate_until", {}, (ctx, {"until": ["w90"], "max_gen_toks": 5,
                                                 "do_sample": False}), i)
           for i, ctx in enumerate(["w5 w6 w7", "w30 w31"])]
    hf = HFLM(pretrained=str(folder), device="cpu", dtype="float32", batch_size=2)
    want = hf.loglikelihood(requests, disable_tqdm=True)
    want_text = hf.generate_until(gen, disable_tqdm=True)
    app = build_app(str(folder), served_model_name="m", block_size=4, num_blocks=256,
                    max_num_seqs=8, max_num_batched_tokens=16)
    with ServerThread(app) as server:
        extra = {"tokenizer": str(folder)} if backend == "huggingface" else {}
        api = LocalCompletionsAPI(model="m", base_url=server.url + "/v1/completions",
                                  tokenizer_backend=backend, num_concurrent=2, max_retries=1,
                                  batch_size=3, **extra)
        got = api.loglikelihood(requests, disable_tqdm=True)
        got_text = api.generate_until(gen, disable_tqdm=True)
    for (score, greedy), (ref, ref_greedy) in zip(got, want):
        assert math.isclose(score, ref, abs_tol=1e-4), (score, ref)
        assert greedy == ref_greedy
    assert got_text == want_text


def test_text_offsets_count_characters_split_over_tokens():
    """A character whose bytes span tokens starts where its first byte's token is and
    counts once, with the token completing it; offsets go on across stream chunks."""
    from hf_paged.engine.detokenizer import TokenPieces
    from hf_paged.serving.logprobs import TextOffsets, token_logprobs
    from conftest import make_byte_tokenizer

    tok = make_byte_tokenizer()
    pieces = TokenPieces(tok)
    text = "héllo wörld café 日本語 😀 naïve"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text and any(pieces.text(i).startswith("bytes:") for i in ids)
    want = [len(tok.decode(ids[:i]).rstrip("\ufffd")) for i in range(len(ids))]
    whole = token_logprobs(ids, [None] * len(ids), pieces, 0)["text_offset"]
    assert whole == want
    at, streamed = TextOffsets(), []
    for first in range(0, len(ids), 3):  # chunks that cut characters apart
        chunk = ids[first:first + 3]
        streamed += token_logprobs(chunk, [None] * len(chunk), pieces, at)["text_offset"]
    assert streamed == want
    lone = [i for i in ids if pieces.text(i).startswith("bytes:")][0]  # a byte never completed
    offsets = token_logprobs([lone] + ids[:2], [None] * 3, pieces, 0)["text_offset"]
    assert offsets == [0, 1, 1 + len(pieces.text(ids[0]))]  # it stands for one "\ufffd"


@pytest.mark.parametrize("kind", ["word-level", "sentencepiece", "byte-level"])
def test_special_tokens_add_to_logprob_offsets_only_what_the_text_shows(kind):
    """A special token the text leaves out (skip_special_tokens) was still counted into every
    later `text_offset`, and a token after a special one kept in the text lost its
    separator. Now a left-out token keeps its name and adds nothing, and a kept one is named
    by the text it adds: the shown tokens add up to the text either way."""
    import random

    from hf_paged.engine.detokenizer import TokenPieces
    from hf_paged.serving.logprobs import token_logprobs
    from conftest import (BOS, EOS, PAD, make_byte_fallback_tokenizer, make_byte_tokenizer,
                          make_tokenizer)

    tok = {"word-level": make_tokenizer, "sentencepiece": make_byte_fallback_tokenizer,
           "byte-level": make_byte_tokenizer}[kind]()
    words = tok("the quick fox a b c" if kind != "word-level" else "w5 w9 w14 w3")["input_ids"]
    if kind == "sentencepiece":  # (its words come as byte tokens: it has no merges)
        words += tok.convert_tokens_to_ids(["▁the", "▁quick", "▁fox", "b", "c"])
    rng = random.Random(0)
    for case in range(40):
        ids = [rng.choice(words + [PAD, EOS, BOS]) for _ in range(rng.randint(1, 12))]
        for skip in (True, False):
            pieces = TokenPieces(tok).reading(skip)
            lps = token_logprobs(ids, [None] * len(ids), pieces, 0)
            text = tok.decode(ids, skip_special_tokens=skip)
            shown = [t for j, (t, i) in enumerate(zip(lps["tokens"], ids)) if pieces.shown(j, i)]
            assert "".join(shown) == text, (ids, skip, lps["tokens"], text)
            at = 0  # a left-out token starts where the next shown one does
            for j, (offset, t, i) in enumerate(zip(lps["text_offset"], lps["tokens"], ids)):
                assert offset == at, (ids, skip, j)
                if pieces.shown(j, i):
                    assert text[at:at + len(t)] == t, (ids, skip, j)
                    at += len(t)
            assert set(lps["tokens"]) >= {tok.decode([i]) for i in ids if i in (PAD, EOS, BOS)
                                          and skip}


@pytest.mark.parametrize("skip", [True, False])
def test_the_stop_token_that_ended_a_completion_adds_nothing_to_its_text(skip):
    """A completion's text never holds the EOS or stop token that ended it (unless
    include_stop_str_in_output), yet its logprob token and offset counted it: with
    skip_special_tokens false (EOS is shown there) or a stop token that is a word, the
    tokens did not add up to the text. The other candidates at its position are named as
    anywhere else (with their separator)."""
    from hf_paged import CompletionOutput
    from hf_paged.engine.detokenizer import TokenPieces
    from hf_paged.serving.logprobs import completion_logprobs, completion_pieces
    from conftest import EOS, make_tokenizer

    tok, pieces = make_tokenizer(), TokenPieces(make_tokenizer())
    for ids, reason in (([5, 9, 14, EOS], None), ([5, 9, 14], 14), ([EOS], None)):
        for keep in (False, True):
            text = tok.decode(ids if keep else ids[:-1], skip_special_tokens=skip)
            out = CompletionOutput(0, text, ids, logprobs=[{t: -1.0, 20: -2.0} for t in ids],
                                   finish_reason="stop", stop_reason=reason)
            read = completion_pieces(pieces, out, skip, keep)
            lps = completion_logprobs(out, 0, read, 0)
            shown = [t for j, (t, i) in enumerate(zip(lps["tokens"], ids)) if read.shown(j, i)]
            assert "".join(shown) == text, (ids, keep, lps["tokens"], text)
            assert all(text[at:at + len(t)] == t for at, t, j, i in zip(
                lps["text_offset"], lps["tokens"], range(len(ids)), ids) if read.shown(j, i))
            assert lps["text_offset"][-1] == len(text) or read.shown(len(ids) - 1, ids[-1])
            if len(ids) > 1:  # the alternative w20 after a word: with its separator
                assert " w20" in lps["top_logprobs"][-1], lps["top_logprobs"]


def test_echo_offsets_leave_out_the_special_tokens_a_text_prompt_gained():
    """A text prompt's tokenizer adds BOS, which the echoed text (the prompt as written)
    does not hold: it pushed every later `text_offset` past its token. A token-id prompt's
    echo is its ids decoded, BOS and all, and the token after BOS carries the space the
    text has there."""
    from tokenizers import processors

    from conftest import BOS, make_byte_fallback_tokenizer

    tok = make_byte_fallback_tokenizer()
    tok._tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", BOS)])
    model = make_model("llama_gqa", vocab_size=len(tok))
    words = tok("the quick fox")["input_ids"]
    assert words[0] == BOS
    with ServerThread(build_app(model, tok, served_model_name="sp", block_size=4,
                                num_blocks=64)) as server, \
            httpx.Client(base_url=server.url, timeout=60) as http:
        for prompt in ("the quick fox the", words + words[1:], [BOS, *words[1:], BOS]):
            for stream in (False, True):
                body = dict(model="sp", prompt=prompt, max_tokens=3, temperature=0, logprobs=1,
                            echo=True, allowed_token_ids=words[1:], stream=stream)
                if not stream:
                    choice = http.post("/v1/completions", json=body).json()["choices"][0]
                    lps, text = choice["logprobs"], choice["text"]
                else:
                    with http.stream("POST", "/v1/completions", json=body) as r:
                        chunks = [json.loads(line[6:])["choices"][0] for line in r.iter_lines()
                                  if line.startswith("data: {")]
                    text = "".join(c["text"] for c in chunks)
                    lps = {key: sum((c["logprobs"][key] for c in chunks if c["logprobs"]), [])
                           for key in ("tokens", "text_offset")}
                    assert lps == {key: whole[key] for key in lps}
                whole = lps
                at_offsets = [text[at:at + len(t)] for at, t in zip(lps["text_offset"],
                                                                     lps["tokens"])]
                shown = [t for t, got in zip(lps["tokens"], at_offsets) if t == got]
                assert "".join(shown) == text, (prompt, lps["tokens"], text)
                if isinstance(prompt, str):  # only the added BOS is left out
                    assert lps["tokens"][0] == "<s>" and len(shown) == len(lps["tokens"]) - 1
                    assert lps["text_offset"][:2] == [0, 0]
                else:
                    assert shown == lps["tokens"]


def test_chat_template_options_shape_the_prompt(served):
    """vLLM's add_generation_prompt, continue_final_message and chat_template_kwargs reach
    the template (chat and /tokenize alike); fields the server cannot honour are 400s."""
    messages = [{"role": "user", "content": "w5 w6"}, {"role": "assistant", "content": "w7"}]
    options = {"add_generation_prompt": False, "continue_final_message": True}
    want = served.tok.apply_chat_template(messages, tokenize=True, **options)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    plain = served.tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    assert len(want) < len(list(plain["input_ids"] if hasattr(plain, "keys") else plain))
    got = served.http.post("/tokenize", json={"messages": messages, **options,
                                              "chat_template_kwargs": {"unused": 1}}).json()
    assert got["tokens"] == want
    r = served.http.post("/v1/chat/completions", json={
        "model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0, **options})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(want)
    with torch.no_grad():
        out = served.model.generate(torch.tensor([want]), max_new_tokens=4, do_sample=False,
                                    pad_token_id=0)
    assert r.json()["choices"][0]["message"]["content"] == \
        served.tok.decode(out[0, len(want):].tolist(), skip_special_tokens=True)
    answer = r.json()["choices"][0]["message"]["content"]
    body = {"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0,
            "echo": True, **options}  # vLLM's: the answer goes on from the last message
    echoed = served.http.post("/v1/chat/completions", json=body).json()
    assert echoed["choices"][0]["message"]["content"] == "w7" + answer
    chunks = [json.loads(line[6:]) for line in served.http.post(
        "/v1/chat/completions", json={**body, "stream": True}).text.splitlines()
        if line.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                   if c["choices"]) == "w7" + answer
    for extra, param in [({"chat_template": "{{ messages }}"}, "chat_template"),
                         ({"continue_final_message": True}, "continue_final_message"),
                         ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs")]:
        for path in ("/v1/chat/completions", "/tokenize"):
            r = served.http.post(path, json={"model": "tiny", "messages": messages, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, r.text)


def test_version_and_the_models_context(served):
    """/version and the models' max_model_len answer as vLLM's do."""
    import hf_paged

    assert served.http.get("/version").json() == {"version": hf_paged.__version__}
    models = served.http.get("/v1/models").json()["data"]
    assert [m["max_model_len"] for m in models] == [512]
    assert served.http.get("/v1/models/tiny").json()["max_model_len"] == 512


def test_flags_are_never_abbreviated_and_vllms_switches_are_taken():
    from hf_paged.serving.serve import engine_options, parser

    with pytest.raises(SystemExit):  # (it was --swap-space-bytes 4)
        parser().parse_args(["m", "--swap-space", "4"])
    args = parser().parse_args(["m", "--enable-prefix-caching", "--enable-auto-tool-choice"])
    assert not args.no_prefix_caching
    with pytest.raises(SystemExit):
        parser().parse_args(["m", "--enable-prefix-caching", "--no-prefix-caching"])
    assert engine_options(parser().parse_args(["m", "--seed", "7"]))["seed"] == 7


def check_ranked(served, ids, entries, k):
    """vLLM's prompt_logprobs: first null, then the k best tokens ranked 1..k and the
    prompt's own token, each with its log-probability and text."""
    lp = stock_logprobs(served.model, ids)
    assert len(entries) == len(ids) and entries[0] is None
    for p in range(1, len(ids)):
        entry = {int(t): v for t, v in entries[p].items()}
        best = lp[p - 1].topk(k)
        ranked = sorted((v["rank"], t) for t, v in entry.items() if v["rank"] is not None)
        assert [r for r, _ in ranked] == list(range(1, k + 1))
        assert [t for _, t in ranked] == best.indices.tolist()
        for t, v in entry.items():
            assert math.isclose(v["logprob"], lp[p - 1, t].item(), abs_tol=1e-4), (p, t)
            assert v["decoded_token"] == served.tok.decode([t])
        assert ids[p] in entry and len(entry) in (k, k + 1)


def test_vllm_prompt_logprobs_field(served):
    """vLLM's `prompt_logprobs` request field (it was ignored): per choice on completions
    (beside echo's own logprobs, of another count), at the top of a chat response; refused
    with a stream or out of range, by name."""
    prompt = "w5 w6 w7 w8 w9"
    ids = served.tok(prompt)["input_ids"]
    r = served.http.post("/v1/completions", json=dict(
        model="tiny", prompt=prompt, max_tokens=2, prompt_logprobs=2, echo=True, logprobs=4))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    check_ranked(served, ids, choice["prompt_logprobs"], 2)
    check_prompt_part(served, ids, choice["logprobs"], 4)
    messages = [{"role": "user", "content": "w20 w21"}]
    r = served.http.post("/v1/chat/completions", json=dict(
        model="tiny", messages=messages, max_tokens=2, prompt_logprobs=3))
    assert r.status_code == 200, r.text
    chat_ids = served.tok.apply_chat_template(messages, add_generation_prompt=True,
                                              tokenize=True)
    chat_ids = list(chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids)
    check_ranked(served, chat_ids, r.json()["prompt_logprobs"], 3)
    plain = served.http.post("/v1/completions", json=dict(model="tiny", prompt=prompt,
                                                          max_tokens=2)).json()
    assert "prompt_logprobs" not in plain["choices"][0]
    for bad in (dict(prompt_logprobs=2, stream=True), dict(prompt_logprobs=21),
                dict(prompt_logprobs=-1)):
        r = served.http.post("/v1/completions", json=dict(model="tiny", prompt=prompt, **bad))
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text


def test_echo_top_logprobs_hold_the_requests_count_beside_prompt_logprobs(served):
    """With vLLM's prompt_logprobs above `logprobs`, the echoed prompt's top_logprobs held
    prompt_logprobs' count (the engine keeps the larger one for both)."""
    body = dict(model="tiny", prompt="w5 w9 w14 w3", echo=True, max_tokens=0)
    for logprobs, prompt_logprobs in ((0, 3), (1, 5), (2, 2)):
        r = served.http.post("/v1/completions", json=dict(
            body, logprobs=logprobs, prompt_logprobs=prompt_logprobs)).json()
        choice = r["choices"][0]
        tops = choice["logprobs"]["top_logprobs"]
        assert tops[0] is None and all(1 <= len(top) <= logprobs + 1 for top in tops[1:])
        assert all(len(top) == logprobs or tokens in top for top, tokens in
                   zip(tops[1:], choice["logprobs"]["tokens"][1:]))
        assert all(len([e for e in entry.values() if e["rank"] is not None]) == prompt_logprobs
                   for entry in choice["prompt_logprobs"][1:])


def _sp_server():
    from conftest import make_byte_fallback_tokenizer

    tok = make_byte_fallback_tokenizer()
    model = make_model("llama_gqa", vocab_size=len(tok))
    return tok, ServerThread(build_app(model, tok, served_model_name="sp", block_size=4,
                                       num_blocks=64))


@pytest.mark.parametrize("kind", ["sentencepiece", "word-level"])
def test_logprob_tokens_add_up_to_the_text_and_offsets_point_into_it(served, kind):
    """A SentencePiece word's token decoded alone loses its leading space (a word-level one
    its separator), so `tokens` did not add up to the text and each `text_offset` drifted
    from where its token starts. Streamed or not, echoed or not, they now do; chat's tokens
    add up to its content too."""
    import contextlib

    with contextlib.ExitStack() as stack:
        if kind == "sentencepiece":
            tok, server = _sp_server()
            url, name = stack.enter_context(server).url, "sp"
            words = tok.convert_tokens_to_ids(["▁the", "▁quick", "▁fox", "b", "c"])
            prompt, headers = "the quick fox the", {}
        else:
            url, name, words = served.url, "tiny", [8, 9, 10, 11, 12, 13]
            prompt, headers = "w5 w9 w14 w3", {"Authorization": f"Bearer {KEY}"}
        http = stack.enter_context(httpx.Client(base_url=url, headers=headers, timeout=60))
        body = dict(model=name, prompt=prompt, max_tokens=6, temperature=0, logprobs=2,
                    allowed_token_ids=words)
        for echo in (False, True):
            choice = http.post("/v1/completions", json=dict(body, echo=echo)).json()[
                "choices"][0]
            lps, text = choice["logprobs"], choice["text"]
            assert "".join(lps["tokens"]) == text
            assert [text[at:at + len(t)] for at, t in zip(lps["text_offset"], lps["tokens"])] \
                == lps["tokens"]
            assert all(tops is None or t in tops for t, tops in zip(lps["tokens"],
                                                                     lps["top_logprobs"]))
            events = []
            with http.stream("POST", "/v1/completions",
                             json=dict(body, echo=echo, stream=True)) as r:
                events = [json.loads(line[6:]) for line in r.iter_lines()
                          if line.startswith("data: {")]
            streamed = [e["choices"][0]["logprobs"] for e in events
                        if e["choices"] and e["choices"][0]["logprobs"]]
            assert sum([s["tokens"] for s in streamed], []) == lps["tokens"]
            assert sum([s["text_offset"] for s in streamed], []) == lps["text_offset"]
    if kind == "word-level":
        chat = served.http.post("/v1/chat/completions", json=dict(
            model="tiny", messages=[{"role": "user", "content": "w5 w9"}], max_tokens=6,
            temperature=0, logprobs=True, top_logprobs=2, allowed_token_ids=words)).json()
        message, content = chat["choices"][0]["message"], chat["choices"][0]["logprobs"]
        assert "".join(c["token"] for c in content["content"]) == message["content"]
        assert all(bytes(c["bytes"]).decode() == c["token"] for c in content["content"])
