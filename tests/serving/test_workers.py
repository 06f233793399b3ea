"""The server's worker threads (hf_paged/serving/workers.py): results and errors reach the
awaiting coroutine, a caller that leaves before its job starts cancels it, and `fail` ends
what is queued or running, refuses new work and lets the (daemon) threads end."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from hf_paged.errors import APIError
from hf_paged.serving.workers import Workers


def threads_named(prefix: str) -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(prefix)]


def test_workers_run_fail_and_end():
    release, started = threading.Event(), []

    def slow(i):
        started.append(i)
        release.wait(10)
        return i

    async def main():
        workers = Workers(2, "test-workers")
        assert await workers.run(lambda x: x + 1, 1) == 2
        with pytest.raises(ZeroDivisionError):
            await workers.run(lambda: 1 / 0)
        jobs = [asyncio.ensure_future(workers.run(slow, i)) for i in range(4)]
        await asyncio.sleep(0.2)
        assert sorted(started) == [0, 1] and len(threads_named("test-workers")) == 2
        jobs[3].cancel()  # its caller leaves while it waits for a thread
        workers.fail(APIError(503, "closing"))
        for job in jobs[:3]:  # running (0, 1) or queued (2): all end with the error
            with pytest.raises(APIError, match="closing"):
                await job
        with pytest.raises(APIError, match="closing"):
            await workers.run(lambda: 0)  # refused
        release.set()

    asyncio.run(main())
    deadline = time.time() + 10
    while threads_named("test-workers") and time.time() < deadline:
        time.sleep(0.02)
    assert threads_named("test-workers") == [] and sorted(started) == [0, 1]
