"""The commands of the ``embckpt`` command line, one function each: they take the parsed
arguments, print their text (or JSON, whose schemas cli.py's docstring gives) and return the
exit code; cli.py's parser routes each command here and its ``main`` turns their exceptions
into exit codes. Everything beyond reading a checkpoint's manifests and files (merge, export,
restore's text, the demo, the report's figures) is imported where used, so that ``inspect``,
``verify`` and ``unlock`` never import torch."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from embckpt.cli_args import (
    EXIT_FAILED,
    EXIT_OK,
    UsageError,
    checkpoint_directory,
    empty_exit_code,
    open_store,
    output_path,
    require_committed,
)
from embckpt.report.build import build_report, format_table
from embckpt.report.projection import format_projection, project
from embckpt.storage.chain import load_manifests
from embckpt.storage.fs import CheckpointStore
from embckpt.storage.signing import generate_key_pair, load_verify_keys
from embckpt.storage.verify import verify

#: ``schema_version`` of ``inspect --json`` and ``verify --json``.
SCHEMA_VERSION = 1


def _leftovers(store: CheckpointStore, steps: list[int]) -> list[dict[str, Any]]:
    return [{"step": step, "path": store.step_path(step)} for step in steps]


def inspect_command(args: argparse.Namespace) -> int:
    directory = checkpoint_directory(args)
    store = open_store(directory)
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
        empty = empty_exit_code(args, store, directory)
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
    empty = empty_exit_code(args, store, directory)
    if empty == 0 and latest is None:
        print(f"{directory}: no committed checkpoint")
    return 0 if empty is None else empty


def verify_command(args: argparse.Namespace) -> int:
    directory = checkpoint_directory(args)
    store = open_store(directory)
    store.verify_keys = load_verify_keys(args.key)
    require_committed(store, args.step)
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
    empty = empty_exit_code(args, store, directory)
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


def report_command(args: argparse.Namespace) -> int:
    directory = checkpoint_directory(args)
    if args.project and args.model_bytes is None:
        raise UsageError("--project needs --model-bytes (e.g. 2TB)")
    for path, what in ((args.plot, "--plot"), (args.html, "--html")):
        if path is not None:
            output_path(path, what)
    store = open_store(directory)
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


def merge_command(args: argparse.Namespace) -> int:
    from embckpt.read.merge import merge

    directory = checkpoint_directory(args)
    store = open_store(directory)
    empty = empty_exit_code(args, store, directory)
    if empty is not None:
        return empty
    require_committed(store, args.step)
    manifest = merge(store, args.step)
    sources = manifest.stats.get("merged_from", [args.step])
    print(
        f"step {args.step}: self-contained full checkpoint of {manifest.file_count} files, "
        f"{manifest.total_bytes:,} bytes (folded from steps {sources})"
    )
    return 0


def restore_command(args: argparse.Namespace) -> int:
    from embckpt.cli_restore import describe_restore

    directory = checkpoint_directory(args)
    store = open_store(directory)
    empty = empty_exit_code(args, store, directory)
    if empty is not None:
        return empty
    require_committed(store, args.step)
    text, ok = describe_restore(directory, args.step)
    print(text)
    return EXIT_OK if ok else EXIT_FAILED


def export_command(args: argparse.Namespace) -> int:
    from embckpt.read.export import export_dcp, export_safetensors

    directory = checkpoint_directory(args)
    out = output_path(args.out, "output")
    store = open_store(directory)
    empty = empty_exit_code(args, store, directory)
    if empty is not None:
        return empty
    require_committed(store, args.step)
    if args.to == "dcp":
        model = export_dcp(directory, out, args.step)
    else:
        model = export_safetensors(directory, out, args.step, tables_only=args.tables_only)
    print(
        f"exported step {model.step} (chain {', '.join(map(str, model.chain))}): "
        f"{len(model.tables)} tables, {len(model.dense)} dense tensors -> {out} ({args.to})"
    )
    return 0


def unlock_command(args: argparse.Namespace) -> int:
    from embckpt.storage.lock import unlock

    directory = checkpoint_directory(args)
    open_store(directory)  # an unknown URI scheme is a usage error, not a traceback
    if "://" not in directory and not Path(directory).is_dir():
        raise UsageError(f"{directory}: no such directory")  # a typo, not "no lock"
    holder = unlock(directory)
    print(f"{directory}: " + (f"removed the lock of {holder}" if holder else "no lock"))
    return 0


def demo_command(args: argparse.Namespace) -> int:
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


def keygen_command(args: argparse.Namespace) -> int:
    for path in (args.private, args.public):
        if Path(path).exists():
            raise UsageError(f"{path} exists: give a new file (keys are never overwritten)")
    generate_key_pair(args.private, args.public)
    print(
        f"private key {args.private} (CheckpointConfig(signing_key=...)); public key "
        f"{args.public} (verify_key=..., --key)"
    )
    return EXIT_OK


def follow_command(args: argparse.Namespace) -> int:
    """Follows DIR: one line (or JSON object) per applied step; ``--once`` polls once."""
    import time

    from embckpt.serve.follower import Follower

    directory = checkpoint_directory(args)
    open_store(directory)  # a URI pyarrow cannot open is a usage error
    export = _export_target(args.export)
    follower = Follower(directory, device=args.device, verify_key=args.key)
    while True:
        moved = follower.poll()
        if moved and follower.last_update is not None:
            update = follower.last_update
            if export is not None:
                with follower.view() as view:
                    view.save_safetensors(export)
            _print_update(update, args.json)
        elif follower.last_error is not None:
            print(
                f"embckpt follow: serving step {follower.step}: {follower.last_error}",
                file=sys.stderr,
            )
        done = args.until_step is not None and (follower.step or -1) >= args.until_step
        if args.once or done:
            break
        time.sleep(args.interval)
    if follower.step is None:
        print(f"embckpt follow: {directory}: no committed checkpoint served", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_FAILED if args.once and follower.last_error is not None else EXIT_OK


def _export_target(spec: str | None) -> str | None:
    if spec is None:
        return None
    kind, _, path = spec.partition(":")
    if kind != "safetensors" or not path:
        raise UsageError(f"--export {spec}: give safetensors:PATH")
    return output_path(path, "--export")


def _print_update(update: Any, as_json: bool) -> None:
    if as_json:
        doc = {
            "step": update.step,
            "previous": update.previous,
            "path": list(update.path),
            "rewound": update.rewound,
            "bytes_read": update.bytes_read,
            "checkpoint_bytes": update.checkpoint_bytes,
            "freshness_s": round(update.freshness_s, 4),
            "seconds": round(update.seconds, 4),
        }
        print(json.dumps(doc), flush=True)
        return
    path = " -> ".join(map(str, update.path))
    print(
        f"step {update.step}: applied {path}{' (back to the full first)' if update.rewound else ''}"
        f", read {update.bytes_read:,} bytes (the checkpoint's files: "
        f"{update.checkpoint_bytes:,}), {update.freshness_s:.3f} s after its commit",
        flush=True,
    )
