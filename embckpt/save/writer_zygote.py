"""A preloaded process that forks the writer processes of every rank one launcher starts.

Why: a writer process started as a fresh interpreter (``save/writer_process.py``) imports torch
and the codecs and loads their kernels before it can write: about 1.5 s of CPU each time, for
every rank, every ``Checkpointer`` and every restart after a writer died. Ranks started by one
process on one host (``embckpt.examples.launcher.run_ranks``, or a user's own launcher) can
share that work: the zygote imports the writer and loads the codecs' kernels once, at its first
request, then forks one child per request. Each child becomes the writer process of the rank
that asked, with nothing of that rank in it (no thread, no CUDA context, no lock), as a fresh
interpreter would be; its pages are shared with the zygote's until written. ``multiprocessing``'s
fork server is not this: it is private to the process that starts it, and runs the parent's
``__main__`` module in every child.

The zygote stays single-threaded (a fork copies only the calling thread), imports nothing heavy
before it is asked (a launcher whose ranks write with threads pays for an idle interpreter
only), and exits when the launcher that started it does (its stdin closes).

Protocol, on a Unix socket in a folder only this user can open: a rank connects and sends
``fork <its pid> <size>``, then ``size`` bytes of JSON (what a child of the rank would inherit:
environment, working directory, import path, niceness, umask), with four descriptors (the
connection to the rank, the slab memory, the rank's stdout and stderr); the zygote answers
``pid N`` and, when that child ends, ``exit CODE`` (negative: killed by that signal). One
connection per child: it carries the child's exit status to the rank that owns it.
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any

ZYGOTE_ENV = "EMBCKPT_WRITER_ZYGOTE"
"""The environment variable that gives ranks the zygote's socket."""

_CONNECT_S = 10.0  # the zygote binds its socket a moment after it starts
_FORK_S = 120.0  # the first request waits for the zygote's imports

_started: dict[str, str] = {}  # this launcher's zygote: ZYGOTE_ENV -> its socket
_starting = threading.Lock()


def start_writer_zygote() -> dict[str, str]:
    """Starts this process's writer zygote (once); returns the environment its ranks need
    (``{EMBCKPT_WRITER_ZYGOTE: socket}``). Ranks started with it fork their writer processes
    from the zygote; ranks started without it start fresh interpreters."""
    with _starting:
        if not _started:
            _start()
        return dict(_started)


def interpreter_env() -> dict[str, str]:
    """The environment of a fresh interpreter that imports what this process imports: this
    process's, with its import path as ``PYTHONPATH``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
    return env


def _start() -> None:
    folder = tempfile.mkdtemp(prefix="embckpt-writers-")  # mode 0700: this user's only
    path = os.path.join(folder, "zygote.sock")
    proc = subprocess.Popen(
        [sys.executable, "-m", "embckpt.save.writer_zygote", path],
        stdin=subprocess.PIPE,
        env=interpreter_env(),
    )
    atexit.register(_stop_zygote, proc, folder, os.getpid())
    _started[ZYGOTE_ENV] = path


def _stop_zygote(proc: subprocess.Popen[bytes], folder: str, starter: int) -> None:
    if os.getpid() != starter:  # a forked child of the launcher leaves the zygote alone
        return
    assert proc.stdin is not None
    proc.stdin.close()  # the zygote reads its end and exits; its children live on
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    shutil.rmtree(folder, ignore_errors=True)


# -- the rank's side ---------------------------------------------------------------------------
class ForkedProcess:
    """A writer process the zygote forked, as ``subprocess.Popen`` answers for its child:
    ``pid``, ``poll``, ``wait`` and ``kill`` (its exit status comes from the zygote)."""

    def __init__(self, sock: socket.socket, pid: int) -> None:
        self._sock = sock
        self._lock = threading.Lock()  # one reader of the socket at a time
        self.pid = pid
        self.returncode: int | None = None
        try:  # signals reach this child even once its pid is reused (the zygote reaps it)
            self._pidfd: int | None = os.pidfd_open(pid)
        except (AttributeError, OSError):
            self._pidfd = None

    def __del__(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._read(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"writer process {self.pid}", timeout or 0.0)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is not None:
            return
        try:
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            else:
                os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _read(self, timeout: float | None) -> None:
        """Reads the child's exit status if it comes within ``timeout``; a zygote that is gone
        leaves it unknown (None)."""
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            return  # another thread reads it
        try:
            if self.returncode is not None or self._sock.fileno() < 0:
                return
            self._sock.settimeout(timeout)
            try:
                line = _read_line(self._sock)
            except (EOFError, OSError):  # not yet (a timeout), or the zygote is gone: unknown
                return
            if line.startswith("exit "):
                self.returncode = int(line.split()[1])
                self._sock.close()
        finally:
            self._lock.release()


def fork_writer(path: str, fds: tuple[int, int]) -> ForkedProcess:
    """Asks the zygote at ``path`` for a writer process that serves ``fds`` (the connection to
    this rank, the slab memory). Raises ``OSError`` if the zygote cannot be reached or does
    not answer."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    deadline = time.monotonic() + _CONNECT_S
    while True:
        try:
            sock.connect(path)
            break
        except FileNotFoundError:  # not started yet (refused: it has ended)
            if time.monotonic() > deadline:
                sock.close()
                raise
            time.sleep(0.02)
    try:
        payload = json.dumps(_inherited()).encode()
        head = f"fork {os.getpid()} {len(payload)}\n".encode()
        socket.send_fds(sock, [head + payload], [*fds, 1, 2])  # and where it writes
        sock.settimeout(_FORK_S)
        line = _read_line(sock)
        if not line.startswith("pid "):
            raise OSError(f"the writer zygote at {path} answered {line!r}")
    except BaseException:
        sock.close()
        raise
    return ForkedProcess(sock, int(line.split()[1]))


def _inherited() -> dict[str, Any]:
    """What a child of this rank inherits, which the zygote's child takes in its place: the
    environment (credentials, settings), working directory, import path, niceness and umask
    (its stdout and stderr go with the descriptors)."""
    umask = None
    try:
        with open("/proc/self/status") as status:  # read without setting it (threads)
            umask = next((int(x.split()[1], 8) for x in status if x.startswith("Umask:")), None)
    except OSError:
        pass
    return {
        "env": dict(os.environ),
        "cwd": os.getcwd(),
        "path": list(sys.path),
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "umask": umask,
    }


def _take(inherited: dict[str, Any], stdio: list[int]) -> None:
    for target, fd in zip((1, 2), stdio, strict=True):  # the rank's stdout and stderr
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(inherited["env"])
    os.chdir(inherited["cwd"])
    sys.path[:] = inherited["path"]
    os.setpriority(os.PRIO_PROCESS, 0, inherited["nice"])
    if inherited["umask"] is not None:
        os.umask(inherited["umask"])


def _read_line(sock: socket.socket) -> str:
    """One line of the protocol (byte by byte: an exit line may follow a pid line)."""
    out = bytearray()
    while not out.endswith(b"\n"):
        byte = sock.recv(1)
        if not byte:
            raise EOFError("the writer zygote closed the connection")
        out += byte
    return out.decode().strip()


# -- the zygote --------------------------------------------------------------------------------
class _Zygote:
    def __init__(self, path: str) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(f"{path}.binding")
        self.listener.listen(64)
        os.rename(f"{path}.binding", path)  # the path appears listening: refused means gone
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler: the wakeup fd is written
        signal.set_wakeup_fd(self.wake_w)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.selector.register(sys.stdin.fileno(), selectors.EVENT_READ, "launcher")
        self.selector.register(self.wake_r, selectors.EVENT_READ, "child")
        self.children: dict[int, socket.socket] = {}  # pid -> the connection of its rank
        self.ready = False

    def serve(self) -> None:
        while True:
            for key, _ in self.selector.select():
                if key.data == "launcher":
                    return
                if key.data == "accept":
                    conn, _ = self.listener.accept()
                    self.selector.register(conn, selectors.EVENT_READ, "request")
                elif key.data == "child":
                    self._reap()
                else:
                    self._request(key.fileobj)  # type: ignore[arg-type]

    def _request(self, conn: socket.socket) -> None:
        self.selector.unregister(conn)
        fds: list[int] = []
        try:
            conn.settimeout(_CONNECT_S)  # a request comes whole at once: never wait long
            data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 4)
            head, _, payload = data.partition(b"\n")
            kind, rank_pid, size = head.decode().split()
            if kind != "fork" or len(fds) != 4:
                raise ValueError(f"not a request: {head!r}")
            while len(payload) < int(size):
                chunk = conn.recv(int(size) - len(payload))
                if not chunk:
                    raise EOFError("the request ended early")
                payload += chunk
            inherited = json.loads(payload)
            conn.settimeout(None)
        except (OSError, ValueError, EOFError):
            for fd in fds:
                os.close(fd)
            conn.close()
            return
        self._preload()
        pid = os.fork()
        if pid == 0:
            self._child(conn, fds, int(rank_pid), inherited)
        for fd in fds:
            os.close(fd)
        try:
            conn.sendall(f"pid {pid}\n".encode())
        except OSError:
            pass
        self.children[pid] = conn

    def _preload(self) -> None:
        """The writer and the codecs' kernels, imported and loaded at the first request (if
        that fails, each child imports and loads what it needs, as a fresh interpreter)."""
        if self.ready:
            return
        self.ready = True
        try:
            self._import()
        except Exception:
            traceback.print_exc()

    @staticmethod
    def _import() -> None:
        from embckpt.codecs import precompile
        from embckpt.save import writer_worker  # noqa: F401  (what every child runs)

        precompile.load_kernels()

    def _child(
        self, conn: socket.socket, fds: list[int], rank_pid: int, inherited: dict[str, Any]
    ) -> None:
        """In the forked child: drops the zygote's descriptors and handlers, takes what a
        child of the rank would inherit, then serves."""
        code = 0
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            held = [k.fileobj for k in self.selector.get_map().values()]
            self.selector.close()
            for sock in (conn, *self.children.values(), *held):
                if isinstance(sock, socket.socket):
                    sock.close()
            os.close(self.wake_r)
            os.close(self.wake_w)
            os.close(sys.stdin.fileno())
            _take(inherited, fds[2:])
            from embckpt.save import writer_worker

            writer_worker.serve(fds[0], fds[1], rank_pid)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    def _reap(self) -> None:
        try:
            while os.read(self.wake_r, 512):
                pass
        except BlockingIOError:
            pass
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass
                conn.close()


def main(argv: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher handles Ctrl-C
    _Zygote(argv[1]).serve()


if __name__ == "__main__":
    main(sys.argv)
