"""The pure-PyTorch reference backend, and the masks only it needs.

It covers every forward (hidden slots, a caller's 4D mask, any device and dtype), which is
why the dispatcher falls back to it. Masks are derived from the `ForwardMetadata` once per
forward and kept in its `scratch`, so all layers share them.
"""

from __future__ import annotations

import math

import torch

from ..errors import HFPagedError
from ..kv.metadata import ForwardMetadata
from ..kv.quant import KINDS
from ..utils import cdiv
from . import reference
from .base import Backend, Capabilities


class TorchBackend(Backend):
    """The pure-PyTorch reference; runs anywhere."""

    name = "torch"
    capabilities = Capabilities(hidden_slots=True, caller_mask=True, softcap=True, sinks=True,
                                value_dim=True, devices=("cpu", "cuda"),
                                kv_dtypes=KINDS)

    def __init__(self):
        # Gather buffers for K (0) and V (1), reused by every layer
        self._workspace: dict[int, torch.Tensor] = {}

    def write_kv(self, k_cache, v_cache, key, value, slot_mapping):
        reference.write_kv(k_cache, v_cache, key, value, slot_mapping)

    def copy_blocks(self, kv, src, dst):
        reference.copy_blocks(kv, src, dst)

    def attention(self, query, k_cache, v_cache, meta, scale, sliding_window=None,
                  alibi_slopes=None, caller_mask=None, softcap=None, sinks=None,
                  eager_empty=False):
        """query [R, Hq, q, D] -> [R, q, Hq, Dv] (padded layout, see ForwardMetadata).

        caller_mask: a caller's 4D mask over columns (see `caller_mask_on_slots`), used
        instead of the causal / sliding-window mask, as SDPA uses it.
        eager_empty: a query that sees no key averages its row's values as the model's eager
        attention does (`reference.eager_fallback`), rather than giving SDPA's zeros.
        """
        fallback = (eager_fallback(meta, sliding_window, caller_mask, scale)
                    if eager_empty and alibi_slopes is None else None)
        if fallback is not None:  # some query sees no key: every row with the full mask
            mask, uniform = fallback
            return _padding_zeroed(reference.paged_attention(
                query, k_cache, v_cache, meta.block_tables, mask, scale, None, softcap, sinks,
                uniform), meta)
        workspace = None
        # A compiled forward plans its own buffers; one captured in a CUDA graph must not
        # keep a buffer that eager forwards later replace (the graph would write freed memory).
        if not torch.compiler.is_compiling() and not _capturing(query):
            blocks = meta.block_tables.numel()
            workspace = (self._gather_workspace(blocks, reference.as_stored(k_cache), 0),
                         self._gather_workspace(blocks, reference.as_stored(v_cache), 1))
        split = None
        if (query.shape[2] > 1 and caller_mask is None and alibi_slopes is None
                and softcap is None and sinks is None and workspace is not None):
            split = causal_rows(meta, sliding_window)
        if split is not None and split[1] is None:
            mask = None  # every row causal: no mask to build
        elif caller_mask is not None:
            mask = caller_mask_on_slots(meta, caller_mask)
        else:
            mask = attention_mask(meta, sliding_window, alibi_slopes, scale)
        groups = length_groups(meta) if query.shape[2] == 1 and caller_mask is None else None
        if split is not None:
            out = self._causal(query, k_cache, v_cache, meta, mask, scale, workspace, split)
        elif groups is not None:  # decode rows of very different lengths: gather each bucket
            out = query.new_empty(query.shape[0], 1, query.shape[1],
                                  reference.value_dim(v_cache))
            for rows, cols in groups:
                out.index_copy_(0, rows, _row_subset(query, k_cache, v_cache, meta, mask, rows,
                                                     cols, scale, workspace, softcap, sinks))
            return out
        else:
            out = reference.paged_attention(query, k_cache, v_cache, meta.block_tables, mask,
                                            scale, workspace, softcap, sinks)
        return _padding_zeroed(out, meta)

    def _causal(self, query, k_cache, v_cache, meta, mask, scale, workspace,
                split) -> torch.Tensor:
        """`attention` of a forward with rows that start their sequences (`causal_rows`):
        those, left-aligned in buckets of similar lengths, causally without a mask; the
        others with theirs (`mask`). The padded layout in and out."""
        buckets, others = split
        rows, heads, q_len, dim = query.shape
        if buckets is None:  # every row a fresh prompt as long as the layout: in place
            blocks = meta.block_tables[:, :cdiv(q_len, meta.block_size)]
            return reference.paged_attention(query, k_cache, v_cache, blocks, None, scale,
                                             workspace)
        out = query.new_zeros(rows * q_len, heads, reference.value_dim(v_cache))
        for index, cols, src, dest in buckets:
            part = query.index_select(0, index)
            part = part.gather(2, cols[:, None, :, None].expand(-1, heads, -1, dim))
            blocks = cdiv(cols.shape[1], meta.block_size)
            done = reference.paged_attention(part, k_cache, v_cache,
                                             meta.block_tables.index_select(0, index)[:, :blocks],
                                             None, scale, workspace)  # [n, L, Hq, Dv]
            out.index_copy_(0, dest, done.reshape(-1, heads, done.shape[-1]).index_select(0, src))
        out = out.view(rows, q_len, heads, -1)
        if others is not None:
            index, blocks = others
            out.index_copy_(0, index, _row_subset(query, k_cache, v_cache, meta, mask, index,
                                                  blocks, scale, workspace))
        return out

    def _gather_workspace(self, num_blocks: int, like: torch.Tensor, which: int) -> torch.Tensor:
        """[>= num_blocks, bs, Hkv, D] to gather `like`'s blocks into, grown in 25% steps.

        Reused across layers and steps: fresh allocations page-fault on CPU, which cost
        more than the copy itself. which: 0 for keys, 1 for values (sizes may differ).
        """
        ws = self._workspace.get(which)
        if (ws is None or ws.shape[0] < num_blocks or ws.shape[1:] != like.shape[1:]
                or ws.dtype != like.dtype):
            size = max(num_blocks, int(1.25 * (0 if ws is None else ws.shape[0])))
            with torch.inference_mode(False):  # usable under no_grad and inference_mode alike
                ws = torch.empty(size, *like.shape[1:], dtype=like.dtype, device=like.device)
            self._workspace[which] = ws
        return ws

    @property
    def workspace_bytes(self) -> int:
        return sum(ws.numel() * ws.element_size() for ws in self._workspace.values())


def _row_subset(query, k_cache, v_cache, meta, mask, rows, cols, scale, workspace,
                softcap=None, sinks=None) -> torch.Tensor:
    """`reference.paged_attention` of the rows `rows` [n] over their first `cols` block
    columns -> [n, q, Hq, Dv]."""
    return reference.paged_attention(
        query.index_select(0, rows), k_cache, v_cache,
        meta.block_tables.index_select(0, rows)[:, :cols],
        mask.index_select(0, rows)[..., :cols * meta.block_size], scale, workspace, softcap,
        sinks)


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def attention_mask(meta: ForwardMetadata, sliding_window: int | None,
                   alibi_slopes: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
    """The reference's mask, built once per forward and shared by all layers.

    [R, 1, q, T] bool, or with ALiBi slopes [H] a float bias [R, H, q, T]
    (`reference.alibi_bias` where visible, -inf elsewhere).
    """
    key = ("mask", sliding_window, alibi_slopes is not None, scale)
    mask = meta.scratch.get(key)
    if mask is None:
        mask = reference.key_mask(meta.query_pos, meta.is_query, meta.num_keys, sliding_window,
                                  meta.key_hidden)
        if alibi_slopes is not None:
            mask = _alibi_bias(meta, alibi_slopes, scale).masked_fill(~mask, float("-inf"))
        meta.scratch[key] = mask
    return mask


def _padding_zeroed(out: torch.Tensor, meta: ForwardMetadata) -> torch.Tensor:
    """out [R, q, Hq, Dv] with zeros on padding columns, as the kernels give."""
    return out if meta.is_query is None else out.masked_fill(
        ~meta.is_query[:, :, None, None], 0.0)


def eager_fallback(meta: ForwardMetadata, sliding_window: int | None, caller_mask,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`reference.eager_fallback` of the forward's mask (the caller's on slots, or the
    causal / window one), derived once per forward and mask; None when every query sees
    a key or the mask is an additive one."""
    mask = (attention_mask(meta, sliding_window, None, scale) if caller_mask is None
            else caller_mask_on_slots(meta, caller_mask))
    if mask.dtype != torch.bool:
        return None
    cached = meta.scratch.get(("eager", sliding_window))
    if cached is None or cached[0] is not mask:
        cached = meta.scratch[("eager", sliding_window)] = (mask, reference.eager_fallback(
            mask, meta.context_lens, meta.seq_lens, sliding_window))
    return cached[1]


def _alibi_bias(meta: ForwardMetadata, slopes: torch.Tensor, scale: float) -> torch.Tensor:
    """The ALiBi term [R or 1, H, 1, T]. Positions count visible tokens, as Falcon's
    alibi counts real tokens of the mask (hidden slots are skipped)."""
    if meta.key_hidden is None:
        t = torch.arange(meta.num_keys, device=slopes.device)
        return reference.alibi_bias(slopes.view(1, -1, 1, 1), t, scale)
    t = (~meta.key_hidden).cumsum(-1) - 1  # [R, T]
    return reference.alibi_bias(slopes.view(1, -1, 1, 1), t[:, None, None, :], scale)


def length_groups(meta: ForwardMetadata) -> list[tuple[torch.Tensor, int]] | None:
    """Decode rows bucketed by length, as ([n] row indices, block columns they need), when
    that saves at least a fifth of the padded keys; None otherwise.

    A gather-based attention pads every row to the longest; buckets whose lengths are
    within 25% of each other keep the padding small. Built once per forward."""
    if "groups" in meta.scratch:
        return meta.scratch["groups"]
    groups = None
    lens = meta.seq_lens_host
    if lens is not None and len(lens) >= 8:
        buckets: dict[int, list[int]] = {}
        for row, n in enumerate(lens):
            blocks = max(cdiv(n, meta.block_size), 1)
            buckets.setdefault(int(math.log(blocks, 1.25)), []).append(row)
        padded = len(lens) * meta.block_tables.shape[1]
        cols = {k: max(cdiv(max(lens[r] for r in rows), meta.block_size), 1)
                for k, rows in buckets.items()}
        if len(buckets) > 1 and sum(len(r) * cols[k] for k, r in buckets.items()) < 0.8 * padded:
            device = meta.block_tables.device
            groups = [(torch.tensor(rows, device=device), cols[k])
                      for k, rows in sorted(buckets.items())]
    meta.scratch["groups"] = groups
    return groups


def causal_rows(meta: ForwardMetadata, sliding_window: int | None):
    """Rows of more than one new token with nothing cached before them (fresh prompts) need
    no mask: their query j is position j and sees keys 0..j. Bucketed by length (within
    25%, as `length_groups`), as ([n] rows, [n, L] columns of each row's tokens in the
    padded layout, left-aligned, the last repeated on the right; [m] of the bucket's
    outputs and their [m] flat places in the padded output), plus (rows, block columns)
    of the other rows or None; (None, None) when every row qualifies and fills the layout.
    None when no row qualifies or the host lengths are unknown; built once per forward."""
    key = ("causal", sliding_window)
    if key in meta.scratch:
        return meta.scratch[key]
    split = None
    lens, counts = meta.seq_lens_host, meta.query_lens_host
    if lens is not None and counts is not None and meta.key_hidden is None:
        window = sliding_window or math.inf  # (a row no longer than it sees all its keys)
        fresh = [r for r, (n, c) in enumerate(zip(lens, counts))
                 if n == c > 1 and c <= window]
        if fresh:
            split = _causal_split(meta, fresh, lens, counts)
    meta.scratch[key] = split
    return split


def _causal_split(meta: ForwardMetadata, fresh: list[int], lens: list[int],
                  counts: list[int]):
    device = meta.block_tables.device
    q_len = meta.query_pos.shape[1]
    if len(fresh) == len(lens) and min(counts) == q_len:  # (a batch of equal prompts)
        return None, None
    by_size: dict[int, list[int]] = {}
    for r in fresh:
        by_size.setdefault(int(math.log(counts[r], 1.25)), []).append(r)
    buckets = []
    for _, rows in sorted(by_size.items()):
        n = torch.tensor([counts[r] for r in rows], device=device)
        index = torch.tensor(rows, device=device)
        width = max(counts[r] for r in rows)
        j = torch.arange(width, device=device)
        cols = (q_len - n[:, None] + j).clamp_(max=q_len - 1)  # [n, L]
        real = (j < n[:, None]).reshape(-1)
        src = real.nonzero().squeeze(1)
        dest = (index[:, None] * q_len + cols).reshape(-1)[src]
        buckets.append((index, cols, src, dest))
    fresh_set = set(fresh)
    others = [r for r in range(len(lens)) if r not in fresh_set]
    rest = None
    if others:
        rest = (torch.tensor(others, device=device),
                max(cdiv(max(lens[r] for r in others), meta.block_size), 1))
    return buckets, rest


def caller_mask_on_slots(meta: ForwardMetadata, mask: torch.Tensor) -> torch.Tensor:
    """A caller's 4D mask over columns, [R or 1, 1 or H, q, columns] (bool, True = attend,
    or an additive float bias), moved onto slots: [R, 1 or H, q, T], unstored slots
    masked. Raises if the mask lets a query see a column that has no slot."""
    cached = meta.scratch.get("caller")
    if cached is not None and cached[0] is mask:  # the same mask reaches every layer
        return cached[1]
    given = mask
    rows, q_len = meta.query_pos.shape
    if (mask.dim() != 4 or mask.shape[0] not in (1, rows) or mask.shape[2] != q_len
            or mask.shape[3] != meta.columns):
        raise ValueError(
            f"A 4D attention mask on a PagedCache forward must have shape [batch, 1 or "
            f"heads, new columns, all columns] = [{rows}, 1, {q_len}, {meta.columns}]; got "
            f"{tuple(mask.shape)}."
        )
    mask = mask.expand(rows, -1, -1, -1)
    visible = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    skip = meta.columns - meta.seq_lens  # [R] leading columns without a slot
    unstored = torch.arange(meta.columns, device=mask.device) < skip.unsqueeze(1)
    if (visible & unstored[:, None, None, :]).any():
        raise HFPagedError(
            "This 4D attention mask lets queries see columns that were left padding when "
            "they were cached; the PagedCache did not store them. Mask those columns, or "
            "use a cache that was filled without padding."
        )
    slots = torch.arange(meta.num_keys, device=mask.device)
    cols = (slots.unsqueeze(0) + skip.unsqueeze(1)).clamp(max=meta.columns - 1)  # [R, T]
    index = cols[:, None, None, :].expand(rows, mask.shape[1], q_len, meta.num_keys)
    out = mask.gather(-1, index)
    stored = (slots.unsqueeze(0) < meta.seq_lens.unsqueeze(1))[:, None, None, :]
    out = out & stored if out.dtype == torch.bool else out.masked_fill(~stored, float("-inf"))
    meta.scratch["caller"] = (given, out)
    return out
