"""``embckpt`` command line: demo | inspect | verify | report | merge | restore | export | unlock.

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
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import pyarrow as pa

from embckpt.errors import ConfigError, EmbckptError
from embckpt.report.build import build_report, format_table
from embckpt.report.projection import format_projection, parse_duration, parse_size, project
from embckpt.storage.chain import load_manifests
from embckpt.storage.fs import CheckpointStore
from embckpt.storage.verify import verify

SCHEMA_VERSION = 1
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


def _positive_int(text: str) -> int:
    return _integer(text, 1)


def _step(text: str) -> int:
    return _integer(text, 0)


def _steps(text: str) -> list[int]:
    """``10,25`` -> [10, 25]: the steps to kill the demo's workers at."""
    return [_integer(part.strip(), 1) for part in text.split(",")]


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: must be > 0")
    return value


def _fraction(text: str) -> float:
    value = _positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be in (0, 1]")
    return value


class _Version(argparse.Action):
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
def _directory(args: argparse.Namespace) -> str:
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


def _store(directory: str) -> CheckpointStore:
    """The store of ``directory``; a URI pyarrow cannot open is the user's to fix."""
    try:
        return CheckpointStore(directory)
    except pa.ArrowInvalid as exc:
        raise UsageError(f"{directory}: {exc}") from None


def _output(path: str, what: str) -> str:
    """An output file or folder whose parent folder must already exist."""
    if "://" not in path and not Path(path).absolute().parent.is_dir():
        raise UsageError(f"{what} {path}: folder {Path(path).absolute().parent} does not exist")
    return path


def _empty(args: argparse.Namespace, store: CheckpointStore, directory: str) -> int | None:
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


def _committed(store: CheckpointStore, step: int | None) -> None:
    """A ``--step`` must name a committed checkpoint: another step is a usage error (exit 2).
    A directory without checkpoints is left to :func:`_empty`.

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


def _leftovers(store: CheckpointStore, steps: list[int]) -> list[dict[str, Any]]:
    return [{"step": step, "path": store.step_path(step)} for step in steps]


# -- commands -----------------------------------------------------------------------------------
def _inspect(args: argparse.Namespace) -> int:
    directory = _directory(args)
    store = _store(directory)
    manifests, problems = load_manifests(store)
    leftovers = store.leftover_steps()
    latest = manifests[max(manifests)] if manifests else None
    if args.json:
        doc = {
            "schema_version": SCHEMA_VERSION,
            "directory": directory,
            "checkpoints": [
                {
                    "step": step,
                    "kind": m.kind,
                    "policy": m.policy,
                    "parent_step": m.parent_step,
                    "base_step": m.base_step,
                    "world_size": m.world_size,
                    "files": m.file_count,
                    "bytes": m.total_bytes,
                    "codec": m.codec["id"],
                }
                for step, m in sorted(manifests.items())
            ],
            "tables": [
                {
                    "name": t.name,
                    "rows": t.rows,
                    "cols": t.cols,
                    "dtype": t.dtype,
                    "sharding_type": t.sharding_type,
                    "states": [*t.row_states, *t.elem_states],
                    "shards": [
                        dict(
                            zip(
                                ("rank", "row_offset", "col_offset", "rows", "cols"), s, strict=True
                            )
                        )
                        for s in t.shards
                    ],
                }
                for t in (latest.tables if latest else ())
            ],
            "unreadable_manifests": [{"path": p, "reason": r} for p, r in problems],
            "leftovers": _leftovers(store, leftovers),
        }
        print(json.dumps(doc, indent=1))
        empty = _empty(args, store, directory)
        return 0 if empty is None else empty
    for step, manifest in sorted(manifests.items()):
        parent = "-" if manifest.parent_step is None else manifest.parent_step
        print(
            f"step {step}: {manifest.kind} (policy {manifest.policy}, parent {parent}, "
            f"base {manifest.base_step}), {manifest.file_count} files, "
            f"{manifest.total_bytes:,} bytes, {manifest.world_size} ranks, "
            f"codec {manifest.codec['id']}"
        )
    if latest is not None:
        print("tables (as of the latest checkpoint):")
        for table in latest.tables:
            shards = ", ".join(
                f"rank {r}: rows {ro}+{nr} cols {co}+{nc}" for r, ro, co, nr, nc in table.shards
            )
            states = list(table.row_states + table.elem_states)
            print(
                f"  {table.name}: {table.rows} x {table.cols} {table.dtype}, "
                f"{table.sharding_type}, states {states}; {shards}"
            )
    for path, reason in problems:
        print(f"unreadable manifest {path}: {reason}")
    for step in leftovers:
        print(f"leftover {store.step_path(step)} (no manifest: not a checkpoint)")
    empty = _empty(args, store, directory)
    if empty == 0 and latest is None:
        print(f"{directory}: no committed checkpoint")
    return 0 if empty is None else empty


def _verify(args: argparse.Namespace) -> int:
    directory = _directory(args)
    store = _store(directory)
    _committed(store, args.step)
    report = verify(store, args.step)
    if args.json:
        doc = {
            "schema_version": SCHEMA_VERSION,
            "directory": directory,
            "step": args.step,
            "ok": report.ok,
            "checked": report.checked,
            "files_checked": report.files_checked,
            "problems": [{"path": p, "reason": r} for p, r in report.problems],
            "leftovers": _leftovers(store, report.leftovers),
        }
        print(json.dumps(doc, indent=1))
    else:
        for step in report.leftovers:
            print(f"leftover {store.step_path(step)}: no manifest, ignored")
        for path, reason in report.problems:
            print(f"BAD {path}: {reason}")
    empty = _empty(args, store, directory)
    if empty is not None:
        return empty
    if args.json:
        return EXIT_OK if report.ok else EXIT_FAILED
    steps = ", ".join(map(str, report.checked)) or "none"
    if report.ok:
        checked = f"{len(report.checked)} checkpoints ({steps}), {report.files_checked} files"
        print(f"OK: {checked} checked")
        return EXIT_OK
    print(f"FAILED: {len(report.problems)} problems; first bad file: {report.problems[0][0]}")
    return EXIT_FAILED


def _report(args: argparse.Namespace) -> int:
    directory = _directory(args)
    if args.project and args.model_bytes is None:
        raise UsageError("--project needs --model-bytes (e.g. 2TB)")
    for path, what in ((args.plot, "--plot"), (args.html, "--html")):
        if path is not None:
            _output(path, what)
    store = _store(directory)
    report = build_report(store, progress=None if args.progress else False)
    if args.project or args.model_bytes is not None:
        report["projection"] = project(
            report, args.model_bytes, args.interval, args.days, args.touch_rate
        )
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(format_table(report))
        if "projection" in report:
            projection = report["projection"]
            print()
            print(format_projection(projection) if projection else "projection: nothing measured")
    # With --json, stdout holds only the JSON.
    say = sys.stderr if args.json else sys.stdout
    if args.plot or args.html:
        from embckpt.report.html import write_html
        from embckpt.report.plots import render_png

        png = render_png(report)
        if args.plot:
            with open(args.plot, "wb") as out:
                out.write(png)
            print(f"wrote {args.plot} ({len(png):,} bytes)", file=say)
        if args.html:
            size = write_html(report, png, args.html)
            print(f"wrote {args.html} ({size:,} bytes, self-contained)", file=say)
    return 0


def _merge(args: argparse.Namespace) -> int:
    from embckpt.read.merge import merge

    directory = _directory(args)
    store = _store(directory)
    empty = _empty(args, store, directory)
    if empty is not None:
        return empty
    _committed(store, args.step)
    manifest = merge(store, args.step)
    sources = manifest.stats.get("merged_from", [args.step])
    print(
        f"step {args.step}: self-contained full checkpoint of {manifest.file_count} files, "
        f"{manifest.total_bytes:,} bytes (folded from steps {sources})"
    )
    return 0


def _restore(args: argparse.Namespace) -> int:
    from embckpt.cli_restore import describe_restore

    directory = _directory(args)
    store = _store(directory)
    empty = _empty(args, store, directory)
    if empty is not None:
        return empty
    _committed(store, args.step)
    text, ok = describe_restore(directory, args.step)
    print(text)
    return EXIT_OK if ok else EXIT_FAILED


def _export(args: argparse.Namespace) -> int:
    from embckpt.read.export import export_dcp, export_safetensors

    directory = _directory(args)
    out = _output(args.out, "output")
    store = _store(directory)
    empty = _empty(args, store, directory)
    if empty is not None:
        return empty
    _committed(store, args.step)
    if args.to == "dcp":
        model = export_dcp(directory, out, args.step)
    else:
        model = export_safetensors(directory, out, args.step, tables_only=args.tables_only)
    print(
        f"exported step {model.step} (chain {', '.join(map(str, model.chain))}): "
        f"{len(model.tables)} tables, {len(model.dense)} dense tensors -> {out} ({args.to})"
    )
    return 0


def _unlock(args: argparse.Namespace) -> int:
    from embckpt.storage.lock import unlock

    directory = _directory(args)
    _store(directory)  # an unknown URI scheme is a usage error, not a traceback
    if "://" not in directory and not Path(directory).is_dir():
        raise UsageError(f"{directory}: no such directory")  # a typo, not "no lock"
    holder = unlock(directory)
    print(f"{directory}: " + (f"removed the lock of {holder}" if holder else "no lock"))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from embckpt.examples.demo import run_demo

    if args.config is not None and not Path(args.config).is_file():
        raise UsageError(f"--config {args.config}: no such file")
    return run_demo(
        config_path=args.config,
        out=args.out,
        steps=args.steps,
        world_size=args.world_size,
        kill_at=args.kill_at,
        failures=args.failures,
        overrides={
            k: v
            for k, v in (("policy", args.policy), ("codec", args.codec), ("bits", args.bits))
            if v is not None
        },
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
    parser.add_argument("--version", action=_Version, nargs=0, help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = _command(sub, "demo", _demo, "train the reference DLRM, kill it, restore, finish")
    demo.add_argument("--config", default=None, help="DemoConfig YAML file (default: built-in)")
    demo.add_argument("--out", default="demo_out", help="checkpoint directory (demo_out)")
    demo.add_argument("--steps", type=_positive_int, default=None, help="training steps")
    demo.add_argument(
        "--world-size", type=_positive_int, default=None, help="ranks (default: the config's, 2)"
    )
    demo.add_argument(
        "--kill-at", type=_steps, default=None, metavar="S1,S2", help="steps to kill workers at"
    )
    demo.add_argument(
        "--failures", type=_positive_int, default=None, help="kill at N random steps instead"
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

    merge = _command(sub, "merge", _merge, "fold a checkpoint's chain into one full checkpoint")
    _directory_arguments(merge)
    merge.add_argument("--step", type=_step, required=True, help="the checkpoint to fold")

    inspect = _command(sub, "inspect", _inspect, "list checkpoints, tables, shards and leftovers")
    _directory_arguments(inspect)
    _json_output(inspect)
    _allow_empty(inspect)

    check = _command(sub, "verify", _verify, "check sizes, checksums and chains; exit 1 if bad")
    _directory_arguments(check)
    check.add_argument(
        "--step", type=_step, default=None, help="only this checkpoint and its chain"
    )
    _json_output(check)
    _allow_empty(check)

    report = _command(sub, "report", _report, "what each checkpoint cost and saved")
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
    report.add_argument("--days", type=_positive_float, default=30.0, help="training days (30)")
    report.add_argument(
        "--touch-rate",
        type=_fraction,
        default=None,
        help="share of rows a diff writes, in (0, 1] (default: measured)",
    )
    report.add_argument(
        "--no-progress", dest="progress", action="store_false", help="no progress line"
    )

    restore = _command(
        sub, "restore", _restore, "show a checkpoint's chain, verify it, print how to resume"
    )
    _directory_arguments(restore)
    restore.add_argument("--step", type=_step, default=None, help="default: the latest")

    export = _command(
        sub, "export", _export, "write a checkpoint as a DCP directory or a safetensors file"
    )
    export.add_argument("directory", metavar="DIR", help="checkpoint directory")
    export.add_argument("--step", type=_step, default=None, help="default: the latest")
    export.add_argument("--to", choices=("dcp", "safetensors"), required=True, help="output format")
    export.add_argument("out", help="the DCP directory or the .safetensors file to write")
    export.add_argument(
        "--tables-only",
        action="store_true",
        help="safetensors: only the tables, keyed as in an EmbeddingBagCollection",
    )
    export.set_defaults(dir=None)

    unlock = _command(
        sub, "unlock", _unlock, "remove a directory's lock, left by a job known to be gone"
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
