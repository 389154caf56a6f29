"""``embckpt`` command line: demo | inspect | verify | report | merge | restore | export | unlock
| follow | keygen.

Exit codes, one rule for every command:

* 0 - success. ``inspect`` and ``report`` describe what they can read and list what they
  cannot (``unreadable_manifests``): they succeed on damaged checkpoints; ``verify`` is the check.
* 1 - the command ran and failed: a check found a problem (``verify``, ``restore``), the
  checkpoint is corrupt or incomplete (a file missing, truncated or altered, a link of its chain
  missing) so ``merge``, ``restore`` or ``export`` could not be done, or something else stopped
  it (another job holds the directory, a file could not be read or written); the demo failed.
* 2 - bad usage: the command line cannot be run as given: a malformed or missing argument, a
  checkpoint directory that is missing or holds no checkpoint (``--allow-empty``: 0), a file
  given for a directory, a ``--step`` that is not a committed checkpoint, an output folder that
  does not exist, a URI pyarrow cannot open, a bad setting (``demo --config``, ``--policy``).

Failures and usage errors are one line on stderr, never a traceback. ``--help``, ``inspect``,
``verify`` and ``unlock`` never import torch: they start in a fraction of a second on a machine
without a GPU.

``inspect --json`` prints one object (``?`` marks a value that may be null)::

    schema_version: int               1; fields are only ever added
    directory: str
    checkpoints: list, oldest first, of
        step: int, kind: "full" | "diff", policy: str, parent_step: int?, base_step: int,
        world_size: int, files: int, bytes: int, codec: str (the row codec's id)
    tables: list (as of the latest checkpoint) of
        name: str, rows: int, cols: int, dtype: str, sharding_type: str, states: list[str],
        shards: list of {rank, row_offset, col_offset, rows, cols: int}
    unreadable_manifests: list of {path: str, reason: str}
    leftovers: list of {step: int, path: str}   step folders without a manifest

``verify --json`` prints one object::

    schema_version: int               1; fields are only ever added
    directory: str
    step: int?                        the --step asked for; null: every checkpoint
    ok: bool                          no problem found (the exit code is 0 when true)
    checked: list[int]                steps checked
    files_checked: int
    problems: list of {path: str, reason: str}
    leftovers: list of {step: int, path: str}

``follow --json`` prints one object per applied step (one line each)::

    step: int, previous: int?, path: list[int] (the checkpoints read, in order),
    rewound: bool (back to the chain's full in memory first), bytes_read: int,
    checkpoint_bytes: int (the step's own files), freshness_s: float (from its manifest's
    write to its rows served), seconds: float (the update's own time)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from embckpt.cli_args import (
    EXIT_FAILED,
    EXIT_USAGE,
    PrintVersion,
    UsageError,
    fraction,
    kill_steps,
    positive_float,
    positive_int,
    step_number,
)
from embckpt.cli_commands import (
    SCHEMA_VERSION,
    demo_command,
    export_command,
    follow_command,
    inspect_command,
    keygen_command,
    merge_command,
    report_command,
    restore_command,
    unlock_command,
    verify_command,
)
from embckpt.errors import ConfigError, EmbckptError
from embckpt.report.projection import parse_duration, parse_size

__all__ = [
    "CODEC_NAMES",
    "POLICY_NAMES",
    "SCHEMA_VERSION",
    "UsageError",
    "build_parser",
    "main",
]

# Listed in --help only: the registries (embckpt.policy.POLICIES and the codec registry) are
# what accepts a name, and tests/test_cli.py checks these lists against them.
POLICY_NAMES = ("full", "one_shot", "incremental", "intermittent")
CODEC_NAMES = (
    "raw",
    "fp16",
    "bf16",
    "symmetric",
    "asymmetric",
    "adaptive",
    "kmeans",
    "exponent",
    "delta",
    "log8",
)


# -- parser -------------------------------------------------------------------------------------
def _command(
    sub: Any, name: str, func: Callable[[argparse.Namespace], int], text: str
) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = sub.add_parser(name, help=text, description=text)
    parser.set_defaults(func=func)
    return parser


def _directory_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "directory", nargs="?", metavar="DIR", help="checkpoint directory (local path or URI)"
    )
    parser.add_argument("--dir", metavar="DIR", help="the checkpoint directory, as an option")


def _allow_empty(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--allow-empty",
        action="store_true",
        help="exit 0 when DIR holds no checkpoint (default: exit 2, 'no checkpoints found')",
    )


def _json_output(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json", action="store_true", help="one JSON object (schema: embckpt/cli.py)"
    )


def _key_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--key",
        action="append",
        metavar="PUBLIC.pem",
        help="trust only checkpoints signed by this key (repeat for several: rotation)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="embckpt",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog=(
            "exit codes, for every command: 0 success; 1 the command failed (a check found a "
            "problem, the checkpoint is corrupt or incomplete, a merge, restore or export could "
            "not be done); 2 bad usage (a malformed argument; a directory, --step or output "
            "folder that does not exist)"
        ),
    )
    parser.add_argument(
        "--version", action=PrintVersion, nargs=0, help="print the version and exit"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = _command(sub, "demo", demo_command, "train the reference DLRM, kill it, restore, finish")
    demo.add_argument(
        "--config",
        default=None,
        help="DemoConfig YAML file (default: the package's own, embckpt/examples/demo.yaml)",
    )
    demo.add_argument("--out", default="demo_out", help="checkpoint directory (demo_out)")
    demo.add_argument("--steps", type=positive_int, default=None, help="training steps")
    demo.add_argument(
        "--world-size", type=positive_int, default=None, help="ranks (default: the config's, 2)"
    )
    demo.add_argument(
        "--kill-at", type=kill_steps, default=None, metavar="S1,S2", help="steps to kill workers at"
    )
    demo.add_argument(
        "--failures", type=positive_int, default=None, help="kill at N random steps instead"
    )
    demo.add_argument(
        "--policy", default=None, help=f"override the config's policy: {', '.join(POLICY_NAMES)}"
    )
    demo.add_argument(
        "--codec", default=None, help=f"override the config's row codec: {', '.join(CODEC_NAMES)}"
    )
    demo.add_argument(
        "--bits", type=int, choices=(2, 3, 4, 8), default=None, help="override the code width"
    )

    merge = _command(
        sub, "merge", merge_command, "fold a checkpoint's chain into one full checkpoint"
    )
    _directory_arguments(merge)
    merge.add_argument("--step", type=step_number, required=True, help="the checkpoint to fold")

    inspect = _command(
        sub, "inspect", inspect_command, "list checkpoints, tables, shards and leftovers"
    )
    _directory_arguments(inspect)
    _json_output(inspect)
    _allow_empty(inspect)

    check = _command(
        sub, "verify", verify_command, "check sizes, checksums and chains; exit 1 if bad"
    )
    _directory_arguments(check)
    check.add_argument(
        "--step", type=step_number, default=None, help="only this checkpoint and its chain"
    )
    _json_output(check)
    _allow_empty(check)
    _key_argument(check)

    follow = _command(
        sub, "follow", follow_command, "serve the newest checkpoint, applying each new one"
    )
    _directory_arguments(follow)
    follow.add_argument(
        "--interval", type=positive_float, default=1.0, help="seconds between polls (1)"
    )
    follow.add_argument("--once", action="store_true", help="poll once, then exit")
    follow.add_argument(
        "--until-step", type=step_number, default=None, help="exit once this step is served"
    )
    follow.add_argument(
        "--export", metavar="safetensors:PATH", help="write each applied step's tables to PATH"
    )
    follow.add_argument("--device", default="cpu", help="where the tables live (cpu)")
    _json_output(follow)
    _key_argument(follow)

    keygen = _command(
        sub, "keygen", keygen_command, "write an Ed25519 key pair for signed checkpoints"
    )
    keygen.add_argument("private", metavar="PRIVATE.pem", help="the signing key (for the writer)")
    keygen.add_argument("public", metavar="PUBLIC.pem", help="the verify key (for readers)")

    report = _command(sub, "report", report_command, "what each checkpoint cost and saved")
    _directory_arguments(report)
    report.add_argument(
        "--json", action="store_true", help="JSON (schema: embckpt/report/build.py)"
    )
    report.add_argument("--plot", metavar="OUT.png", help="write the figures as a PNG")
    report.add_argument("--html", metavar="OUT.html", help="write a self-contained HTML page")
    report.add_argument(
        "--project", action="store_true", help="project costs for a model of --model-bytes"
    )
    report.add_argument(
        "--model-bytes", type=parse_size, default=None, help="full fp32 model size, e.g. 2TB"
    )
    report.add_argument(
        "--interval", type=parse_duration, default=1800.0, help="checkpoint interval (30m)"
    )
    report.add_argument("--days", type=positive_float, default=30.0, help="training days (30)")
    report.add_argument(
        "--touch-rate",
        type=fraction,
        default=None,
        help="share of rows a diff writes, in (0, 1] (default: measured)",
    )
    report.add_argument(
        "--no-progress", dest="progress", action="store_false", help="no progress line"
    )

    restore = _command(
        sub, "restore", restore_command, "show a checkpoint's chain, verify it, print how to resume"
    )
    _directory_arguments(restore)
    restore.add_argument("--step", type=step_number, default=None, help="default: the latest")

    export = _command(
        sub, "export", export_command, "write a checkpoint as a DCP directory or a safetensors file"
    )
    export.add_argument("directory", metavar="DIR", help="checkpoint directory")
    export.add_argument("--step", type=step_number, default=None, help="default: the latest")
    export.add_argument("--to", choices=("dcp", "safetensors"), required=True, help="output format")
    export.add_argument("out", help="the DCP directory or the .safetensors file to write")
    export.add_argument(
        "--tables-only",
        action="store_true",
        help="safetensors: only the tables, keyed as in an EmbeddingBagCollection",
    )
    export.set_defaults(dir=None)

    unlock = _command(
        sub, "unlock", unlock_command, "remove a directory's lock, left by a job known to be gone"
    )
    _directory_arguments(unlock)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # exits EXIT_USAGE on a malformed argument
    try:
        return int(args.func(args))
    except (UsageError, ConfigError) as exc:  # the command line, or a setting it gives
        print(f"embckpt {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (EmbckptError, OSError) as exc:  # corrupt or incomplete data, a lock, a failed I/O
        print(f"embckpt {args.command}: {exc}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
