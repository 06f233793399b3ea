"""The continuous-batching scheduler on its own (no torch): random arrivals, lengths,
priorities, aborts, budgets, pool sizes, both preemption modes, prefix caching and sliding
windows, simulated step by step.

Each simulated step carries out the plan on a model of the KV pool in which every slot
records which token (position and id) was written there. After every step: every block's
refcount equals its holders (rows, the prefix cache, swapped tables) and free blocks have
none; every running sequence's table reads back exactly its own tokens; budgets and the
row cap hold; requests are first admitted in (priority, arrival) order; and every request
ends, with all its tokens, unless aborted.
"""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from hf_paged.block_pool import BlockPool
from hf_paged.block_table import FREED
from hf_paged.core.kv_groups import KVGroups
from hf_paged.scheduler import RequestRejectedError, Scheduler
from hf_paged.sequence import Sequence, SeqStatus


class Simulation:
    def __init__(self, seed, num_blocks, block_size, max_num_seqs, budget, mode, prefix,
                 window, cpu_blocks, max_model_len=10_000, hybrid=False, headroom=0.0):
        """hybrid: KV groups of a model with one full and two sliding-window layers."""
        self.rng = random.Random(seed)
        self.pool = BlockPool(num_blocks, block_size)
        self.cpu = BlockPool(cpu_blocks, block_size) if mode == "swap" else None
        groups = KVGroups.plan([window, None, window]) if hybrid and window else None
        self.sched = Scheduler(self.pool, max_num_seqs, budget, max_model_len, window,
                               prefix, mode, self.cpu, groups, headroom)
        self.bs = block_size
        self.gpu: dict[int, dict[int, tuple]] = {}  # block -> slot -> (position, token)
        self.host: dict[int, dict[int, tuple]] = {}
        self.seqs: list[Sequence] = []
        self.first_admitted: list[Sequence] = []
        self.next_id = 0
        self.steps = 0

    def add(self, prompt, max_tokens, priority=0, n=1):
        self.sched.check_fits(len(prompt), max_tokens, n)
        seq = Sequence(self.next_id, f"r{self.next_id}", list(prompt), max_tokens, priority,
                       arrival=self.next_id, forks=n - 1)
        self.next_id += 1
        self.sched.add(seq)
        self.seqs.append(seq)
        return seq

    def token(self, seq):
        return self.rng.randrange(3, 40)

    def step(self):
        sched = self.sched
        waiting_before = [s for s in sched.waiting if not s.output and s.preemptions == 0]
        step = sched.schedule()
        self.steps += 1
        # budgets and rows
        assert step.num_tokens <= sched.max_num_batched_tokens
        assert len(step.scheduled) <= sched.max_num_seqs
        assert len({id(s.seq) for s in step.scheduled}) == len(step.scheduled)
        # first admissions respect (priority, arrival) among those waiting for the first time
        for item in step.scheduled:
            seq = item.seq
            if seq in waiting_before:
                earlier = [w for w in waiting_before if w.rank < seq.rank and w not in
                           [i.seq for i in step.scheduled] and not w.finished]
                assert not earlier, (seq.rank, [w.rank for w in earlier])
                self.first_admitted.append(seq)
        # carry the plan out on the model of the pool
        for g, c in step.swap_out:
            self.host[c] = dict(self.gpu.get(g, {}))
        for c, g in step.swap_in:
            self.gpu[g] = dict(self.host.get(c, {}))
        for src, dst in step.copies:
            self.gpu[dst] = dict(self.gpu.get(src, {}))
        for item in step.scheduled:
            seq = item.seq
            assert item.start == seq.num_computed and item.start + item.count <= seq.num_tokens
            for table in sched.tables.row_tables(seq.row):  # every KV group stores it
                for p in range(item.start, item.start + item.count):
                    block = table[p // self.bs]
                    assert block != FREED
                    self.gpu.setdefault(block, {})[p % self.bs] = (p, seq.tokens(p, p + 1)[0])
        sched.after_step(step)
        for item in step.scheduled:
            seq = item.seq
            if item.sample and not seq.finished:
                seq.output.append(self.token(seq))
                if seq.forks and len(seq.output) == 1:
                    children = []
                    for _ in range(seq.forks):
                        child = Sequence(self.next_id, seq.request_id, seq.prompt,
                                         seq.max_tokens, seq.priority, seq.arrival)
                        child.output = [self.token(child)]
                        self.next_id += 1
                        children.append(child)
                        self.seqs.append(child)
                    seq.forks = 0
                    sched.fork(seq, children)
                    for child in children:  # their first token may already end them
                        if len(child.output) >= child.max_tokens:
                            sched.finish(child, "length")
                if len(seq.output) >= seq.max_tokens:
                    sched.finish(seq, "length")
        self.check()
        return step

    def check(self):
        sched, pool = self.sched, self.pool
        rows = list(sched._free_rows) + [s.row for s in sched.running] + [
            r for s in sched.running for r in s.reserved_rows]
        assert sorted(rows) == list(range(sched.max_num_seqs)), rows  # no row lost or shared
        holders: dict[int, int] = {}
        for tables in sched.tables.by_group:
            for table in tables.tables:
                for b in table:
                    if b != FREED:
                        holders[b] = holders.get(b, 0) + 1
        for b in range(pool.num_blocks):
            expected = holders.get(b, 0) + sched.prefix.holds(b)
            assert pool.refcount(b) == expected, (b, pool.refcount(b), expected)
        free = pool.free_blocks()
        assert len(set(free)) == len(free) and not set(free) & set(holders)
        assert not any(sched.prefix.holds(b) for b in free)
        if self.cpu is not None:
            cpu_holders: dict[int, int] = {}
            for seq in sched.swapped:
                for b in (b for table in seq.swapped for b in table):
                    if b != FREED:
                        cpu_holders[b] = cpu_holders.get(b, 0) + 1
            for b in range(self.cpu.num_blocks):
                assert self.cpu.refcount(b) == cpu_holders.get(b, 0)
        for seq in sched.running:
            for tables in sched.tables.by_group:  # each group's table reads back its tokens
                table = tables.tables[seq.row]
                assert tables.lengths[seq.row] == seq.num_computed
                lo = tables.freed[seq.row] * self.bs
                for p in range(lo, seq.num_computed):
                    got = self.gpu.get(table[p // self.bs], {}).get(p % self.bs)
                    assert got == (p, seq.tokens(p, p + 1)[0]), (seq.seq_id, p, got)

    def run(self, limit=5000):
        while self.sched.has_work:
            self.step()
            assert self.steps < limit, "the scheduler stopped making progress"


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    max_num_seqs = draw(st.integers(1, 6))
    budget = draw(st.integers(max_num_seqs, 40))
    window = draw(st.sampled_from([None, None, 5, 12]))
    hybrid = window is not None and draw(st.booleans())  # full and sliding KV groups
    prefix = draw(st.booleans())
    mode = draw(st.sampled_from(["recompute", "swap"]))
    shared = [draw(st.integers(3, 39)) for _ in range(draw(st.integers(0, 20)))]
    requests = []
    for _ in range(draw(st.integers(1, 12))):
        length = draw(st.integers(1, 40))
        own = [draw(st.integers(3, 39)) for _ in range(length)]
        prompt = (shared + own)[:length] if draw(st.booleans()) else own
        requests.append(dict(prompt=prompt, max_tokens=draw(st.integers(1, 12)),
                             priority=draw(st.integers(0, 2)), n=draw(st.sampled_from([1, 1, 2, 3])),
                             arrive=draw(st.integers(0, 15)),
                             abort=draw(st.one_of(st.none(), st.integers(0, 30)))))
    longest = max(len(r["prompt"]) + r["max_tokens"] for r in requests)
    per_seq = (-(-longest // block_size) + 2) * (3 if hybrid else 1)
    num_blocks = draw(st.integers(per_seq, per_seq * 4))
    return dict(block_size=block_size, max_num_seqs=max_num_seqs, budget=budget, window=window,
                prefix=prefix, mode=mode, num_blocks=num_blocks, cpu_blocks=num_blocks,
                requests=requests, seed=draw(st.integers(0, 10**6)), hybrid=hybrid,
                headroom=draw(st.sampled_from([0, 0.5, 1, 3])))


EXAMPLES = int(os.environ.get("HF_PAGED_SCHEDULER_EXAMPLES", "300"))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_scheduler_invariants(w):
    sim = Simulation(w["seed"], w["num_blocks"], w["block_size"], w["max_num_seqs"],
                     w["budget"], w["mode"], w["prefix"], w["window"], w["cpu_blocks"],
                     hybrid=w["hybrid"], headroom=w["headroom"])
    pending = sorted(enumerate(w["requests"]), key=lambda r: r[1]["arrive"])
    made = {}
    tick = 0
    while pending or sim.sched.has_work:
        while pending and pending[0][1]["arrive"] <= tick:
            i, r = pending.pop(0)
            try:
                made[i] = sim.add(r["prompt"], r["max_tokens"], r["priority"], r["n"])
            except RequestRejectedError:
                assert r["n"] > w["max_num_seqs"]
        for i, seq in made.items():
            if w["requests"][i]["abort"] == tick and not seq.finished:
                for s in sim.seqs:
                    if s.request_id == seq.request_id:
                        sim.sched.abort(s)
                sim.check()
        if sim.sched.has_work:
            sim.step()
        tick += 1
        assert tick < 5000
    for seq in sim.seqs:
        assert seq.finished
        if seq.finish_reason == "length":
            assert len(seq.output) == seq.max_tokens
    # Everything returned: only the prefix cache may still hold blocks.
    assert sim.pool.num_used == sim.sched.prefix.num_cached
    sim.sched.prefix.clear()
    assert sim.pool.num_free == sim.pool.num_blocks


@pytest.mark.parametrize("hybrid", [False, True])
def test_preemption_happens_and_both_modes_finish(hybrid):
    for mode in ("recompute", "swap"):
        blocks = 36 if hybrid else 12
        sim = Simulation(1, num_blocks=blocks, block_size=4, max_num_seqs=4, budget=16,
                         mode=mode, prefix=False, window=6 if hybrid else None,
                         cpu_blocks=blocks, hybrid=hybrid)
        for i in range(6):
            sim.add([3 + i] * 10, max_tokens=20)
        sim.run()
        assert sim.sched.num_preemptions > 0
        assert all(len(s.output) == 20 for s in sim.seqs)
        if mode == "swap":
            assert sim.host  # blocks went to the CPU pool and back


def test_prefix_cache_hits_skip_prefill():
    sim = Simulation(2, num_blocks=40, block_size=4, max_num_seqs=4, budget=64,
                     mode="recompute", prefix=True, window=None, cpu_blocks=0)
    system = list(range(3, 23))  # 20 tokens: 5 full blocks
    first = sim.add(system + [30, 31], max_tokens=3)
    sim.run()
    second = sim.add(system + [32], max_tokens=3)
    step = sim.step()
    (item,) = step.scheduled
    assert item.seq is second and item.start == 20 and item.count == 1
    assert second.cached_tokens == 20 and first.cached_tokens == 0
    sim.run()
    assert sim.sched.prefix.hit_tokens == 20


def test_cached_blocks_are_evicted_least_recently_used_only_when_needed():
    sim = Simulation(3, num_blocks=10, block_size=4, max_num_seqs=2, budget=64,
                     mode="recompute", prefix=True, window=None, cpu_blocks=0)
    a = sim.add(list(range(3, 15)), max_tokens=1)  # 3 full blocks
    sim.run()
    assert sim.sched.prefix.num_evictable == 3 and sim.pool.num_free == 7
    b = sim.add(list(range(20, 52)), max_tokens=1)  # needs 9 blocks: evicts
    sim.run()
    assert b.finished and a.finished
    assert sim.sched.prefix.lookup(a.block_hashes[:1]) == []


def _tight_trace(headroom):
    """16 requests of 6..40 prompt and 8..30 output tokens, all at once, on a pool a third
    of their total: (preemptions, tokens computed beyond the requests' own, steps)."""
    rng = random.Random(5)
    requests = [([rng.randrange(3, 40) for _ in range(rng.randint(6, 40))], rng.randint(8, 30))
                for _ in range(16)]
    total = sum(-(-(len(p) + m) // 4) for p, m in requests)
    sim = Simulation(0, num_blocks=total // 3, block_size=4, max_num_seqs=8, budget=32,
                     mode="recompute", prefix=False, window=None, cpu_blocks=0,
                     headroom=headroom)
    for prompt, max_tokens in requests:
        sim.add(prompt, max_tokens)
    computed = 0
    while sim.sched.has_work:
        computed += sim.step().num_tokens
        assert sim.steps < 5000
    assert all(len(s.output) == s.max_tokens for s in sim.seqs)
    own = sum(len(p) + m - 1 for p, m in requests)
    return sim.sched.num_preemptions, computed - own, sim.steps


def test_admission_headroom_avoids_preemption_under_a_tight_budget():
    eager = _tight_trace(0)
    kept = _tight_trace(1.0)
    assert eager[0] > 0 and eager[1] > 0  # admitting while a first chunk fits thrashes
    assert kept[0] < eager[0] and kept[1] < eager[1]
    assert kept[2] < 1.5 * eager[2]  # and costs few extra steps


def test_admission_headroom_is_waived_when_nothing_runs():
    # A request that needs the whole pool starts alone, whatever the headroom.
    sim = Simulation(0, num_blocks=10, block_size=4, max_num_seqs=4, budget=64,
                     mode="recompute", prefix=False, window=None, cpu_blocks=0, headroom=3)
    big = sim.add([3] * 30, max_tokens=10)
    small = sim.add([4] * 3, max_tokens=2)
    step = sim.step()
    assert [i.seq for i in step.scheduled] == [big]  # small waits: no headroom left
    sim.run()
    assert big.finished and small.finished and len(small.output) == 2


@pytest.mark.parametrize("bad", [-1, 65, float("nan"), True, "1"])
def test_admission_headroom_is_checked(bad):
    with pytest.raises(ValueError, match="admission_headroom"):
        Scheduler(BlockPool(8, 4), 4, 16, 64, admission_headroom=bad)


def test_rejections_are_named():
    pool = BlockPool(8, 4)
    sched = Scheduler(pool, 4, 16, max_model_len=64)
    with pytest.raises(RequestRejectedError, match="context of 64"):
        sched.check_fits(60, 10)
    with pytest.raises(RequestRejectedError, match="whole pool has 8"):
        sched.check_fits(30, 10)
    with pytest.raises(RequestRejectedError, match="empty"):
        sched.check_fits(0, 10)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Scheduler(pool, 8, 4, 64)


def test_prefix_cache_forgets_a_namespace():
    """An unloaded adapter's blocks: held ones stay with their holder but are never found
    again; unheld ones are freed; other namespaces keep theirs."""
    from hf_paged.core.block_pool import BlockPool
    from hf_paged.core.prefix_cache import PrefixCache, namespace

    pool = BlockPool(8, 4)
    cache = PrefixCache(pool)
    a, b, keep = pool.allocate(3)
    cache.register(a, b"ka", namespace("lora-a", "tenant"))
    cache.register(b, b"kb", namespace("lora-a"))
    cache.register(keep, b"kk", namespace("lora-ab"))
    pool.decref([b, keep])  # their sequences ended: only the cache holds them
    cache.released([b, keep])
    assert cache.forget(namespace("lora-a")[:-1]) == 2
    assert cache.lookup([b"ka"]) == [] and cache.lookup([b"kb"]) == []
    assert cache.lookup([b"kk"]) == [keep]
    assert pool.refcount(a) == 1 and pool.refcount(b) == 0 and b in pool.free_blocks()
    cache.released([a])  # its holder lets go later: nothing left to do for the cache
    assert cache.num_evictable == 1


def test_forgotten_prefixes_are_never_found_and_old_holders_register_none():
    """After `forget_prefixes` (the model's weights changed): no block cached before is
    found, a sequence running across it registers none of its blocks (their K/V mix both
    weights) while a new one registers its own, and every refcount stays right."""
    sim = Simulation(4, num_blocks=60, block_size=4, max_num_seqs=4, budget=64,
                     mode="recompute", prefix=True, window=None, cpu_blocks=0)
    system = list(range(3, 23))  # 20 tokens: 5 full blocks
    sim.add(system + [30], max_tokens=2)
    sim.run()
    old = sim.add(system + [31], max_tokens=16)  # hits the first's 5 blocks
    sim.step()
    assert old.cached_tokens == 20
    sim.sched.forget_prefixes()
    fresh = sim.add(system + [32], max_tokens=1)  # finds nothing: registers 5 blocks anew
    for _ in range(10):  # `old` fills blocks 5 and 6 meanwhile
        sim.step()
    assert fresh.cached_tokens == 0 and fresh.finished and not old.finished
    # Blocks 0-4 are found again (`fresh`'s), blocks 5 and 6 (`old`'s) are not.
    new = sim.add(old.prompt + old.output[:10], max_tokens=1)
    sim.run()
    assert new.cached_tokens == 20 and old.finished and new.finished
