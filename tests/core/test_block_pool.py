"""The allocator in isolation: plain Python, checked by property tests in milliseconds."""

from __future__ import annotations

import sys

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hf_paged.block_pool import BlockPool
from hf_paged.block_table import FREED, BlockTables
from hf_paged.errors import KVCacheExhaustedError


def test_core_does_not_import_torch():
    import pathlib
    import subprocess

    package = pathlib.Path(__file__).resolve().parents[2] / "hf_paged"
    # Load the whole core under a bare package so hf_paged/__init__ (which needs torch) stays out.
    code = (
        "import sys, types; pkg = types.ModuleType('hf_paged'); "
        f"pkg.__path__ = [{str(package)!r}]; sys.modules['hf_paged'] = pkg; "
        "import hf_paged.core.block_pool, hf_paged.core.block_table, hf_paged.core.prefix_cache, "
        "hf_paged.core.sequence, hf_paged.core.scheduler; "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_allocate_exhaust_free():
    pool = BlockPool(4, 16)
    blocks = pool.allocate(3)
    assert sorted(blocks) == [0, 1, 2] and pool.num_free == 1
    with pytest.raises(KVCacheExhaustedError) as err:
        pool.allocate(2)
    assert err.value.needed == 2 and err.value.free == 1
    assert pool.num_free == 1  # nothing taken by the failed call
    pool.incref([blocks[0]])
    pool.decref(blocks)
    assert pool.num_free == 3 and pool.refcount(blocks[0]) == 1
    pool.decref([blocks[0]])
    assert pool.num_free == 4 and pool.peak_used == 3


def test_grow_keeps_ids():
    pool = BlockPool(2, 8)
    a = pool.allocate(2)
    pool.grow(5)
    assert pool.num_blocks == 5 and pool.num_free == 3
    assert sorted(a + pool.allocate(3)) == [0, 1, 2, 3, 4]


def test_append_copy_on_write_only_for_shared_partial_block():
    pool = BlockPool(16, 4)
    t = BlockTables(pool, 1)
    t.append([6])  # blocks: full + half
    t.fork_rows([0, 0, 0])
    assert pool.refcount(t.tables[0][0]) == 3
    plan = t.append([1, 1, 0])
    # two of the three holders write: both copy (the third still reads the original)
    assert len(plan.copies) == 2
    assert t.tables[2][1] not in (t.tables[0][1], t.tables[1][1])
    assert t.tables[0][0] == t.tables[1][0] == t.tables[2][0]  # full block stays shared
    plan = t.append([0, 0, 1])  # now the last holder writes in place
    assert plan.copies == []


def test_exhaustion_leaves_tables_untouched():
    pool = BlockPool(3, 4)
    t = BlockTables(pool, 2)
    t.append([4, 4])
    before = ([list(x) for x in t.tables], list(t.lengths), pool.num_free)
    with pytest.raises(KVCacheExhaustedError) as err:
        t.append([5, 5])
    assert err.value.needed == 4 and err.value.free == 1
    assert ([list(x) for x in t.tables], list(t.lengths), pool.num_free) == before


def test_truncate_releases_blocks():
    pool = BlockPool(8, 4)
    t = BlockTables(pool, 2)
    t.append([9, 3])
    t.truncate([4, 3])
    assert [len(x) for x in t.tables] == [1, 1] and pool.num_free == 6
    with pytest.raises(ValueError):
        t.truncate([5, 3])


class TablesMachine(RuleBasedStateMachine):
    """Random appends, forks, truncations and releases keep ownership exact."""

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(40, 4)
        self.tables = BlockTables(self.pool, 3)

    @rule(counts=st.lists(st.integers(0, 9), min_size=3, max_size=3))
    def append(self, counts):
        counts = (counts * 8)[: self.tables.num_rows]
        free = self.pool.num_free
        try:
            self.tables.append(counts)
        except KVCacheExhaustedError:
            assert self.pool.num_free == free

    @precondition(lambda self: self.tables.num_rows > 0)
    @rule(data=st.data())
    def fork(self, data):
        n = self.tables.num_rows
        src = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=6))
        self.tables.fork_rows(src)

    @precondition(lambda self: self.tables.num_rows > 0)
    @rule(data=st.data())
    def truncate(self, data):
        lengths = [data.draw(st.integers(0, n)) for n in self.tables.lengths]
        try:
            self.tables.truncate(lengths)
        except ValueError:
            pass  # ending inside a released block is refused, before any change

    @precondition(lambda self: self.tables.num_rows > 0)
    @rule(data=st.data())
    def release_before(self, data):
        positions = [data.draw(st.integers(0, n)) for n in self.tables.lengths]
        self.tables.release_before(positions)

    @rule(rows=st.integers(1, 4))
    def restart(self, rows):
        self.tables.resize(rows)

    @invariant()
    def ownership_is_exact(self):
        held: dict[int, int] = {}
        for table, n, f in zip(self.tables.tables, self.tables.lengths, self.tables.freed):
            assert len(table) == -(-n // self.pool.block_size)
            assert table[:f] == [FREED] * f and FREED not in table[f:]
            for b in table:
                if b != FREED:
                    held[b] = held.get(b, 0) + 1
        free = self.pool.free_blocks()
        assert len(free) == len(set(free))
        assert not set(free) & set(held), "a block is both free and owned"
        for b in range(self.pool.num_blocks):
            assert self.pool.refcount(b) == held.get(b, 0)
        assert len(free) + len(held) == self.pool.num_blocks

    def teardown(self):
        self.tables.release()
        assert self.pool.num_free == self.pool.num_blocks


TestTablesMachine = TablesMachine.TestCase
TestTablesMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


def test_release_before_keeps_indices_and_refuses_to_end_in_released_block():
    pool = BlockPool(8, 4)
    t = BlockTables(pool, 2)
    t.append([10, 10])
    t.fork_rows([0, 0, 1])
    assert len(t.release_before([9, 4, 0])) == 2 + 1  # references dropped
    assert t.tables[0][:2] == [FREED, FREED] and t.tables[1][:1] == [FREED]
    assert pool.num_used == 5  # block 0 of the shared table had both holders released
    with pytest.raises(ValueError, match="released"):
        t.truncate([6, 10, 10])
    t.truncate([8, 10, 10])  # ends on a block boundary: fine
    t.release()
    assert pool.num_free == 8
