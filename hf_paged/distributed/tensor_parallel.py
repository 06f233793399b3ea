"""Tensor parallelism in the engine: rank 0 schedules, every rank runs the same device steps.

Transformers' own tensor parallelism (`tp_plan="auto"`) splits the model's attention heads
over the ranks; each rank's KV pool holds its own heads. Rank 0 runs the whole `LLMEngine`
and broadcasts each step's `DeviceStep` (plain lists) over a CPU (gloo) group; ranks above
0 build only a `ModelRunner` and loop in `worker_loop`, running what rank 0 sends.
"""

from __future__ import annotations

import logging
import os
import sys

import torch

logger = logging.getLogger("hf_paged")

STOP = None  # the message that ends `worker_loop`
IDLE = "idle"  # rank 0's heartbeat while it has nothing to run
HEARTBEAT_S = 60.0  # how often an idle rank 0 sends it (the group's timeout is 30 min)


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def agree_on_min(value: int, device) -> int:
    """The smallest `value` over the ranks (every rank must hold the same pool)."""
    agreed = torch.tensor([value], device=device)
    torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
    return int(agreed)


def control_group():
    """A CPU (gloo) group for step plans: an idle worker then waits in a socket, not in a
    GPU collective, and pickled plans skip the device."""
    return torch.distributed.new_group(backend="gloo")


def broadcast(message, group) -> None:
    """Rank 0: sends `message` (a DeviceStep, IDLE or STOP) to every other rank."""
    torch.distributed.broadcast_object_list([message], src=0, group=group)


def worker_loop(runner) -> None:
    """On ranks other than 0: run the steps rank 0 broadcasts until it sends STOP."""
    while True:
        box = [None]
        torch.distributed.broadcast_object_list(box, src=0, group=runner.control)
        if box[0] is STOP:
            return
        if box[0] != IDLE:
            runner.execute(box[0])


def end_group() -> None:
    """Ends this process after a step failed on rank 0 once the other ranks had started it:
    they wait in its collectives, so no later step could pair up with theirs. torchrun then
    takes the whole group down, naming this rank."""
    logger.critical("hf-paged: a tensor-parallel step failed on rank 0 after the other ranks "
                    "started it; ending the process group", exc_info=True)
    sys.stderr.flush()
    os._exit(1)
