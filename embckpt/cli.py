"""``embckpt`` command line: demo | inspect | verify | report.

Exit codes: 0 success, 1 a check failed (``verify``) or the demo failed, 2 bad usage or input.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from embckpt.errors import EmbckptError
from embckpt.report import build_report, format_table
from embckpt.storage.fs import CheckpointStore
from embckpt.storage.verify import load_manifests, verify


def _inspect(args: argparse.Namespace) -> int:
    store = CheckpointStore(args.directory)
    manifests, problems = load_manifests(store)
    if not manifests:
        print(f"{args.directory}: no committed checkpoint")
    for step, manifest in sorted(manifests.items()):
        parent = "-" if manifest.parent_step is None else manifest.parent_step
        print(
            f"step {step}: {manifest.kind} (policy {manifest.policy}, parent {parent}, "
            f"base {manifest.base_step}), {len(manifest.files)} files, "
            f"{manifest.total_bytes:,} bytes, {manifest.world_size} ranks, "
            f"codec {manifest.codec['id']}"
        )
    if manifests:
        latest = manifests[max(manifests)]
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
    for step in store.leftover_steps():
        print(f"leftover {store.step_path(step)} (no manifest: not a checkpoint)")
    return 0


def _verify(args: argparse.Namespace) -> int:
    store = CheckpointStore(args.directory)
    report = verify(store, args.step)
    for step in report.leftovers:
        print(f"leftover {store.step_path(step)}: no manifest, ignored")
    for path, reason in report.problems:
        print(f"BAD {path}: {reason}")
    steps = ", ".join(map(str, report.checked)) or "none"
    if report.ok:
        checked = f"{len(report.checked)} checkpoints ({steps}), {report.files_checked} files"
        print(f"OK: {checked} checked")
        return 0
    print(f"FAILED: {len(report.problems)} problems; first bad file: {report.problems[0][0]}")
    return 1


def _report(args: argparse.Namespace) -> int:
    report = build_report(CheckpointStore(args.directory))
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(format_table(report))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from embckpt.examples.demo import run_demo

    return run_demo(
        config_path=args.config, out=args.out, steps=args.steps, world_size=args.world_size
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="embckpt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="train the reference DLRM, kill it, restore, finish")
    demo.add_argument("--config", default=None, help="DemoConfig YAML (default: built-in)")
    demo.add_argument("--out", default="demo_out", help="checkpoint directory")
    demo.add_argument("--steps", type=int, default=None, help="training steps")
    demo.add_argument("--world-size", type=int, default=None, help="ranks (default 2)")
    demo.set_defaults(func=_demo)

    inspect = sub.add_parser("inspect", help="list checkpoints, tables and shards")
    inspect.add_argument("directory")
    inspect.set_defaults(func=_inspect)

    check = sub.add_parser("verify", help="check sizes, checksums and chains")
    check.add_argument("directory")
    check.add_argument("--step", type=int, default=None)
    check.set_defaults(func=_verify)

    report = sub.add_parser("report", help="what each checkpoint cost and saved")
    report.add_argument("directory")
    report.add_argument("--json", action="store_true", help="machine-readable output")
    report.set_defaults(func=_report)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except EmbckptError as exc:
        print(f"embckpt {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
