"""`hf-paged run-batch -i requests.jsonl -o results.jsonl MODEL [options]`: runs a file of
OpenAI API requests offline, through the server's own endpoints, the way `vllm run-batch`
does (OpenAI's Batch API file format).

Input, one JSON object per line (blank lines are skipped):

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "MODEL", "messages": [{"role": "user", "content": "Hi"}]}}

`url` is /v1/completions or /v1/chat/completions; `body` is that endpoint's request, its
`model` the served name (MODEL, or --served-model-name) or a --lora adapter's name.

Output, one JSON object per input line, in input order (OpenAI's batch output lines):

    {"id": "batch_req_<hex>", "custom_id": "q1",
     "response": {"status_code": 200, "request_id": "chatcmpl-<hex>", "body": {...}},
     "error": null}

A request the server rejects keeps its response (the status code, the error body) and also
gets `"error": {"code": ..., "message": ...}`; a line that cannot be sent (not JSON, no
custom_id, another method or url, a streaming body) gets `"response": null` and the error.
A request that fails while running (a 200 whose body has an `error`, finish_reason
"error") gets the error too. No line ends the run: it exits 0 once every line has its output
line (1 if the engine itself died).

The lines are sent concurrently (at most --max-concurrency at once) to the app that
`build_app` makes, in-process over httpx's ASGI transport (no socket), so the engine
batches them exactly as it batches a server's clients, and validation, chat templates,
limits and response bodies are the server's own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import uuid
from typing import Callable, Iterable

import torch

from ..distributed.tensor_parallel import world_size
from . import serve

URLS = ("/v1/completions", "/v1/chat/completions")
DEFAULT_MAX_CONCURRENCY = 256
# `hf-paged serve` options that only make sense for a listening server: hidden from
# run-batch's help, and refused if given.
SERVER_ONLY = ("host", "port", "api_key", "salt_by_api_key", "metrics_without_auth",
               "max_waiting_requests", "max_unread_outputs", "shutdown_grace", "log_level",
               "enable_runtime_lora")


class LineError(Exception):
    """A line that cannot be sent: its output line's `error` (code, message)."""

    def __init__(self, code: str, message: str, custom_id=None):
        super().__init__(message)
        self.code, self.custom_id = code, custom_id


def _record(custom_id, response: dict | None, error: dict | None) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": response, "error": error}


def _parse(number: int, line: str) -> tuple[str, str, dict]:
    """(custom_id, url, body) of an input line; LineError if it cannot be sent."""
    try:
        item = json.loads(line)
    except (ValueError, RecursionError) as err:  # (nested too deeply, an int too long, ...)
        raise LineError("invalid_json_line", f"line {number}: not JSON ({err}).") from None
    if not isinstance(item, dict):
        raise LineError("invalid_json_line", f"line {number}: expected a JSON object.")
    custom_id = item.get("custom_id")
    try:
        line.encode("utf-8")
    except UnicodeEncodeError as err:  # (bytes `_read` kept as lone surrogates)
        byte = ord(line[err.start]) - 0xDC00
        raise LineError("invalid_json_line", f"line {number}: not UTF-8 text (byte "
                        f"{byte:#04x} at character {err.start + 1}).",
                        custom_id if isinstance(custom_id, str) else None) from None
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError("missing_custom_id",
                        f"line {number}: custom_id must be a non-empty string.")
    method, url, body = item.get("method", "POST"), item.get("url"), item.get("body")
    if method != "POST":
        problem = ("invalid_method", f"method must be POST; got {method!r}.")
    elif url not in URLS:
        problem = ("invalid_url", f"url must be one of {list(URLS)}; got {url!r}.")
    elif not isinstance(body, dict):
        problem = ("invalid_body", "body must be a JSON object.")
    elif _streams(body.get("stream")):
        # The output line holds one response body; a stream of events has no place in it.
        problem = ("stream_not_supported", "a batch cannot stream; leave out \"stream\" "
                   "(or set it to false).")
    else:
        return custom_id, url, body
    raise LineError(problem[0], f"line {number}: {problem[1]}", custom_id)


def _streams(value) -> bool:
    """Whether the server would take `value` of "stream" as true (its lax booleans take
    "false" and 0 for false as well); a value it refuses is its 400 to give."""
    from pydantic import TypeAdapter, ValidationError

    try:
        return TypeAdapter(bool).validate_python(value)
    except ValidationError:
        return False


def output_line(record: dict) -> str:
    """A record as a line of UTF-8 JSON (a lone surrogate, which a line's JSON may hold in
    its custom_id, has no UTF-8: that line escapes its non-ASCII characters instead)."""
    text = json.dumps(record, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(record)
    return text + "\n"


async def _send(client, number: int, line: str) -> dict:
    """The output line of input line `number` (1-based)."""
    try:
        custom_id, url, body = _parse(number, line)
    except LineError as err:
        return _record(err.custom_id, None, {"code": err.code, "message": str(err)})
    try:
        # (json.dumps escapes a lone surrogate, which the server then refuses by name;
        # httpx's own encoding fails on it)
        reply = await client.post(url, content=json.dumps(body),
                                  headers={"content-type": "application/json"})
    except Exception as err:  # noqa: BLE001 (one line's failure never ends the run)
        return _record(custom_id, None, {"code": "internal_error",
                                         "message": f"{type(err).__name__}: {err}"})
    try:
        answer = reply.json()
    except ValueError:
        answer = {"error": {"message": reply.text, "type": "server_error", "code": None}}
    answer = answer if isinstance(answer, dict) else {"result": answer}
    ok = reply.status_code < 400
    response = {"status_code": reply.status_code,
                "request_id": (ok and answer.get("id")) or f"req-{uuid.uuid4().hex}",
                "body": answer}
    err = answer.get("error")
    if ok and err is None:
        return _record(custom_id, response, None)
    # A 200 with an error: the request failed while running (finish_reason "error").
    err = err if isinstance(err, dict) else {}
    code = err.get("code") or err.get("type") or f"http_{reply.status_code}"
    return _record(custom_id, response, {"code": str(code),
                                         "message": str(err.get("message") or reply.text)})


async def arun_batch(app, lines: Iterable[str], *, write: Callable[[dict], None] | None = None,
                     max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
                     progress: bool = False) -> list[dict]:
    """Runs the batch input `lines` (JSON strings, the input file's lines) through `app`
    (a `build_app` app, whose lifespan this runs: an engine the app owns is shut down at
    the end). Returns one output record (a dict, see the module doc) per non-blank line,
    in input order. With `write`, each record is handed to it instead, in input order, as
    soon as it and every line before it are done (the list returned is then empty, so a
    large file is not held in memory). `progress`: a tqdm bar of finished lines."""
    from tqdm.auto import tqdm

    if max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1; got {max_concurrency}.")
    records: list[dict] = []
    write = write or records.append
    total = sum(1 for line in lines if line.strip()) if isinstance(lines, (list, tuple)) \
        else None
    bar = tqdm(total=total, unit="line", desc="run-batch", disable=not progress,
               file=sys.stderr)
    try:
        await _run(app, lines, max_concurrency, bar, write)
    finally:
        bar.close()
    return records


async def _run(app, lines: Iterable[str], max_concurrency: int, bar, write) -> None:
    import httpx

    done: dict[int, dict] = {}  # finished records waiting for an earlier line
    next_out = 0
    slots = asyncio.Semaphore(max_concurrency)

    async def one(index: int, number: int, line: str) -> None:
        nonlocal next_out
        try:
            done[index] = await _send(client, number, line)
        except Exception as err:  # noqa: BLE001 (a line's failure never ends the run)
            done[index] = _record(None, None, {"code": "internal_error",
                                               "message": f"{type(err).__name__}: {err}"})
        finally:
            slots.release()
        bar.update(1)
        while next_out in done:  # keep input order
            write(done.pop(next_out))
            next_out += 1

    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    tasks = set()
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=transport, base_url="http://batch",
                                     timeout=None) as client:
            index = 0
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                await slots.acquire()  # lines are read as slots free up, not all at once
                task = asyncio.create_task(one(index, number, line))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                index += 1
            while tasks:
                await asyncio.gather(*list(tasks))


def run_batch(app, lines: Iterable[str], **options) -> list[dict]:
    """`arun_batch` on a new event loop (from synchronous code; a notebook's running loop
    awaits `arun_batch` instead)."""
    return asyncio.run(arun_batch(app, lines, **options))


def parser() -> argparse.ArgumentParser:
    """`hf-paged serve`'s parser (model loading, LoRA, limits, engine) with the batch
    files added and the options of a listening server hidden."""
    p = serve.parser()
    p.prog = "hf-paged run-batch"
    p.description = ("Runs a file of OpenAI batch requests (JSONL) offline, through the "
                     "endpoints of hf-paged serve.")
    for action in p._actions:
        if action.dest in SERVER_ONLY:
            action.help = argparse.SUPPRESS
    b = p.add_argument_group("batch")
    b.add_argument("-i", "--input-file", required=True,
                   help="the requests, one JSON object per line ('-': standard input)")
    b.add_argument("-o", "--output-file", required=True,
                   help="the results, one JSON object per input line, in input order "
                        "('-': standard output)")
    b.add_argument("--max-concurrency", type=int, default=DEFAULT_MAX_CONCURRENCY,
                   help=f"lines in flight at once ({DEFAULT_MAX_CONCURRENCY})")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv=None) -> None:
    from ..engine.async_llm import AsyncLLM
    from .server import ServerLimits, build_app

    p = parser()
    args = p.parse_args(argv)
    for dest in SERVER_ONLY:
        if getattr(args, dest) != p.get_default(dest):
            p.error(f"--{dest.replace('_', '-')} is an option of hf-paged serve, not of "
                    "run-batch.")
    if args.max_concurrency < 1:
        p.error("--max-concurrency must be at least 1.")
    logging.basicConfig(level=logging.INFO)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    try:
        lines = _read(args.input_file)
    except OSError as err:
        p.error(f"cannot read the input file {args.input_file}: {err.strerror or err}")
    if args.output_file != "-" and not _writable(args.output_file):
        p.error(f"cannot write the output file {args.output_file}: its folder does not exist "
                "or is not writable, or it is a folder")
    model, tokenizer = serve.load(args)
    if world_size() > 1 and torch.distributed.get_rank() != 0:
        from ..engine import run_worker  # tensor parallelism: as under `hf-paged serve`

        run_worker(model, **serve.engine_options(args))
        torch.distributed.destroy_process_group()
        return
    # The concurrency bound is what limits the queue: the server's bound on waiting
    # sequences would only turn lines away with 503s.
    limits = ServerLimits(max_waiting_sequences=sys.maxsize,
                          max_request_bytes=args.max_request_bytes,
                          max_stop_strings=args.max_stop_strings,
                          max_stop_chars=args.max_stop_chars,
                          request_timeout=args.request_timeout)
    # The engine is ours, not the app's, to ask after the run whether it is still alive.
    with serve.refused_settings():
        llm = AsyncLLM(model, tokenizer, **serve.engine_options(args))
    app = build_app(llm=llm, served_model_name=args.served_model_name or args.model,
                    limits=limits, tool_call_parser=args.tool_call_parser)
    out = sys.stdout if args.output_file == "-" else open(args.output_file, "w",
                                                          encoding="utf-8")
    try:
        run_batch(app, lines, max_concurrency=args.max_concurrency,
                  progress=not args.no_progress,
                  write=lambda record: out.write(output_line(record)))
        alive = llm.is_alive
    finally:
        llm.shutdown()
        if out is not sys.stdout:
            out.close()
        if world_size() > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    if not alive:
        raise SystemExit("hf-paged run-batch: the engine died during the run (see the log); "
                         "the lines it had not finished have error lines.")


def _writable(path: str) -> bool:
    """Whether `path` can be written (checked before the model loads, which takes long)."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(folder):
        return False
    return os.access(path if os.path.exists(path) else folder, os.W_OK)


def _read(path: str) -> list[str]:
    # Lines end at b"\n" only (not str.splitlines's U+2028 and kin, which JSON strings may
    # hold raw). Bytes that are not UTF-8 stay as lone surrogates: that line's error alone.
    if path == "-":
        lines = [raw.decode("utf-8", "surrogateescape") for raw in sys.stdin.buffer]
    else:
        with open(path, "rb") as f:
            lines = [raw.decode("utf-8", "surrogateescape") for raw in f]
    if lines and lines[0].startswith("\ufeff"):  # (a byte-order mark is not line 1's)
        lines[0] = lines[0][1:]
    return lines


if __name__ == "__main__":
    main()
