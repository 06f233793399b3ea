"""`hf-paged serve MODEL_DIR_OR_ID [options]`, also `python -m hf_paged.serve MODEL ...`:
loads a model (and LoRA adapters, unmerged) and serves the OpenAI API on it with uvicorn.

Under `torchrun --nproc-per-node N -m hf_paged.serve MODEL ...` the model is split over the
N ranks by Transformers' tensor parallelism: rank 0 serves HTTP and schedules, every rank
runs the forwards. `--device-map auto` instead spreads the layers of one process's model
over the visible devices (the KV cache follows the layers)."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import signal
import sys

import torch

from ..config import KV_CACHE_DTYPES
from ..distributed.tensor_parallel import world_size
from ..errors import HFPagedError


def parser() -> argparse.ArgumentParser:
    # No abbreviations: vLLM's --swap-space would be taken for --swap-space-bytes.
    p = argparse.ArgumentParser(prog="hf-paged serve", description=__doc__.split("\n")[0],
                                allow_abbrev=False)
    p.add_argument("model", help="a local model folder (or a Hub id, where the Hub is reachable)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    p.add_argument("--port", type=_ranged(int, 0, 65535), default=8000, help="port (8000)")
    p.add_argument("--dtype", default="auto",
                   choices=["auto", "float32", "bfloat16", "float16"],
                   help="model dtype (auto: as saved)")
    p.add_argument("--device", default=None, type=_device,
                   help="cpu, cuda, cuda:1, ... (default: as loaded)")
    p.add_argument("--device-map", default=None, type=_device_map,
                   help="spread the layers over devices: auto, balanced, sequential, or a JSON "
                        "object of module name -> device (the KV cache follows the layers)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients ask for (default: the model argument)")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=ADAPTER_DIR",
                   help="serve a PEFT LoRA adapter, unmerged, as model NAME (repeatable)")
    p.add_argument("--tool-call-parser", default="auto",
                   choices=["auto", "hermes", "llama3_json", "mistral"],
                   help="the format of the model's tool calls (auto: from its chat template)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted as vLLM's: tool_choice \"auto\" is always served")
    s = p.add_argument_group("security and limits")
    s.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every path but /health; "
                        "repeatable, one tenant per key")
    s.add_argument("--salt-by-api-key", action=argparse.BooleanOptionalAction, default=True,
                   help="cache each key's prompts apart: tenants never share prefix-cache "
                        "blocks (on)")
    s.add_argument("--enable-runtime-lora", action="store_true",
                   help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter (clients "
                        "then name folders the server reads: off by default)")
    s.add_argument("--metrics-without-auth", action="store_true",
                   help="serve /metrics without a key (for a scraper inside the network)")
    s.add_argument("--max-waiting-requests", type=_ranged(int, 1), default=512,
                   help="waiting sequences (prompts x n) past which requests get 503 + "
                        "Retry-After (512)")
    s.add_argument("--max-request-bytes", type=_ranged(int, 1), default=4 * 2**20,
                   help="largest request body in bytes; larger ones get 413 (4 MiB)")
    s.add_argument("--max-stop-strings", type=_ranged(int, 0), default=64,
                   help="stop strings per request (64)")
    s.add_argument("--max-stop-chars", type=_ranged(int, 0), default=8192,
                   help="total characters of a request's stop strings (8192)")
    s.add_argument("--request-timeout", type=_ranged(float, 0, above=True), default=None,
                   help="seconds a request may take, queued or running; it then ends with "
                        "finish_reason 'timeout' (no limit)")
    s.add_argument("--max-unread-outputs", type=_ranged(int, 1), default=256,
                   help="outputs a stream buffers for its client (256); past it new ones "
                        "replace unread ones, and a client that reads none for 1 s has its "
                        "request aborted")
    s.add_argument("--shutdown-grace", type=_ranged(float, 0), default=10.0,
                   help="at SIGTERM, seconds open requests get before they end with an "
                        "error (10)")
    e = p.add_argument_group("engine")
    e.add_argument("--block-size", type=_ranged(int, 1), default=16,
                   help="tokens per KV block (16)")
    budget = e.add_mutually_exclusive_group()
    budget.add_argument("--num-blocks", type=_ranged(int, 1), default=None,
                        help="KV pool size in blocks")
    budget.add_argument("--kv-cache-bytes", type=_ranged(int, 1), default=None,
                        help="KV pool size in bytes")
    e.add_argument("--gpu-memory-utilization", type=_ranged(float, 0, 1, above=True), default=0.9,
                   help="on CUDA without a pool size: this fraction of free memory (0.9)")
    e.add_argument("--max-num-seqs", type=_ranged(int, 1), default=None,
                   help="sequences running at once (64 CPU, 256 CUDA)")
    e.add_argument("--max-num-batched-tokens", type=_ranged(int, 1), default=None,
                   help="tokens per step (2048 CPU, 8192 CUDA)")
    e.add_argument("--max-model-len", type=_ranged(int, 1), default=None,
                   help="longest sequence (the model's max_position_embeddings)")
    caching = e.add_mutually_exclusive_group()
    caching.add_argument("--no-prefix-caching", action="store_true",
                         help="turn prefix caching off")
    caching.add_argument("--enable-prefix-caching", action="store_true",
                         help="prefix caching on (the default, as in vLLM)")
    e.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"],
                   help="when blocks run out: recompute later, or swap to a CPU pool")
    e.add_argument("--admission-headroom", type=_ranged(float, 0), default=1.0,
                   help="free KV blocks kept per running sequence when admitting another "
                        "(1.0; 0 admits while a prompt's first chunk fits)")
    e.add_argument("--swap-space-bytes", type=_ranged(int, 0), default=None,
                   help="CPU pool for swap preemption (default: the size of the KV pool)")
    e.add_argument("--backend", default="auto", help="attention backend (auto)")
    e.add_argument("--compile", action="store_true",
                   help="run the model's forward under torch.compile (fullgraph)")
    e.add_argument("--cuda-graphs", dest="cuda_graphs", action="store_true", default=None,
                   help="replay decode steps from CUDA graphs (default: on with --compile on "
                        "a GPU)")
    e.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="never capture CUDA graphs")
    e.add_argument("--no-onednn-linear", dest="onednn_linear", action="store_false",
                   help="a float32 model on a CPU: run its linear layers as torch does (MKL) "
                        "rather than large ones through oneDNN")
    e.add_argument("--async-scheduling", action="store_true",
                   help="plan each step while the last one runs (its tokens stay on the "
                        "device; the same tokens, outputs a step later)")
    e.add_argument("--kv-cache-dtype", default="auto",
                   choices=KV_CACHE_DTYPES,
                   help="K/V blocks in the model's dtype (auto) or 8 bits with a scale per "
                        "token and head (about half the bytes: twice the blocks)")
    e.add_argument("--speculative-config", type=_json_object, default=None,
                   help='speculative decoding, as JSON: {"method": "ngram", '
                        '"num_speculative_tokens": 4} or {"method": "draft_model", '
                        '"model": DRAFT_DIR, "num_speculative_tokens": 4}')
    e.add_argument("--seed", type=int, default=None,
                   help="seed of the generator that requests without a seed of their own "
                        "sample from (none: unseeded)")
    p.add_argument("--log-level", default="info", help="uvicorn log level (info)")
    return p


def _ranged(kind, low, high=None, above: bool = False):
    """An argparse type: a finite `kind` (int or float) of at least `low` (more than `low`
    with `above`) and at most `high`, so that a bad value fails before the model loads."""
    what = "an integer" if kind is int else "a number"
    bounds = f"{'>' if above else '>='} {low}" + (f" and <= {high}" if high is not None else "")

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or value < low or (above and value == low) \
                or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {what} {bounds}; got {text!r}")
        return value
    return parse


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"expected a JSON object; got {text!r} ({err})")
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object; got {text!r}")
    return value


def _device(text: str) -> str:
    if not _is_device(text):
        raise argparse.ArgumentTypeError(
            f"expected a device such as cpu, cuda or cuda:1; got {text!r}")
    return text


def _device_map(text: str):
    if text in ("auto", "balanced", "balanced_low_0", "sequential"):
        return text
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict) or not value:
        raise argparse.ArgumentTypeError(
            "expected auto, balanced, balanced_low_0, sequential or a non-empty JSON object "
            f"of module name -> device; got {text!r}")
    for module, device in value.items():
        if isinstance(device, bool) or not (
                (isinstance(device, int) and device >= 0)
                or (isinstance(device, str) and (device == "disk" or _is_device(device)))):
            raise argparse.ArgumentTypeError(
                f"module {module!r} goes to {device!r}; expected a GPU index, a device such "
                "as cpu or cuda:1, or disk")
    return value


def _is_device(text: str) -> bool:
    try:
        torch.device(text)
    except (RuntimeError, ValueError):
        return False
    return True


def load(args):
    """The model to serve (with its adapters) and its tokenizer; under torchrun, this
    rank's share of a model split by tensor parallelism. A model or adapter that cannot be
    loaded ends the command with one line saying why."""
    from ..engine.llm import folder_missing, load_model

    if args.device_map is not None and (args.device is not None or world_size() > 1):
        raise SystemExit("--device-map spreads the model of one process over devices; it "
                         "cannot be combined with --device or with torchrun (tensor "
                         "parallelism).")
    if folder_missing(args.model):
        raise SystemExit(f"hf-paged: no model folder at {args.model!r}.")
    try:
        model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device,
                                      tensor_parallel=world_size() > 1,
                                      device_map=args.device_map)
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        where = "" if os.path.isdir(os.path.expanduser(args.model)) else \
            " (no such folder here; as a Hub id)"
        raise SystemExit(f"hf-paged: cannot load the model {args.model!r}{where}: "
                         f"{_first_line(err)}") from err
    for i, spec in enumerate(args.lora):
        name, _, folder = spec.partition("=")
        if not name or not folder:
            raise SystemExit(f"--lora takes NAME=ADAPTER_DIR; got {spec!r}.")
        from peft import PeftModel

        try:
            if i == 0:
                model = PeftModel.from_pretrained(model, folder, adapter_name=name)
            else:
                model.load_adapter(folder, adapter_name=name)
        except (OSError, ValueError, KeyError, RuntimeError) as err:
            raise SystemExit(f"hf-paged: cannot load --lora {spec}: {_first_line(err)}") \
                from err
    return model.eval(), tokenizer


@contextlib.contextmanager
def refused_settings():
    """The engine refusing the model or a setting (an unsupported architecture, a KV budget
    smaller than a block, a draft model that cannot be loaded, ...) ends the command with
    its one-line reason."""
    try:
        yield
    except (HFPagedError, ValueError, OSError) as err:
        raise SystemExit(f"hf-paged: {_first_line(err) if isinstance(err, OSError) else err}") \
            from err


def _first_line(err: BaseException) -> str:
    """An exception as one line: its type and its message's first line."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")


def engine_options(args) -> dict:
    return dict(block_size=args.block_size, num_blocks=args.num_blocks,
                kv_cache_bytes=args.kv_cache_bytes,
                gpu_memory_utilization=args.gpu_memory_utilization,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
                preemption_mode=args.preemption_mode, swap_space_bytes=args.swap_space_bytes,
                admission_headroom=args.admission_headroom,
                backend=args.backend, compile=args.compile,
                async_scheduling=args.async_scheduling,
                speculative_config=args.speculative_config,
                kv_cache_dtype=args.kv_cache_dtype, cuda_graphs=args.cuda_graphs,
                onednn_linear=args.onednn_linear, seed=args.seed)


def main(argv=None) -> None:
    from .server import ServerLimits, build_app

    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    model, tokenizer = load(args)
    if world_size() > 1 and torch.distributed.get_rank() != 0:
        # Tensor parallelism: rank 0 serves HTTP and schedules; this rank runs each step's
        # forward as rank 0 broadcasts it, until rank 0 stops. (torchrun takes the whole
        # group down, with the failed rank's error, if any rank dies.)
        from ..engine import run_worker

        run_worker(model, **engine_options(args))
        torch.distributed.destroy_process_group()
        return
    limits = ServerLimits(args.max_waiting_requests, args.max_request_bytes,
                          args.max_stop_strings, args.max_stop_chars, args.request_timeout,
                          args.shutdown_grace)
    with refused_settings():
        app = build_app(model, tokenizer, served_model_name=args.served_model_name or args.model,
                        api_key=args.api_key, limits=limits,
                        salt_by_api_key=args.salt_by_api_key,
                        metrics_without_auth=args.metrics_without_auth,
                        max_unread_outputs=args.max_unread_outputs,
                        tool_call_parser=args.tool_call_parser,
                        runtime_lora=args.enable_runtime_lora, **engine_options(args))
    # SIGINT/SIGTERM: uvicorn stops accepting; open requests get --shutdown-grace seconds,
    # then end with an error (streams: an error event and [DONE]). uvicorn then re-raises
    # the signal to the handler it found: exit 0, the shutdown was clean.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: sys.exit(0))
    try:
        _serve(app, app.state.server.begin_shutdown, host=args.host, port=args.port,
               log_level=args.log_level, timeout_graceful_shutdown=args.shutdown_grace + 5)
    finally:
        if world_size() > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _serve(app, on_exit, **config) -> None:
    """uvicorn, telling the app when a signal starts the shutdown (the app then ends its
    open requests properly instead of having them cut)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if not self.should_exit:
                on_exit()
            super().handle_exit(sig, frame)

    Server(uvicorn.Config(app, **config)).run()


if __name__ == "__main__":
    main()
