"""What the ``embckpt`` command line accepts, and the exit codes that say what went wrong: its
options' types (argparse turns a malformed value into a usage message, exit 2) and the checks
on what a parsed command names (a checkpoint directory, an output folder, a committed step),
which raise :class:`UsageError` (exit 2). The parser (cli.py) and the commands
(cli_commands.py) share them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, NoReturn

import pyarrow as pa

from embckpt.errors import EmbckptError
from embckpt.storage.fs import CheckpointStore


class UsageError(EmbckptError, ValueError):
    """A command line the user can fix: exit code 2, one line on stderr."""


EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


# -- argument types: argparse turns their ArgumentTypeError into a usage message, exit 2 --------
def _integer(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"{text!r}: must be >= {least}")
    return value


def positive_int(text: str) -> int:
    return _integer(text, 1)


def step_number(text: str) -> int:
    return _integer(text, 0)


def kill_steps(text: str) -> list[int]:
    """``10,25`` -> [10, 25]: the steps to kill the demo's workers at."""
    return [_integer(part.strip(), 1) for part in text.split(",")]


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: must be > 0")
    return value


def fraction(text: str) -> float:
    value = positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be in (0, 1]")
    return value


class PrintVersion(argparse.Action):
    """``--version``; reads the installed metadata only when asked (it costs a startup)."""

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> NoReturn:
        from importlib.metadata import PackageNotFoundError, version

        try:
            text = version("embckpt")
        except PackageNotFoundError:
            text = "unknown (not installed)"
        print(f"embckpt {text}")
        parser.exit()


# -- inputs -------------------------------------------------------------------------------------
def checkpoint_directory(args: argparse.Namespace) -> str:
    """The checkpoint directory, given as the positional DIR or as --dir (not both)."""
    given = [d for d in (args.directory, args.dir) if d is not None]
    if not given:
        raise UsageError("a checkpoint directory is needed (DIR or --dir DIR)")
    if len(given) == 2 and given[0] != given[1]:
        raise UsageError(f"two directories given: {given[0]} and --dir {given[1]}")
    directory = given[0]
    if "://" not in directory and Path(directory).exists() and not Path(directory).is_dir():
        raise UsageError(f"{directory} is not a directory (give the checkpoint directory)")
    return directory


def open_store(directory: str) -> CheckpointStore:
    """The store of ``directory``; a URI pyarrow cannot open is the user's to fix."""
    try:
        return CheckpointStore(directory)
    except pa.ArrowInvalid as exc:
        raise UsageError(f"{directory}: {exc}") from None


def output_path(path: str, what: str) -> str:
    """An output file or folder whose parent folder must already exist."""
    if "://" not in path and not Path(path).absolute().parent.is_dir():
        raise UsageError(f"{what} {path}: folder {Path(path).absolute().parent} does not exist")
    return path


def empty_exit_code(args: argparse.Namespace, store: CheckpointStore, directory: str) -> int | None:
    """The exit code when ``store`` holds no committed checkpoint (0 with ``--allow-empty``,
    else 2); None when it holds some."""
    if store.committed_steps():
        return None
    if getattr(args, "allow_empty", False):
        return EXIT_OK
    missing = "does not exist" if "://" not in directory and not Path(directory).exists() else ""
    print(
        f"embckpt {args.command}: no checkpoints found in {directory}"
        + (f" ({missing})" if missing else ""),
        file=sys.stderr,
    )
    return EXIT_USAGE


def require_committed(store: CheckpointStore, step: int | None) -> None:
    """A ``--step`` must name a committed checkpoint: another step is a usage error (exit 2).
    A directory without checkpoints is left to :func:`empty_exit_code`.

    Raises:
        UsageError: ``step`` is not committed; the message lists the committed steps.
    """
    if step is None or store.is_committed(step):
        return
    committed = store.committed_steps()
    if committed:
        raise UsageError(
            f"--step {step}: step {step} is not committed in {store.uri} "
            f"(committed steps: {', '.join(map(str, committed))})"
        )
