"""Runs a function on N ranks: one process each, gloo on CPU, NCCL on CUDA, on loopback.

Used by the demo, the benchmarks and the multi-rank tests, so all three start ranks the same way.

Ranks are forked from multiprocessing's fork server, which imports torch, TorchRec and embckpt
once (``PRELOAD``): a fresh rank then starts in a fraction of a second instead of importing them
again, as a spawned one would. Each rank is still a new process with its own process group; it
gets the caller's environment of the moment (the fork server's is that of when it started) and,
as with spawn, the caller's ``sys.path``, working directory and ``__main__`` module.
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rank_device(rank: int) -> torch.device:
    """The device a rank trains on: its own GPU where there are GPUs, else the CPU."""
    if torch.cuda.is_available():
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


# Imported once by the fork server (a module missing here is imported by each rank instead).
PRELOAD = (
    "torch",
    "torch.distributed",
    "torchrec",
    "torchrec.distributed",
    "torchrec.models.dlrm",
    "embckpt.checkpointer",
    __name__,
)


def rank_context() -> Any:
    """The multiprocessing context ranks start from: the fork server, preloading ``PRELOAD``.

    The fork server is one per process and reads its preload list when it starts, so the list
    is set on every call: whoever starts the server first decides what it imports.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def _worker(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple,
    results: Any,
    environ: dict[str, str],
) -> None:
    os.environ.clear()  # the caller's environment, not the one the fork server started with
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)  # one thread per rank: the ranks share the machine's cores
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        results.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class RankFailed(RuntimeError):
    """A rank raised or died; the message holds its traceback or exit code."""


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 600.0
) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes (forked from the
    fork server, see the module's docstring).

    ``fn`` must be importable (a module-level function) and return something picklable.

    Returns:
        Each rank's return value, by rank.

    Raises:
        RankFailed: a rank raised (its traceback is in the message), died, or timed out.
    """
    ctx = rank_context()
    results = ctx.Queue()
    port = free_port()
    environ = dict(os.environ)
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, world_size, port, fn, args, results, environ),
            daemon=False,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    outputs: dict[int, Any] = {}
    failures: list[str] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(outputs) < world_size and not failures:
            try:
                rank, ok, value = results.get(timeout=0.5)
            except queue.Empty:
                # A rank that died without reporting (killed, crashed) fails the run at once.
                dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead and results.empty():
                    failures.append(f"ranks died: {dead} (rank, exit code)")
                elif time.monotonic() > deadline:
                    failures.append(f"no result within {timeout_s}s")
                continue
            if ok:
                outputs[rank] = value
            else:
                failures.append(f"rank {rank}:\n{value}")
    finally:
        for proc in procs:
            proc.join(timeout=1 if failures else 60)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if failures:
        raise RankFailed("\n".join(failures))
    return [outputs[rank] for rank in range(world_size)]
