"""Runs a function on N ranks: one process each, gloo on CPU, NCCL on CUDA, on loopback.

Used by the demo, the benchmarks and the multi-rank tests, so all three start ranks the same way.

Ranks are forked from multiprocessing's fork server, which imports torch, TorchRec and embckpt
once (``PRELOAD``, and the modules a caller names with :func:`preload_in_ranks`: a test suite's
helpers) and loads the codecs' kernels (``codecs/preload.py``): a fresh rank then
starts in a fraction of a second instead of importing and loading them again, as a spawned one
would. Each rank is still a new process with its own process group. It gets what a spawned
rank inherits from its caller at the moment it starts, where a forked one would take the fork
server's instead (:class:`_Inheritance`): the environment and the stdout and stderr descriptors
(a test's output capture, a redirection); multiprocessing itself gives it the caller's
``sys.path``, working directory and ``__main__`` module.

Their writer processes (``CheckpointConfig.writer``) are forked from one writer zygote the
launcher starts (``embckpt.start_writer_zygote``), which imports the writer once for every
rank of every launch, instead of each starting a fresh interpreter.

Where CUDA is available, ranks are spawned instead: CUDA cannot start in a process forked from
one that asked for it, and importing ``fbgemm_gpu`` asks (``torch.cuda.is_available()``).

The ranks of one launch meet through a file in a folder of the caller's (a ``FileStore``),
removed when the launch ends: launches running side by side (parallel tests) never meet each
other's ranks, as they could through a TCP port chosen free a moment before.
"""

from __future__ import annotations

import os
import queue
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing import reduction
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import embckpt


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
    "embckpt.codecs.preload",  # the codecs' kernels loaded, scikit-learn imported
)
_also_preloaded: list[str] = []


def preload_in_ranks(*modules: str) -> None:
    """Has the fork server import ``modules`` too, besides ``PRELOAD``: the modules a caller's
    rank functions need (a test suite's helpers, ``pytest``), which every rank would otherwise
    import again. Takes effect when the fork server starts (the first launch of a process)."""
    _also_preloaded.extend(m for m in modules if m not in _also_preloaded)


def rank_context() -> Any:
    """The multiprocessing context ranks start from: the fork server, preloading ``PRELOAD``;
    spawn where CUDA is available (see the module's docstring).

    The fork server is one per process and reads its preload list when it starts, so the list
    is set on every call: whoever starts the server first decides what it imports.
    """
    if torch.cuda.is_available():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*PRELOAD, *_also_preloaded])
    return ctx


class _Inheritance:
    """The caller's environment and stdout and stderr descriptors, sent with a rank as it starts
    and put in place of the fork server's by :meth:`apply`."""

    def __init__(
        self, environ: dict[str, str], stdio: tuple[int | None, int | None] = (None, None)
    ) -> None:
        self.environ = environ
        self.stdio = stdio  # in the rank: descriptors to make its 1 and 2 (None: keep)

    @classmethod
    def of_caller(cls) -> _Inheritance:
        return cls(dict(os.environ))

    def __reduce__(self) -> tuple[Any, ...]:
        # Called while the rank starts: DupFd sends the descriptors along with it.
        sent = [reduction.DupFd(fd) if _is_open(fd) else None for fd in (1, 2)]
        return (_arrive, (self.environ, sent))

    def apply(self) -> None:
        os.environ.clear()
        os.environ.update(self.environ)
        for target, stream, fd in ((1, sys.stdout, self.stdio[0]), (2, sys.stderr, self.stdio[1])):
            if fd is not None and fd != target:  # a spawned rank has them under their numbers
                if stream is not None:
                    stream.flush()
                os.dup2(fd, target)
                os.close(fd)


def _arrive(environ: dict[str, str], sent: list[Any]) -> _Inheritance:
    out, err = (None if s is None else s.detach() for s in sent)
    return _Inheritance(environ, (out, err))


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _worker(
    rank: int,
    world_size: int,
    port: int,
    rendezvous: str,
    fn: Callable[..., Any],
    args: tuple,
    results: Any,
    inheritance: _Inheritance,
) -> None:
    inheritance.apply()
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)  # one thread per rank: the ranks share the machine's cores
    np.random.seed()  # fresh entropy, as a spawned rank had: a fork copies the server's state
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    try:
        # The ranks meet through a file of the caller's, not the port: a port free a moment ago
        # can be taken meanwhile by another launch (parallel tests), whose ranks would then
        # meet these. MASTER_PORT stays set for code that reads it.
        dist.init_process_group(
            backend, init_method=f"file://{rendezvous}", rank=rank, world_size=world_size
        )
        if backend == "gloo":
            # Every rank's connections are up before any rank goes on: a rank whose function
            # returns at once would otherwise close its group while a peer still connects to
            # it, and that peer's init fails ("Connection closed by peer", seen once here).
            dist.barrier()
        results.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class RankFailed(RuntimeError):
    """A rank raised or died; the message holds its traceback or exit code."""


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 600.0,
    spawn: bool = False,
) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes (forked from the
    fork server, see the module's docstring; ``spawn=True``: fresh interpreters that preload
    nothing, as ``torchrun`` starts ranks).

    ``fn`` must be importable (a module-level function) and return something picklable.

    Returns:
        Each rank's return value, by rank.

    Raises:
        RankFailed: a rank raised (its traceback is in the message), died, or timed out.
    """
    ctx = mp.get_context("spawn") if spawn else rank_context()
    results = ctx.Queue()
    port = free_port()
    inheritance = _Inheritance.of_caller()
    if not spawn:  # writer processes forked from one zygote (a spawned rank starts its own)
        inheritance.environ.update(embckpt.start_writer_zygote())
    folder = tempfile.TemporaryDirectory(prefix="embckpt-ranks-")
    rendezvous = os.path.join(folder.name, "rendezvous")
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, world_size, port, rendezvous, fn, args, results, inheritance),
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
        folder.cleanup()
    if failures:
        raise RankFailed("\n".join(failures))
    return [outputs[rank] for rank in range(world_size)]
