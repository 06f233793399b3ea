"""Replays a request trace against any OpenAI-compatible server, streaming, and reports
throughput and latency (the `vllm bench serve` conventions).

    python benchmarks/bench_serving.py --url http://127.0.0.1:8000 --model NAME \\
        --rates 0.5,1,2,inf --num-requests 48 --out results.json [--plot latency.png]

Trace: prompt and output lengths from the same long-tailed (log-normal) distributions as
benchmarks/bench_engine.py, scaled by --prompt-median / --output-median, prompts made of the
words "w0" ... (one token each with the word-level tokenizer of `--make-model`), Poisson
arrivals at each rate (inf: all at once), a fixed seed. Each request asks for its output
length with max_tokens (and vLLM's ignore_eos, unless --openai-only).
Metrics per rate: request throughput, output tokens/s, time to first token (TTFT), time per
output token after the first (TPOT), inter-token latency (ITL) and end-to-end latency,
each as mean / p50 / p99.

`--make-model DIR` writes the benchmark's model folder instead: a random ~168M Llama and
a word-level tokenizer (no downloads), to serve with any server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path


def trace(count: int, seed: int, prompt_median: int, output_median: int):
    """[(prompt text, output length)]."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        p = min(1024, max(16, int(rng.lognormvariate(math.log(prompt_median), 0.9))))
        n = min(256, max(16, int(rng.lognormvariate(math.log(output_median), 0.8))))
        out.append((" ".join(f"w{rng.randrange(10, 31000)}" for _ in range(p)), n))
    return out


EXTRA = {"ignore_eos": True}  # vLLM's field; --openai-only drops it for strict servers


async def one(client, url, model, prompt, max_tokens, headers):
    """(ttft, [inter-token gaps], e2e, output tokens) of one streamed completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, **EXTRA}
    start = time.perf_counter()
    first, last, gaps, pieces, tokens = None, None, [], 0, None
    async with client.stream("POST", url + "/v1/completions", json=body, headers=headers,
                             timeout=None) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                tokens = chunk["usage"].get("completion_tokens")
            if not chunk.get("choices") or not chunk["choices"][0].get("text"):
                continue
            now = time.perf_counter()
            if first is None:
                first = now
            else:
                gaps.append(now - last)
            last = now
            pieces += 1
    end = time.perf_counter()
    return (first or end) - start, gaps, end - start, tokens or pieces


def percentiles(values):
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    ordered = sorted(values)
    return {"mean": statistics.fmean(ordered), "p50": ordered[len(ordered) // 2],
            "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]}


async def run_rate(url, model, requests, rate, seed, headers):
    import httpx
    from tqdm.auto import tqdm

    rng = random.Random(seed)
    bar = tqdm(total=len(requests), desc=f"rate {rate}", leave=False)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=None)) as client:
        async def timed(prompt, n, delay):
            await asyncio.sleep(delay)
            try:
                return await one(client, url, model, prompt, n, headers)
            finally:
                bar.update(1)

        delays, t = [], 0.0
        for _ in requests:
            delays.append(t)
            if rate != math.inf:
                t += rng.expovariate(rate)
        start = time.perf_counter()
        results = await asyncio.gather(*(timed(p, n, d) for (p, n), d in zip(requests, delays)),
                                       return_exceptions=True)
        seconds = time.perf_counter() - start
    bar.close()
    ok = [r for r in results if not isinstance(r, BaseException)]
    errors = [repr(r) for r in results if isinstance(r, BaseException)]
    tokens = sum(r[3] for r in ok)
    tpot = [(r[2] - r[0]) / (r[3] - 1) for r in ok if r[3] > 1]
    return {"rate": rate, "requests": len(requests), "completed": len(ok),
            "errors": errors[:5], "seconds": seconds,
            "request_throughput": len(ok) / seconds, "output_tokens_per_s": tokens / seconds,
            "output_tokens": tokens, "ttft": percentiles([r[0] for r in ok]),
            "tpot": percentiles(tpot), "itl": percentiles([g for r in ok for g in r[1]]),
            "e2e": percentiles([r[2] for r in ok])}


def make_model(folder: str) -> None:
    """The benchmark's model folder: a random ~168M Llama, a word-level tokenizer."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import random_llama
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = random_llama()
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, model.config.vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", padding_side="left")
    fast.chat_template = ("{% for m in messages %}{{ m['content'] }} </s> {% endfor %}"
                          "{% if add_generation_prompt %}<s>{% endif %}")
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    print(f"wrote {folder}")


def plot(results: dict, path: str) -> None:
    try:
        import matplotlib
    except ImportError:  # (the rows are written already: the plot alone is left out)
        print(f"--plot {path} skipped: matplotlib is not installed (pip install matplotlib).",
              file=sys.stderr)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, rows in results.items():
        finite = [r for r in rows if r["rate"] != math.inf]
        rates = [r["rate"] for r in finite]
        axes[0].plot(rates, [r["ttft"]["p99"] for r in finite], "o-", label=name)
        axes[1].plot(rates, [r["e2e"]["p50"] for r in finite], "o-", label=name)
        axes[2].plot(rates, [r["output_tokens_per_s"] for r in finite], "o-", label=name)
    for ax, title in zip(axes, ["p99 time to first token (s)", "p50 end-to-end latency (s)",
                                "output tokens/s"]):
        ax.set_xlabel("request rate (requests/s)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(name: str, rows: list[dict]) -> str:
    lines = [f"{name}",
             f"{'rate':>6}{'done':>6}{'req/s':>8}{'out tok/s':>11}{'TTFT p50':>10}{'TTFT p99':>10}"
             f"{'TPOT p50':>10}{'ITL p50':>9}{'E2E p50':>9}{'E2E p99':>9}"]
    f = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    for r in rows:
        lines.append(f"{r['rate']:>6}{r['completed']:>6}{r['request_throughput']:>8.2f}"
                     f"{r['output_tokens_per_s']:>11.1f}{f(r['ttft']['p50']):>10}"
                     f"{f(r['ttft']['p99']):>10}{f(r['tpot']['p50']):>10}"
                     f"{f(r['itl']['p50']):>9}{f(r['e2e']['p50']):>9}{f(r['e2e']['p99']):>9}")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="server base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", help="the model name to ask for")
    parser.add_argument("--name", default=None, help="a label for this server in the results")
    parser.add_argument("--rates", default="0.5,1,2,inf",
                        help="comma-separated request rates in requests/s; inf: all at once")
    parser.add_argument("--num-requests", type=int, default=48, help="requests per rate (48)")
    parser.add_argument("--prompt-median", type=int, default=128, help="median prompt (128)")
    parser.add_argument("--output-median", type=int, default=64, help="median output (64)")
    parser.add_argument("--seed", type=int, default=0, help="trace and arrival seed (0)")
    parser.add_argument("--api-key", default=None, help="bearer token, if the server wants one")
    parser.add_argument("--out", help="JSON file to add this server's results to")
    parser.add_argument("--plot", help="PNG of latency and throughput against rate for every "
                        "server in --out")
    parser.add_argument("--openai-only", action="store_true",
                        help="send only OpenAI's fields (for servers refusing others)")
    parser.add_argument("--make-model", metavar="DIR", help="write the benchmark model folder")
    args = parser.parse_args()
    if args.openai_only:
        EXTRA.clear()
    if args.make_model:
        make_model(args.make_model)
        return
    results = json.loads(Path(args.out).read_text()) if args.out and Path(args.out).exists() \
        else {}
    if args.url:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        requests = trace(args.num_requests, args.seed, args.prompt_median, args.output_median)
        rows = []
        for rate in [float(r) for r in args.rates.split(",")]:
            rows.append(asyncio.run(run_rate(args.url, args.model, requests, rate, args.seed,
                                             headers)))
        name = args.name or args.url
        results[name] = rows
        print(table(name, rows))
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=2, default=str))
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
