"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode-only forward (every row adds one token) of n rows runs padded to the smallest
bucket B >= n (1, 2, 4, 8, then multiples of 8 up to `max_num_seqs`) from static buffers:
token ids [B] and positions [B] (int64), and per KV group a block-table copy [B, cols]
(int32, cols = the device table's width). The graph of a bucket is captured the first time
a step needs it; later steps copy their inputs into the buffers and replay it.

What a graph bakes in is fixed per bucket by construction: the metadata is built inside it
from the buffers, with the table's full width as the bound on sequence lengths (the
kernels stop at each row's own length), so no host value of one step reaches another.
Padded rows (n..B) get position 0 and a table row of the pool's spare block, which no
sequence owns: their writes land there and their attention reads only it.

Mixed steps (prompt chunks), forwards with prompt log-probabilities, LoRA adapters and
split models run as before. Capture goes through `capture_for(device)`: CUDA graphs on a
GPU; the tests substitute an aten-level trace (`TracedGraph`), which bakes in Python-level
decisions the way a CUDA graph does, to check the buffers and padding on CPU.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext

import torch

from ..hf.rope import token_lengths, token_rope
from ..kv.metadata import build_metadata, to_device

logger = logging.getLogger("hf_paged")


def buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes graphs are captured for: 1, 2, 4, 8, then multiples of 8, and
    `max_num_seqs` itself."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs]
    sizes += range(8, max_num_seqs, 8)
    return sorted({*sizes, max_num_seqs})


class CudaGraph:
    """A CUDA graph of `body` (a function of no arguments returning logits), captured after
    warm-up runs on a side stream (which compile kernels and leave the same K/V in the same
    slots as the replay will)."""

    def __init__(self, body, pool):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                body()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.output = body()

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.output


class TracedGraph:
    """An aten-level trace of `body` (torch.fx's make_fx), replayed by running the trace:
    like a CUDA graph, it keeps the ops and the tensors they touch and drops every Python
    decision taken while tracing. The CPU stand-in the tests use."""

    def __init__(self, body, pool=None):
        from torch.fx.experimental.proxy_tensor import make_fx

        self.trace = make_fx(body)()

    def replay(self) -> torch.Tensor:
        with torch.inference_mode():  # (the trace keeps ops, not the grad mode they ran in)
            return self.trace()


def capture_for(device: torch.device):
    """The graph class for `device`; ValueError where there is none."""
    if device.type == "cuda":
        return CudaGraph
    raise ValueError(f"cuda_graphs=True needs the model on a CUDA device; it is on {device}. "
                     "Use cuda_graphs=False (or leave it unset).")


def wants_graphs(cuda_graphs, compile, device: torch.device, blocks: int, split: bool) -> bool:
    """Whether an engine's decode steps replay graphs: asked for (None: by default with
    `compile` on a CUDA device), never for a split model (tensor parallelism, device_map).
    Raises ValueError where they were asked for and cannot be had."""
    if cuda_graphs not in (None, True, False):
        raise ValueError(f"cuda_graphs must be True, False or None; got {cuda_graphs!r}.")
    if cuda_graphs is None:
        return bool(compile) and device.type == "cuda" and not split and blocks >= 2
    if cuda_graphs and split:
        raise ValueError("cuda_graphs=True runs a model on one device; this one is split "
                         "(tensor parallelism or device_map). Use cuda_graphs=False.")
    if cuda_graphs:
        capture_for(device)  # raises where graphs cannot be captured
        if blocks < 2:
            raise ValueError("cuda_graphs=True needs a KV pool of at least 2 blocks (one is "
                             "where padded rows write); raise the KV budget.")
    return cuda_graphs


class DecodeGraphs:
    """The captured decode graphs of one `ModelRunner` and their static buffers."""

    def __init__(self, runner, pad_block: int):
        """pad_block: a pool block no sequence owns (padded rows write and read it)."""
        self.runner = runner
        self.capture = capture_for(runner.kv_device)
        self.sizes = buckets(runner.max_num_seqs)
        most, device = self.sizes[-1], runner.kv_device
        table = runner.device_table
        self.pad_block = pad_block
        self.ids = torch.zeros(most, dtype=torch.int64, device=runner.device)
        self.positions = torch.zeros(most, dtype=torch.int64, device=device)
        self.tables = [torch.full((most, table.table.shape[1]), pad_block, dtype=torch.int32,
                                  device=device) for _ in range(table.num_groups)]
        self.keep = torch.arange(most, device=runner._index_device)
        # Each row's rotary length, where the model's rotary frequencies follow it (hf/rope.py).
        self.lengths = torch.ones(most, dtype=torch.int64, device=device)
        self.bound = table.table.shape[1] * runner.block_size  # no row is longer
        self._graphs: dict[int, object] = {}
        self._pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self._table = table.table  # graphs read this tensor; a new one means recapture
        self.capture_seconds = 0.0
        self.capture_bytes = 0
        self.replays = 0
        self.failed: str | None = None  # why capturing failed (then no graph runs)

    def takes(self, f) -> bool:
        """Whether forward `f` runs from a graph: decode rows only, without prompt
        log-probabilities, within the largest bucket, no adapter (and no capture failed)."""
        n = len(f.rows)
        return (self.failed is None and 0 < n <= self.sizes[-1] and not f.prompt_rows
                and f.adapter is None and not self.runner.adapters and f.counts.count(1) == n)

    def run(self, f) -> torch.Tensor | None:
        """The logits [S, V] of `f`'s sampling rows, from its bucket's graph; None when
        `f` is not one graphs run (or its capture failed): the caller runs it."""
        if not self.takes(f):
            return None
        runner, n = self.runner, len(f.rows)
        if runner.device_table.table is not self._table:  # (the table was reallocated)
            self._graphs.clear()
            self._table = runner.device_table.table
        size = next(b for b in self.sizes if b >= n)
        self._fill(f, n, size)
        graph = self._graphs.get(size)
        if graph is None:
            try:
                graph = self._graphs[size] = self._capture(size)
            except Exception as err:  # noqa: BLE001 (the forward then runs without graphs)
                logger.warning("hf-paged engine: capturing a decode graph failed (%s: %s); "
                               "decode steps run without graphs", type(err).__name__, err)
                self.failed = f"{type(err).__name__}: {err}"
                return None
        # A copy: the graphs share one memory pool, so another graph's replay (a bisected
        # step's second half) may reuse this output's memory.
        logits = graph.replay()[:n].clone()
        self.replays += 1
        if len(f.last) != n:  # rows that do not sample (one-token prompt chunks)
            logits = logits.index_select(0, to_device(f.last, logits.device))
        return logits

    def drop(self) -> None:
        """Forgets every graph (each is captured anew when next needed): the parameters
        they read were replaced, or the model's forward takes another path. (A replay may
        still run, under async scheduling: its memory is freed once it has finished.)"""
        if self._graphs and self._pool is not None:
            torch.cuda.current_stream(self.runner.kv_device).synchronize()
        self._graphs.clear()

    def _fill(self, f, n: int, size: int) -> None:
        """Copies the step's inputs into the buffers; rows n..size become padding."""
        runner = self.runner
        # One copy to the device (the model is on one device: ids, tables, positions alike).
        rope = (f.rope_lengths or [0] * n) if runner.rope else []
        host = to_device(f.ids + f.positions + f.rows + rope, runner.kv_device)
        rows = host[2 * n:3 * n]
        for g, table in enumerate(self.tables):
            torch.index_select(runner.device_table.group(g), 0, rows, out=table[:n])
            table[n:size].fill_(self.pad_block)
        self.ids[:n].copy_(f.fill_pending(host[:n]))
        self.positions[:n].copy_(host[n:2 * n])
        self.ids[n:size].zero_()
        self.positions[n:size].zero_()
        if runner.rope:
            self.lengths[:n].copy_(token_lengths(host[n:2 * n], host[3 * n:]))
            self.lengths[n:size].fill_(1)

    def _capture(self, size: int):
        runner = self.runner
        counts = [1] * size

        def body():
            metas = [build_metadata(table[:size], self.positions[:size], counts, 1, self.bound,
                                    runner.block_size, packed=True,
                                    uniform=runner.compiled is not None)
                     for table in self.tables]
            with token_rope(self.lengths[:size]) if runner.rope else nullcontext():
                return runner.run_model(self.ids[:size], self.positions[:size], metas,
                                        self.keep[:size])

        cuda = self._pool is not None
        before = torch.cuda.memory_reserved(runner.kv_device) if cuda else 0
        start = time.perf_counter()
        graph = self.capture(body, self._pool)
        if cuda:
            torch.cuda.synchronize(runner.kv_device)
            self.capture_bytes += torch.cuda.memory_reserved(runner.kv_device) - before
        self.capture_seconds += time.perf_counter() - start
        logger.info("hf-paged engine: captured the decode graph of %d rows in %.2f s", size,
                    time.perf_counter() - start)
        return graph

    def stats(self) -> dict:
        return dict(graphs=len(self._graphs), failed=self.failed, sizes=sorted(self._graphs),
                    capture_seconds=round(self.capture_seconds, 3),
                    capture_bytes=self.capture_bytes, replays=self.replays)
