"""Continuous-batching scheduler: which sequences compute how many tokens each step.

Plain Python, no torch. Each step, under a token budget (`max_num_batched_tokens`) and a
cap on running sequences (`max_num_seqs`):

1. running sequences go first, in (priority, arrival) order: a decode token each, or the
   next chunk of a prompt still being prefilled (chunked prefill);
2. when their blocks run short, the lowest-priority, most recently arrived running sequence
   not yet served this step is preempted: its blocks are freed (recompute: it re-prefills
   prompt + output later) or copied to the CPU pool (swap), and the step goes on;
3. swapped sequences come back, then waiting ones are admitted in (priority, arrival) order
   while rows, budget and blocks allow (admission never preempts); a prompt's blocks found in
   the prefix cache are shared instead of recomputed. Admission keeps headroom: a sequence
   comes in only if `admission_headroom` free blocks per running sequence (its own rows
   included) and KV group remain after its first chunk, so that each running sequence can
   take its next block; otherwise prompts fill the pool and the decodes that follow preempt
   one another (`benchmarks/bench_engine.py --tight`). A lone request is always admitted.

A decode with speculative drafts (`Sequence.draft`) computes them with its newest token;
the drafts are trimmed first when the token budget or the blocks run short, and `accept`
later keeps the verified ones and gives back the slots of the rest.

The step is returned as a plan the engine carries out on the device: the scheduled
sequences with their token counts, block-table entries to write, copy-on-write pairs and
swaps. `after_step` records what was computed.

A hybrid model's KV groups (core/kv_groups.py) each give a sequence a table of its own:
the sequence's blocks are counted, allocated, cached by prefix, swapped and freed in every
group at once, and a sliding group's blocks leave as the window passes them.
"""

from __future__ import annotations

import bisect
import math
import time

from .block_pool import BlockPool
from .block_table import FREED, blocks_to_add
from .kv_groups import GroupedTables, KVGroups
from ..errors import RequestRejectedError
from .budgets import check_options
from .prefix_cache import PrefixCache, block_key
from .rope_switch import RopeSwitch
from .sequence import Sequence, SeqStatus
from .step import Scheduled, Step


class Scheduler:
    """Owns the block tables (a row per running sequence) and the prefix cache of a pool."""

    check_options = staticmethod(check_options)

    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, sliding_window: int | None = None,
                 enable_prefix_caching: bool = True, preemption_mode: str = "recompute",
                 cpu_pool: BlockPool | None = None, groups: KVGroups | None = None,
                 admission_headroom: float = 1.0, rope_switch: RopeSwitch | None = None):
        """sliding_window: of every layer (one KV group); groups: a hybrid model's KV groups
        instead (each with its window); admission_headroom: free blocks kept per running
        sequence and group when admitting one more (0: admit while the first chunk fits);
        rope_switch: Phi-3's LongRoPE switch (rope_switch.py), or None."""
        self.check_options(max_num_seqs, max_num_batched_tokens, preemption_mode,
                           admission_headroom)
        self.admission_headroom, self.pool, self.block_size = (admission_headroom, pool,
                                                               pool.block_size)
        self.max_num_seqs, self.max_num_batched_tokens, self.max_model_len = (
            max_num_seqs, max_num_batched_tokens, max_model_len)
        self.groups = groups or KVGroups.plan((sliding_window,))
        self.preemption_mode, self.cpu_pool = preemption_mode, cpu_pool
        self.tables = GroupedTables(pool, self.groups, max_num_seqs)
        self.prefix = PrefixCache(pool, enable_prefix_caching)
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        self.running: list[Sequence] = []  # kept in rank order
        self.waiting: list[Sequence] = []  # rank order; preempted ones keep their arrival
        self.swapped: list[Sequence] = []
        self._pending_entries: list[tuple[int, int, int]] = []  # from rows filled outside append
        self._pending_swap_in: list[tuple[int, int]] = []
        self.num_preemptions = self.recomputed_tokens = 0  # (tokens computed again)
        self.rope_switch = rope_switch  # Phi-3's LongRoPE switch (rope_switch.py), or None

    # -- requests --------------------------------------------------------------------------
    def blocks_at_once(self, total_tokens: int) -> int:
        """Most blocks a sequence of `total_tokens` holds at one time, all groups."""
        return self.groups.blocks_for(total_tokens, self.block_size, self.max_num_batched_tokens)

    def check_fits(self, prompt_len: int, max_tokens: int, n: int = 1) -> None:
        """Raises RequestRejectedError for a request that could never run."""
        total = prompt_len + max_tokens
        if prompt_len == 0:
            raise RequestRejectedError("the prompt is empty; give at least one token.", "prompt")
        if total > self.max_model_len:
            raise RequestRejectedError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {total} tokens "
                f"exceeds the model's context of {self.max_model_len} tokens."
            )
        need = self.blocks_at_once(total)
        if need > self.pool.num_blocks:  # (told in num_blocks' unit: blocks of all layers)
            raise RequestRejectedError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) needs "
                f"{self.groups.model_blocks(need, True)} KV blocks of {self.block_size} "
                f"tokens, but the whole pool has {self.groups.model_blocks(self.pool.num_blocks)}"
                "; raise the KV budget or lower max_tokens."
            )
        if n > self.max_num_seqs:
            raise RequestRejectedError(
                f"n={n} sequences exceed max_num_seqs={self.max_num_seqs}.", "n")

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self._insert(self.waiting, seq)

    def abort(self, seq: Sequence) -> None:
        """Removes `seq` wherever it is, freeing its blocks; it ends as "abort"."""
        self.finish(seq, "abort")

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.finished:
            return
        for queue in (self.running, self.waiting, self.swapped):
            if seq in queue:
                queue.remove(seq)
        self._free(seq)
        if seq.swapped is not None and self.cpu_pool is not None:
            self.cpu_pool.decref([b for t in seq.swapped for b in t if b != FREED])
            seq.swapped = None
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.swapped)

    # -- one step ----------------------------------------------------------------------------
    def schedule(self) -> Step:
        step = Step()
        budget = self.max_num_batched_tokens
        counts = [0] * self.max_num_seqs
        if self.groups.slides:  # blocks no query of a row can see again, in sliding groups
            self.prefix.released(self.tables.release_outside_window(self._computed_per_row()))
        reserved = 0  # blocks the counts planned so far will take
        available = self._available()
        scheduled = step.scheduled
        bs, refcounts, running = self.block_size, self.pool.refcounts, SeqStatus.RUNNING
        # One group: a decode into a partly filled block of its own needs nothing (most rows).
        lengths, tables = (self.tables.lengths, self.tables.tables) \
            if self.groups.num_groups == 1 else (None, None)
        held = self.rope_switch.apply(self) if self.rope_switch is not None else ()
        for seq in [s for s in self.running if s not in held] if held else list(self.running):
            if seq.status is not running or budget == 0:
                continue
            row, done, draft = seq.row, seq.num_computed, seq.draft
            todo = len(seq.prompt) + len(seq.output) + seq.pending + len(draft) - done
            if draft and todo > budget:  # a short budget verifies fewer drafts
                todo -= len(draft[budget - 1:])
                del draft[budget - 1:]
            count = todo if todo < budget else budget
            if count == 1 and lengths is not None and lengths[row] % bs \
                    and refcounts[tables[row][-1]] == 1:
                need = 0
            else:
                while True:
                    need = self._row_needs(row, count)
                    room = available - reserved
                    if need <= room:
                        break
                    if draft:  # short of blocks: no drafts rather than a preemption
                        todo = count = todo - len(draft)
                        draft.clear()
                        continue
                    fit = self._row_fits(row, room)
                    if fit >= 1:  # a prompt still prefilling takes a smaller chunk
                        count = min(count, fit)
                        continue
                    served = {item.seq.seq_id for item in scheduled}
                    victim = next((s for s in reversed(self.running)
                                   if s is not seq and s.seq_id not in served), seq)
                    self._preempt(victim, step)
                    available = self._available()
                    if victim is seq:
                        count = 0
                        break
            if count:
                counts[row] = count
                reserved += need
                budget -= count
                sample = count == todo
                scheduled.append(Scheduled(seq, done, count, sample, seq.forks if sample else 0,
                                           tuple(draft) if draft else ()))
        if not step.preempted:  # nothing was short of blocks: admit swapped, then waiting
            budget, reserved = self._admit(step, counts, budget, reserved)
        needed = self.tables.blocks_needed(counts)
        if needed > self.pool.num_free:
            self.prefix.evict(needed - self.pool.num_free)
        plan = self.tables.append(counts, needed)
        step.entries = self._pending_entries + plan.entries
        step.copies = plan.copies
        step.swap_in = self._pending_swap_in
        self._pending_entries, self._pending_swap_in = [], []
        return step

    def _admit(self, step: Step, counts: list[int], budget: int, reserved: int):
        for queue in (self.swapped, self.waiting):
            for seq in list(queue):
                rows = 1 + seq.forks
                if budget == 0 or len(self._free_rows) < rows:
                    return budget, reserved
                if queue is self.swapped:
                    admitted = self._swap_in(seq, budget, reserved)
                else:
                    admitted = self._start(seq, budget, reserved)
                if not admitted:  # FCFS: nobody behind it jumps the line
                    return budget, reserved
                queue.remove(seq)
                self._insert(self.running, seq)
                seq.status = SeqStatus.RUNNING
                count = min(seq.to_compute, budget)
                need = self._row_needs(seq.row, count)
                counts[seq.row] = count
                reserved += need
                budget -= count
                step.scheduled.append(Scheduled.of(seq, count))
        return budget, reserved

    def _start(self, seq: Sequence, budget: int, reserved: int) -> bool:
        """Gives `seq` a row with its cached prefix, if the first chunk's blocks fit."""
        keys = self._prefix_keys(seq)
        # A prefix is a hit as far as every group still has its blocks.
        hits = [self.prefix.lookup(self._group_keys(keys, g))
                for g in range(self.groups.num_groups)]
        found = min(min(len(h) for h in hits), seq.cacheable // self.block_size)
        # With nothing running to free blocks, a hit the pool cannot hold beside the first
        # chunk (held whole, in sliding groups too) is dropped: the prompt runs anew.
        for found in (found, 0) if found and not self.running else (found,):
            hits = [h[:found] for h in hits]
            cached = found * self.block_size
            chunk = min(seq.num_tokens - cached, budget)
            # Blocks the first chunk needs beyond the hits (hits stop being evictable).
            need = blocks_to_add(found, 0, cached + chunk, self.block_size) * len(hits)
            hit_evictable = sum(1 for h in hits for b in h if self.pool.refcount(b) == 1)
            if need + self._headroom(seq) <= self._available() - hit_evictable - reserved:
                break
        else:
            return False
        row = self._free_rows.pop()
        seq.reserved_rows = [self._free_rows.pop() for _ in range(seq.forks)]
        self.prefix.acquire([b for h in hits for b in h])
        self._pending_entries += self.tables.assign(row, hits, cached)
        seq.row, seq.num_computed, seq.registered = row, cached, found
        if seq.lost_tokens:  # preempted by recompute: what the prefix cache kept is not redone
            self.recomputed_tokens += max(seq.lost_tokens - cached, 0)
            seq.lost_tokens = 0
        if seq.preemptions == 0:  # its first admission
            seq.cached_tokens, seq.first_scheduled = cached, time.monotonic()
            self.prefix.queried_tokens += len(seq.prompt)
            self.prefix.hit_tokens += cached
        return True

    def _swap_in(self, seq: Sequence, budget: int, reserved: int) -> bool:
        live = [b for t in seq.swapped for b in t if b != FREED]
        count = min(seq.num_tokens - seq.swapped_length, budget)
        growth = sum(max(blocks_to_add(len(t), seq.swapped_length, count, self.block_size), 0)
                     for t in seq.swapped)
        if len(live) + growth + self._headroom(seq) > self._available() - reserved:
            return False
        if len(live) > self.pool.num_free:
            self.prefix.evict(len(live) - self.pool.num_free)
        fresh = iter(self.pool.allocate(len(live)))
        tables = [[b if b == FREED else next(fresh) for b in t] for t in seq.swapped]
        self._pending_swap_in += [(c, g) for cpu, gpu in zip(seq.swapped, tables)
                                  for c, g in zip(cpu, gpu) if c != FREED]
        self.cpu_pool.decref(live)  # the copy back is queued before any later swap-out
        row = self._free_rows.pop()
        seq.reserved_rows = [self._free_rows.pop() for _ in range(seq.forks)]
        self._pending_entries += self.tables.assign(row, tables, seq.swapped_length,
                                                    incref=False)
        seq.row, seq.swapped = row, None
        return True

    def _preempt(self, seq: Sequence, step: Step) -> None:
        self.num_preemptions += 1
        seq.preemptions += 1
        self.running.remove(seq)
        step.preempted.append(seq)
        seq.draft.clear()
        tables, length = self.tables.row_tables(seq.row), self.tables.lengths[seq.row]
        live = [b for t in tables for b in t if b != FREED]
        if (self.preemption_mode == "swap" and self.cpu_pool is not None
                and len(live) <= self.cpu_pool.num_free):
            cpu = iter(self.cpu_pool.allocate(len(live)))
            seq.swapped = [[b if b == FREED else next(cpu) for b in t] for t in tables]
            seq.swapped_length = length
            step.swap_out += [(g, c) for gpu, host in zip(tables, seq.swapped)
                              for g, c in zip(gpu, host) if g != FREED]
            self._free(seq)
            seq.status = SeqStatus.SWAPPED
            self._insert(self.swapped, seq)
            return
        self.requeue(seq)  # recompute: prompt + output are prefilled again later

    def requeue(self, seq: Sequence) -> None:
        """Gives back the blocks of a sequence no longer running; it waits to compute anew."""
        self._free(seq)
        seq.lost_tokens, seq.num_computed = seq.num_computed, 0
        seq.status = SeqStatus.WAITING
        self._insert(self.waiting, seq)

    def _free(self, seq: Sequence) -> None:
        """Gives back the sequence's row, its blocks and the rows kept for its siblings."""
        if seq.row is not None:
            self.prefix.released(self.tables.free_row(seq.row))
            self._free_rows.append(seq.row)
            seq.row = None
        self._free_rows += seq.reserved_rows
        seq.reserved_rows = []

    # -- after the forward ---------------------------------------------------------------------
    def after_step(self, step: Step) -> None:
        """Records the computed tokens and registers newly filled blocks in the prefix cache."""
        bs, finished = self.block_size, SeqStatus.FINISHED
        for item in step.scheduled:
            seq = item.seq
            if seq.row is None or seq.status is finished:
                continue
            # A speculating sequence's drafts count once verified (`accept`).
            seq.num_computed = computed = item.start + item.count - len(item.draft)
            if computed // bs > seq.registered:
                self._register_full_blocks(seq)

    def accept(self, seq: Sequence, accepted: int) -> None:
        """After `after_step`: a speculating sequence keeps the K/V of its first `accepted`
        drafts; the slots of the others are given back (blocks past them freed), so nothing
        stale is ever read or cached."""
        if seq.row is None or seq.finished:
            return
        seq.num_computed += accepted
        self.prefix.released(self.tables.truncate_row(seq.row, seq.num_computed))
        if seq.num_computed // self.block_size > seq.registered:
            self._register_full_blocks(seq)

    def forget_prefixes(self) -> None:
        """The model's weights changed: no cached block is found again, and sequences that
        hold K/V of the old weights register none (a recomputed one registers anew)."""
        self.prefix.forget(b"")
        for seq in self.running + self.swapped:
            seq.registered = math.inf

    def fork(self, parent: Sequence, children: list[Sequence]) -> None:
        """`children` continue `parent` (same prompt, rows reserved at admission), sharing
        its blocks copy-on-write."""
        tables, length = self.tables.row_tables(parent.row), self.tables.lengths[parent.row]
        for child in children:
            row = parent.reserved_rows.pop()
            self._pending_entries += self.tables.assign(row, tables, length)
            child.row, child.num_computed = row, parent.num_computed
            child.block_hashes = list(parent.block_hashes)
            child.registered = parent.registered
            child.status = SeqStatus.RUNNING
            self._insert(self.running, child)

    # -- helpers ------------------------------------------------------------------------------
    def _available(self) -> int:
        return self.pool.num_free + self.prefix.num_evictable

    def _headroom(self, seq: Sequence) -> int:
        """Blocks to leave free when admitting `seq`: `admission_headroom` per running
        sequence, its own rows included, in every group (none while nothing runs)."""
        rows = self.max_num_seqs - len(self._free_rows)  # held now, siblings' rows included
        if not rows or not self.admission_headroom:
            return 0
        return math.ceil(self.admission_headroom * (rows + 1 + seq.forks)) * self.groups.num_groups

    def _row_needs(self, row: int, count: int) -> int:
        """Blocks `count` more tokens of `row` take, over all groups: new blocks, and a copy
        of a shared partial last block (copy-on-write)."""
        bs, refcount = self.block_size, self.pool.refcount
        by_group = self.tables.by_group
        length = by_group[0].lengths[row]
        partial = length % bs
        grown = -(-(length + count) // bs)
        need = 0
        for tables in by_group:
            table = tables.tables[row]
            add = grown - len(table)
            if partial and table and table[-1] != FREED and refcount(table[-1]) > 1:
                add += 1
            if add > 0:
                need += add
        return need

    def _row_fits(self, row: int, room: int) -> int:
        """Most tokens `row` can take with `room` more blocks (0 if it must copy a shared
        partial block first, or has no room). Every group grows alike: a block's worth of
        tokens takes a block in each."""
        table, length = self.tables.tables[row], self.tables.lengths[row]
        if self._row_needs(row, 1) > room:
            return 0
        per_block = self.groups.num_groups
        extra = (room - self._row_needs(row, 0)) // per_block
        return (len(table) + extra) * self.block_size - length

    def _computed_per_row(self) -> list[int]:
        positions = [0] * self.max_num_seqs
        for seq in self.running:
            positions[seq.row] = seq.num_computed
        return positions

    def _keys(self, seq: Sequence, count: int) -> list[bytes]:
        """Content keys of the sequence's first `count` blocks (computed once)."""
        keys = seq.block_hashes
        while len(keys) < count:
            i = len(keys)
            keys.append(block_key(keys[-1] if keys else None,
                                  seq.tokens(i * self.block_size, (i + 1) * self.block_size),
                                  seq.salt))
        return keys[:count]

    def _prefix_keys(self, seq: Sequence) -> list[bytes]:
        """Keys of the full blocks before the sequence's last token (which is always
        computed, for its logits)."""
        return self._keys(seq, (seq.num_tokens - 1) // self.block_size)

    def _register_full_blocks(self, seq: Sequence) -> None:
        full = seq.num_computed // self.block_size
        if seq.registered >= full:
            return
        keys = self._keys(seq, full)
        for g, tables in enumerate(self.tables.by_group):
            table, group_keys = tables.tables[seq.row], self._group_keys(keys, g)
            for i in range(seq.registered, full):
                if table[i] != FREED:
                    self.prefix.register(table[i], group_keys[i], seq.salt)
        seq.registered = full

    @staticmethod
    def _group_keys(keys: list[bytes], group: int) -> list[bytes]:
        """The prefix-cache keys of a sequence's blocks in KV group `group` (group 0's are
        the content keys; other groups hold other blocks for the same content)."""
        if group == 0:
            return keys
        tag = group.to_bytes(2, "little")
        return [key + tag for key in keys]

    @staticmethod
    def _insert(queue: list[Sequence], seq: Sequence) -> None:
        bisect.insort(queue, seq, key=lambda s: s.rank)
