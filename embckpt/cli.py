"""``embckpt`` command line: demo | inspect | verify | report | merge | restore | export.

Exit codes: 0 success, 1 a check failed (``verify``) or the demo failed, 2 bad usage or input.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from embckpt.errors import EmbckptError
from embckpt.report.build import build_report, format_table
from embckpt.report.projection import format_projection, parse_duration, parse_size, project
from embckpt.storage.chain import load_manifests
from embckpt.storage.fs import CheckpointStore
from embckpt.storage.verify import verify


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
    if args.project and args.model_bytes is None:
        print("embckpt report: --project needs --model-bytes (e.g. 2TB)", file=sys.stderr)
        return 2
    store = CheckpointStore(args.directory)
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

    store = CheckpointStore(args.directory)
    manifest = merge(store, args.step)
    sources = manifest.stats.get("merged_from", [args.step])
    print(
        f"step {args.step}: self-contained full checkpoint of {len(manifest.files)} files, "
        f"{manifest.total_bytes:,} bytes (folded from steps {sources})"
    )
    return 0


def _restore(args: argparse.Namespace) -> int:
    from embckpt.read.restore import describe_restore

    text, ok = describe_restore(args.directory, args.step)
    print(text)
    return 0 if ok else 1


def _export(args: argparse.Namespace) -> int:
    from embckpt.read.export import export_dcp, export_safetensors

    if args.to == "dcp":
        model = export_dcp(args.directory, args.out, args.step)
    else:
        model = export_safetensors(
            args.directory, args.out, args.step, tables_only=args.tables_only
        )
    print(
        f"exported step {model.step} (chain {', '.join(map(str, model.chain))}): "
        f"{len(model.tables)} tables, {len(model.dense)} dense tensors -> {args.out} ({args.to})"
    )
    return 0


def _demo(args: argparse.Namespace) -> int:
    from embckpt.examples.demo import run_demo

    return run_demo(
        config_path=args.config,
        out=args.out,
        steps=args.steps,
        world_size=args.world_size,
        kill_at=[int(s) for s in args.kill_at.split(",")] if args.kill_at else None,
        failures=args.failures,
        overrides={
            k: v
            for k, v in (("policy", args.policy), ("codec", args.codec), ("bits", args.bits))
            if v is not None
        },
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="embckpt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="train the reference DLRM, kill it, restore, finish")
    demo.add_argument("--config", default=None, help="DemoConfig YAML (default: built-in)")
    demo.add_argument("--out", default="demo_out", help="checkpoint directory")
    demo.add_argument("--steps", type=int, default=None, help="training steps")
    demo.add_argument("--world-size", type=int, default=None, help="ranks (default 2)")
    demo.add_argument("--kill-at", default=None, help="comma-separated steps to kill workers at")
    demo.add_argument("--failures", type=int, default=None, help="kill at N random steps")
    demo.add_argument("--policy", default=None, help="override the config's checkpoint policy")
    demo.add_argument("--codec", default=None, help="override the config's row codec")
    demo.add_argument("--bits", type=int, default=None, help="override the codec's bit width")
    demo.set_defaults(func=_demo)

    merge = sub.add_parser("merge", help="fold a checkpoint's chain into one full checkpoint")
    merge.add_argument("directory")
    merge.add_argument("--step", type=int, required=True)
    merge.set_defaults(func=_merge)

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
    report.add_argument("--days", type=float, default=30.0, help="training days (30)")
    report.add_argument(
        "--touch-rate", type=float, default=None, help="share of rows a diff writes (measured)"
    )
    report.add_argument(
        "--no-progress", dest="progress", action="store_false", help="no progress line"
    )
    report.set_defaults(func=_report)

    restore = sub.add_parser(
        "restore", help="show a checkpoint's chain, verify it, and print how to resume a job"
    )
    restore.add_argument("directory")
    restore.add_argument("--step", type=int, default=None, help="default: the latest")
    restore.set_defaults(func=_restore)

    export = sub.add_parser(
        "export", help="write a checkpoint as a DCP directory or a safetensors file"
    )
    export.add_argument("directory")
    export.add_argument("--step", type=int, default=None, help="default: the latest")
    export.add_argument("--to", choices=("dcp", "safetensors"), required=True)
    export.add_argument("out", help="the DCP directory or the .safetensors file to write")
    export.add_argument(
        "--tables-only",
        action="store_true",
        help="safetensors: only the tables, keyed as in an EmbeddingBagCollection",
    )
    export.set_defaults(func=_export)
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
