"""`hf-paged run-batch`: a file of OpenAI batch requests run through the server's endpoints
in-process. Good lines equal stock greedy `generate`, bad lines become error lines in their
place, output keeps input order, and the CLI exits 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_paged.server import build_app
from hf_paged.serving import batch, cli
from conftest import make_model, make_tokenizer
from test_server import tokenizer_with_template

PROMPTS = ["w5 w6 w7 w8 w9", "w10 w11", "w40 w41 w42 w43", "w20 w20 w21"]
CHATS = [[{"role": "user", "content": "w5 w6"}],
         [{"role": "system", "content": "w10 w11"}, {"role": "user", "content": "w30 w31 w32"}]]


@pytest.fixture(scope="module")
def llama_and_tok():
    return make_model("llama_gqa"), tokenizer_with_template()


def stock(model, tok, ids: list[int], max_tokens: int) -> str:
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                         pad_token_id=0)
    return tok.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)


def batch_file(model_name: str):
    """(input lines, what each output line must be): ("ok", expected text) for a good
    line, ("error", error code, HTTP status or None) for a bad one."""
    lines, expect = [], []

    def request(custom_id, url, body, *want):
        lines.append(json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                                 "body": body}))
        expect.append((custom_id, *want))

    for i, prompt in enumerate(PROMPTS):
        request(f"cmpl-{i}", "/v1/completions", {"model": model_name, "prompt": prompt,
                                                 "max_tokens": 4 + 2 * i, "temperature": 0},
                "ok", ("completion", prompt, 4 + 2 * i))
        if i == 1:
            lines.append("")  # blank lines are skipped: no output line
            lines.append("{not json")
            expect.append((None, "error", "invalid_json_line", None))
            # JSON that Python's parser refuses with other errors: too deep, an int too long
            lines.append("[" * 100_000 + "]" * 100_000)
            lines.append('{"custom_id": "big", "url": "/v1/completions", "body": '
                         '{"max_tokens": ' + "9" * 5000 + "}}")
            expect += [(None, "error", "invalid_json_line", None)] * 2
            # A lone surrogate (valid JSON) in a custom_id: the output line still encodes.
            request("lone-\ud800", "/v1/completions", {"model": model_name, "prompt": prompt,
                                                        "max_tokens": 3, "temperature": 0},
                    "ok", ("completion", prompt, 3))
    for i, messages in enumerate(CHATS):
        request(f"chat-{i}", "/v1/chat/completions",
                {"model": model_name, "messages": messages, "max_tokens": 6, "temperature": 0},
                "ok", ("chat", messages, 6))
    lines.append(json.dumps({"method": "POST", "url": "/v1/completions",
                             "body": {"model": model_name, "prompt": "w5"}}))
    expect.append((None, "error", "missing_custom_id", None))
    request("bad-url", "/v1/embeddings", {"model": model_name, "input": "w5"},
            "error", "invalid_url", None)
    request("bad-temperature", "/v1/completions",
            {"model": model_name, "prompt": "w5", "temperature": 5}, "error",
            "invalid_request_error", 400)
    request("stream", "/v1/chat/completions",
            {"model": model_name, "messages": CHATS[0], "stream": True}, "error",
            "stream_not_supported", None)
    # The server's booleans are lax: "false" is false there, so the line runs.
    request("stream-false", "/v1/chat/completions",
            {"model": model_name, "messages": CHATS[0], "stream": "false", "max_tokens": 6,
             "temperature": 0}, "ok", ("chat", CHATS[0], 6))
    request("stream-yes", "/v1/completions",
            {"model": model_name, "prompt": "w5", "stream": "yes"}, "error",
            "stream_not_supported", None)
    # A lone surrogate in a prompt: the server's 400 naming the field, as over HTTP.
    request("lone-prompt", "/v1/completions", {"model": model_name, "prompt": "w5 \ud800"},
            "error", "invalid_request_error", 400)
    request("unknown-model", "/v1/completions", {"model": "nobody", "prompt": "w5"},
            "error", "model_not_found", 404)
    request("last", "/v1/completions", {"model": model_name, "prompt": PROMPTS[0],
                                        "max_tokens": 3, "temperature": 0},
            "ok", ("completion", PROMPTS[0], 3))
    return lines, expect


def check(records: list[dict], expect, model, tok) -> None:
    assert len(records) == len(expect)
    assert len({r["id"] for r in records}) == len(records)
    for record, (custom_id, kind, *want) in zip(records, expect):
        assert record["custom_id"] == custom_id and record["id"].startswith("batch_req_")
        if kind == "ok":
            assert record["error"] is None, record
            response = record["response"]
            assert response["status_code"] == 200
            body = response["body"]
            assert response["request_id"] == body["id"]
            api, prompt, max_tokens = want[0]
            if api == "completion":
                text = body["choices"][0]["text"]
                ids = tok(prompt)["input_ids"]
            else:
                text = body["choices"][0]["message"]["content"]
                ids = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
                ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            assert text == stock(model, tok, ids, max_tokens), custom_id
            assert body["usage"]["prompt_tokens"] == len(ids)
        else:
            code, status = want
            assert record["error"]["code"] == code, record
            assert record["error"]["message"]
            if status is None:
                assert record["response"] is None
            else:
                assert record["response"]["status_code"] == status
                assert record["response"]["body"]["error"]["message"] == \
                    record["error"]["message"]


def test_run_batch_in_process(llama_and_tok):
    model, tok = llama_and_tok
    lines, expect = batch_file("tiny")
    app = build_app(model, tok, served_model_name="tiny", block_size=4, num_blocks=200,
                    max_num_seqs=3, max_num_batched_tokens=16)
    written = []
    # Fewer slots than lines: lines wait for a slot, and finish out of order.
    assert batch.run_batch(app, lines, max_concurrency=4, write=written.append) == []
    check(written, expect, model, tok)
    assert not app.state.server.llm.is_alive  # the app's lifespan shut its engine down
    app = build_app(model, tok, served_model_name="tiny", block_size=4, num_blocks=200)
    check(batch.run_batch(app, lines), expect, model, tok)


def test_cli_run_batch(llama_and_tok, tmp_path):
    """`python -m hf_paged.serving.cli run-batch -i IN -o OUT FOLDER`: the model is asked
    for by its folder (the default served name); the run exits 0 despite the bad lines."""
    model, tok = llama_and_tok
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    lines, expect = batch_file(str(folder))
    # (a byte-order mark, as some editors save files, is not part of line 1; a line that is
    # not UTF-8 is an error line of its own)
    bad = b'{"custom_id": "latin-1", "url": "/v1/completions", "body": {"prompt": "caf\xe9"}}'
    (tmp_path / "in.jsonl").write_bytes(("\ufeff" + "\n".join(lines) + "\n").encode()
                                        + bad + b"\n")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    done = subprocess.run(
        [sys.executable, "-m", "hf_paged.serving.cli", "run-batch", "-i",
         str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), str(folder),
         "--block-size", "4", "--num-blocks", "200", "--max-num-seqs", "4",
         "--max-concurrency", "5"],
        env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "run-batch: 100%" in done.stderr  # the progress bar
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    check(records[:-1], expect, model, tok)
    assert records[-1]["custom_id"] == "latin-1" and records[-1]["response"] is None
    at = bad.index(b"\xe9") + 1  # (every character before it is ASCII)
    assert records[-1]["error"] == {"code": "invalid_json_line", "message": f"line "
                                    f"{len(lines) + 1}: not UTF-8 text (byte 0xe9 at character "
                                    f"{at})."}


def test_cli_help_and_server_only_options(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["run-batch", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert "--input-file" in text and "--max-concurrency" in text and "--lora" in text
    assert "--port" not in text and "--api-key" not in text
    with pytest.raises(SystemExit) as exit_:
        batch.main(["-i", "in.jsonl", "-o", "out.jsonl", "model", "--port", "9000"])
    assert exit_.value.code == 2
    assert "--port is an option of hf-paged serve" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "run-batch -i REQUESTS.jsonl" in capsys.readouterr().out


def test_a_request_that_fails_while_running_or_cannot_be_sent_is_an_error_line():
    """A 200 whose body has an error (finish_reason "error") keeps its response and gets the
    error; a transport failure is an error line without a response."""
    import asyncio

    import httpx

    class Client:
        async def post(self, url, content, headers):
            if json.loads(content)["prompt"] == "boom":
                raise RuntimeError("no route")
            return httpx.Response(200, json={
                "id": "cmpl-1", "choices": [{"text": "", "finish_reason": "error"}],
                "error": {"message": "the engine step failed", "type": "server_error",
                          "param": None, "code": None}})

    def line(prompt):
        return json.dumps({"custom_id": prompt, "method": "POST", "url": "/v1/completions",
                           "body": {"model": "m", "prompt": prompt}})

    failed = asyncio.run(batch._send(Client(), 1, line("w5")))
    assert failed["response"]["status_code"] == 200
    assert failed["response"]["request_id"] == "cmpl-1"
    assert failed["error"] == {"code": "server_error", "message": "the engine step failed"}
    lost = asyncio.run(batch._send(Client(), 2, line("boom")))
    assert lost["custom_id"] == "boom" and lost["response"] is None
    assert lost["error"] == {"code": "internal_error", "message": "RuntimeError: no route"}


@pytest.mark.parametrize("option, value", [
    ("--max-request-bytes", "-1"), ("--max-waiting-requests", "0"), ("--request-timeout", "0"),
    ("--request-timeout", "nan"), ("--max-stop-strings", "-1"), ("--shutdown-grace", "-1"),
    ("--block-size", "0"), ("--num-blocks", "-1"), ("--max-num-seqs", "0"),
    ("--gpu-memory-utilization", "1.5"), ("--swap-space-bytes", "-1"), ("--max-num-seqs", "x"),
])
def test_a_bad_limit_or_size_is_refused_by_name_before_the_model_loads(capsys, option, value):
    """(A server with such a limit would refuse every request: /health itself got 413.)"""
    with pytest.raises(SystemExit) as exit_:
        batch.main(["-i", "in.jsonl", "-o", "out.jsonl", "/no/such/model", option, value])
    assert exit_.value.code == 2
    assert f"argument {option}: expected " in capsys.readouterr().err


def test_server_limits_no_request_could_meet_are_refused():
    from hf_paged.server import ServerLimits

    for bad in (dict(max_request_bytes=0), dict(max_waiting_sequences=-1),
                dict(request_timeout=0), dict(shutdown_grace=float("inf")),
                dict(max_stop_chars=-1)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ServerLimits(**bad)


def test_a_broken_tokenizer_is_an_error_and_a_missing_one_a_warning(tmp_path, caplog):
    from hf_paged.engine.llm import load_model

    make_model("llama_gqa").save_pretrained(tmp_path)
    with caplog.at_level("WARNING", logger="hf_paged"):
        assert load_model(tmp_path)[1] is None
    assert "has no tokenizer" in caplog.text
    make_tokenizer().save_pretrained(tmp_path)
    assert load_model(tmp_path)[1] is not None
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(ValueError, match="tokenizer in .* could not be loaded"):
        load_model(tmp_path)


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli_model")
    make_model("llama_gqa").save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("case", ["no model folder", "device", "device map", "empty device map",
                                  "input file", "output folder", "output is a folder"])
def test_bad_paths_and_devices_are_one_line_errors_before_the_model_loads(
        tmp_path, capsys, case):
    (tmp_path / "in.jsonl").write_text("")
    args = {"no model folder": [str(tmp_path / "none")],
            "device": ["m", "--device", "gpu0"],
            "device map": ["m", "--device-map", '{"model": "gpu9"}'],
            "empty device map": ["m", "--device-map", "{}"],
            "input file": ["-i", str(tmp_path / "missing.jsonl"), "m"],
            "output folder": ["-o", str(tmp_path / "none" / "out.jsonl"), "m"],
            "output is a folder": ["-o", str(tmp_path), "m"]}[case]
    defaults = {"-i": str(tmp_path / "in.jsonl"), "-o": str(tmp_path / "out.jsonl")}
    argv = [a for k, v in defaults.items() if k not in args for a in (k, v)] + args
    with pytest.raises(SystemExit) as exit_:
        batch.main(argv)
    err = capsys.readouterr().err
    if case == "no model folder":
        assert exit_.value.code == f"hf-paged: no model folder at {args[0]!r}."
    else:
        assert exit_.value.code == 2
        assert err.strip().splitlines()[-1].startswith("hf-paged run-batch: error: ")
        assert {"device": "--device", "device map": "module 'model'", "empty device map":
                "non-empty JSON object", "input file": "missing.jsonl: No such file",
                "output folder": "cannot write", "output is a folder": "cannot write"}[case] \
            in err
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("case", ["adapter", "budget", "model", "draft"])
def test_what_cannot_load_or_serve_ends_with_one_line(tmp_path, model_folder, case):
    """An adapter folder that holds none, a KV budget under one block, a model the engine
    cannot serve: the reason, not a traceback."""
    (tmp_path / "in.jsonl").write_text("")
    folder, extra = model_folder, []
    if case == "adapter":
        extra = ["--lora", f"a={tmp_path}"]
    elif case == "budget":
        extra = ["--kv-cache-bytes", "10"]
    elif case == "draft":
        extra = ["--speculative-config", json.dumps({
            "method": "draft_model", "model": str(tmp_path / "none"), "num_speculative_tokens": 2})]
    else:
        from transformers import MambaConfig, MambaForCausalLM

        folder = tmp_path / "mamba"
        MambaForCausalLM(MambaConfig(hidden_size=16, num_hidden_layers=1, vocab_size=300,
                                     state_size=4)).save_pretrained(folder)
    with pytest.raises(SystemExit) as exit_:
        batch.main(["-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"),
                    "--no-progress", str(folder), *extra])
    message = exit_.value.code
    assert isinstance(message, str) and message.startswith("hf-paged: ") and "\n" not in message
    assert {"adapter": "cannot load --lora a=", "budget": "smaller than one KV block",
            "model": "cannot serve this model", "draft": "OSError: "}[case] in message
