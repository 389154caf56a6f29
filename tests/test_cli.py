"""The command line: verify finds every problem, inspect and report describe what is on disk."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import toy_model as tm

from embckpt.cli import main

STEP_15 = "step_000000000015"


def _files(directory: Path, pattern: str) -> list[Path]:
    return sorted(directory.glob(pattern))


def test_verify_passes_on_sound_checkpoints(run_copy: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["verify", str(run_copy / "one_shot")]) == 0
    out = capsys.readouterr().out
    assert "OK: 3 checkpoints (5, 10, 15)" in out


def test_verify_reports_every_damaged_file(run_copy: Path, capsys: pytest.CaptureFixture) -> None:
    directory = run_copy / "one_shot"
    flipped, truncated = _files(directory / STEP_15 / "tables", "*/*.parquet")[:2]
    data = bytearray(flipped.read_bytes())
    data[100] ^= 0x01
    flipped.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:-10])
    assert main(["verify", str(directory)]) == 1
    out = capsys.readouterr().out
    assert f"BAD {flipped}: CRC32C does not match" in out
    assert f"BAD {truncated}: size is" in out
    assert "FAILED: 2 problems" in out


def test_verify_reports_a_deleted_file_and_a_missing_link(
    run_copy: Path, capsys: pytest.CaptureFixture
) -> None:
    directory = run_copy / "incremental"
    deleted = _files(directory / STEP_15 / "dense", "rank_*")[0]
    deleted.unlink()
    os.remove(directory / "step_000000000010" / "MANIFEST.json")
    assert main(["verify", str(directory), "--step", "15"]) == 1
    out = capsys.readouterr().out
    assert f"BAD {deleted}: cannot read" in out
    assert "step_000000000010/MANIFEST.json: missing: step 15 depends on it" in out
    assert "leftover" in out  # step 10 lost its manifest: a leftover now, reported


def test_verify_catches_an_edited_manifest(run_copy: Path, capsys: pytest.CaptureFixture) -> None:
    manifest = run_copy / "one_shot" / STEP_15 / "MANIFEST.json"
    manifest.write_text(manifest.read_text().replace('"kind": "diff"', '"kind": "full"'))
    assert main(["verify", str(run_copy / "one_shot")]) == 1
    assert "manifest checksum does not match" in capsys.readouterr().out


def test_leftover_folders_are_reported_not_failed(
    run_copy: Path, capsys: pytest.CaptureFixture
) -> None:
    leftover = run_copy / "one_shot" / "step_000000000020" / "tables"
    leftover.mkdir(parents=True)
    (leftover / "half.parquet").write_bytes(b"PAR1")
    assert main(["verify", str(run_copy / "one_shot")]) == 0
    assert "leftover" in capsys.readouterr().out
    assert main(["inspect", str(run_copy / "one_shot")]) == 0
    out = capsys.readouterr().out
    assert "leftover" in out and "step 15: diff (policy one_shot, parent 5" in out


def test_inspect_lists_tables_and_shards(saved_runs: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["inspect", str(saved_runs / "incremental")]) == 0
    out = capsys.readouterr().out
    for table, kind in [
        (tm.table("rw"), "row_wise"),
        (tm.table("cw"), "column_wise"),
        (tm.table("dp"), "data_parallel"),
    ]:
        assert f"{table}: 240 x 8 float32, {kind}" in out
    assert "step 15: diff (policy incremental, parent 10, base 5)" in out


def test_report_json_totals_equal_bytes_on_disk(
    saved_runs: Path, capsys: pytest.CaptureFixture
) -> None:
    directory = saved_runs / "one_shot"
    assert main(["report", str(directory), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    kinds = [(c["step"], c["kind"]) for c in report["checkpoints"]]
    assert kinds == [(5, "full"), (10, "diff"), (15, "diff")]
    for checkpoint in report["checkpoints"]:
        step_dir = directory / f"step_{checkpoint['step']:012d}"
        on_disk = sum(
            p.stat().st_size
            for p in step_dir.rglob("*")
            if p.is_file() and p.name != "MANIFEST.json"
        )
        assert checkpoint["bytes"] == on_disk
        assert checkpoint["rows"] > 0
    full, diff = report["checkpoints"][0], report["checkpoints"][1]
    assert diff["rows"] < full["rows"]
    assert report["totals"]["bytes_written"] == sum(c["bytes"] for c in report["checkpoints"])
    # One-shot: restoring step 15 reads the full at 5 and the diff at 15.
    by_step = {c["step"]: c["bytes"] for c in report["checkpoints"]}
    assert report["totals"]["restore_chain_bytes"] == by_step[5] + by_step[15]


def test_report_on_an_empty_directory(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["report", str(tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["checkpoints"] == [] and report["totals"]["bytes_written"] == 0


# -- exit codes, user errors, JSON, start-up -----------------------------------------------------
def _exit_code(argv: list[str]) -> int:
    """main()'s exit code, including argparse's (it exits 2 through SystemExit)."""
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


def test_user_errors_exit_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    a_file = tmp_path / "file.txt"
    a_file.write_text("not a directory")
    empty, missing = tmp_path / "empty", tmp_path / "missing"
    empty.mkdir()
    cases = {
        ("verify", str(a_file)): "is not a directory",
        ("inspect", str(a_file)): "is not a directory",
        ("verify", str(missing)): "no checkpoints found",
        ("inspect", str(empty)): "no checkpoints found",
        ("verify", "--json", str(empty)): "no checkpoints found",
        ("merge", str(missing), "--step", "5"): "no checkpoints found",
        ("restore", str(missing)): "no checkpoints found",
        ("export", str(missing), "--to", "dcp", str(missing / "out")): "does not exist",
        ("report", str(empty), "--plot", str(missing / "r.png")): "does not exist",
        ("report", str(empty), "--project"): "--model-bytes",
        ("verify",): "a checkpoint directory is needed",
        ("verify", str(empty), "--dir", str(missing)): "two directories given",
        ("demo", "--config", str(missing / "demo.yaml")): "no such file",
        ("demo", "--kill-at", "x"): "'x' is not an integer",
        ("demo", "--bits", "5"): "invalid choice",
        ("report", str(empty), "--days", "-1"): "must be > 0",
        ("report", str(empty), "--touch-rate", "2"): "must be in (0, 1]",
        ("report", str(empty), "--interval", "soon"): "is not a duration",
        ("verify", str(empty), "--step", "-3"): "must be >= 0",
        ("verify", "nosuchscheme://bucket/ckpts"): "nosuchscheme://bucket/ckpts",
        ("unlock", str(a_file)): "is not a directory",
    }
    for argv, message in cases.items():
        assert _exit_code(list(argv)) == 2, argv
        captured = capsys.readouterr()
        assert message in captured.err, (argv, captured.err)
        assert "Traceback" not in captured.err
    assert not (missing / "r.png").exists()


# One exit-code rule for every command: 1 the command failed (a check found a problem, the
# checkpoint is corrupt or incomplete), 2 bad usage (what the command line names does not exist).
def _commands(directory: Path, out: Path, step: int | None) -> dict[str, list[str]]:
    at = [] if step is None else ["--step", str(step)]
    return {
        "verify": ["verify", str(directory), *at],
        "restore": ["restore", str(directory), *at],
        "merge": ["merge", str(directory), "--step", str(15 if step is None else step)],
        "export": ["export", str(directory), *at, "--to", "safetensors", str(out / "m.st")],
    }


@pytest.mark.parametrize("command", ["verify", "restore", "merge", "export"])
def test_corrupt_data_exits_1(
    command: str, run_copy: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # A truncated rows file of the latest checkpoint.
    directory = run_copy / "one_shot"
    damaged = _files(directory / STEP_15 / "tables", "*/*.parquet")[0]
    damaged.write_bytes(damaged.read_bytes()[:-10])
    assert _exit_code(_commands(directory, tmp_path, None)[command]) == 1, command
    captured = capsys.readouterr()
    assert damaged.name in captured.out + captured.err, captured
    assert "Traceback" not in captured.err
    # A missing link of the chain: step 15 needs step 10, whose manifest is gone.
    directory = run_copy / "incremental"
    (directory / "step_000000000010" / "MANIFEST.json").unlink()
    assert _exit_code(_commands(directory, tmp_path, 15)[command]) == 1, command
    captured = capsys.readouterr()
    assert "step_000000000010" in captured.out + captured.err, captured
    assert not (tmp_path / "m.st").exists()


@pytest.mark.parametrize("command", ["verify", "restore", "merge", "export"])
def test_a_step_that_is_not_committed_is_bad_usage_exits_2(
    command: str, run_copy: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    directory = run_copy / "incremental"
    (directory / "step_000000000010" / "MANIFEST.json").unlink()  # a leftover now
    for step in (7, 10):
        assert _exit_code(_commands(directory, tmp_path, step)[command]) == 2, (command, step)
        captured = capsys.readouterr()
        assert f"step {step} is not committed" in captured.err, captured
        assert "committed steps: 5, 15" in captured.err and captured.out == ""
    assert not (tmp_path / "m.st").exists()


def test_inspect_and_report_describe_damage_and_succeed(
    run_copy: Path, capsys: pytest.CaptureFixture
) -> None:
    """They describe what they can read and list what they cannot; verify is the check."""
    manifest = run_copy / "one_shot" / STEP_15 / "MANIFEST.json"
    manifest.write_text(manifest.read_text()[:-20])
    assert main(["inspect", str(run_copy / "one_shot"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [m["path"] for m in doc["unreadable_manifests"]] == [str(manifest)]
    assert main(["report", str(run_copy / "one_shot"), "--no-progress"]) == 0
    assert main(["verify", str(run_copy / "one_shot")]) == 1


def test_allow_empty_makes_an_empty_directory_a_success(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert main(["verify", str(tmp_path), "--allow-empty"]) == 0
    assert main(["inspect", str(tmp_path / "missing"), "--allow-empty"]) == 0
    assert "no committed checkpoint" in capsys.readouterr().out


def test_verify_json(run_copy: Path, capsys: pytest.CaptureFixture) -> None:
    directory = run_copy / "one_shot"
    assert main(["verify", str(directory), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema_version"] == 1 and doc["ok"] is True and doc["step"] is None
    assert doc["checked"] == [5, 10, 15] and doc["problems"] == [] and doc["files_checked"] > 0
    damaged = _files(directory / STEP_15 / "tables", "*/*.parquet")[0]
    damaged.write_bytes(damaged.read_bytes()[:-10])
    assert main(["verify", "--dir", str(directory), "--json", "--step", "15"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and doc["step"] == 15
    assert [p["path"] for p in doc["problems"]] == [str(damaged)]


def test_inspect_json(saved_runs: Path, capsys: pytest.CaptureFixture) -> None:
    directory = saved_runs / "incremental"
    assert main(["inspect", str(directory), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema_version"] == 1 and doc["directory"] == str(directory)
    steps = [(c["step"], c["kind"], c["parent_step"]) for c in doc["checkpoints"]]
    assert steps == [(5, "full", None), (10, "diff", 5), (15, "diff", 10)]
    step_15 = directory / STEP_15
    on_disk = sum(
        p.stat().st_size for p in step_15.rglob("*") if p.is_file() and p.name != "MANIFEST.json"
    )
    assert doc["checkpoints"][-1]["bytes"] == on_disk
    tables = {t["name"]: t for t in doc["tables"]}
    t_rw = tables[tm.table("rw")]
    assert t_rw["sharding_type"] == "row_wise" and t_rw["rows"] == 240
    shards = t_rw["shards"]
    assert sorted(s["rank"] for s in shards) == [0, 1]
    assert sum(s["rows"] for s in shards) == 240
    assert doc["unreadable_manifests"] == [] and doc["leftovers"] == []


def test_dir_option_equals_the_positional(saved_runs: Path, capsys: pytest.CaptureFixture) -> None:
    directory = str(saved_runs / "one_shot")
    assert main(["inspect", directory]) == 0
    positional = capsys.readouterr().out
    assert main(["inspect", "--dir", directory]) == 0
    assert capsys.readouterr().out == positional


def test_version(capsys: pytest.CaptureFixture) -> None:
    from importlib.metadata import version

    assert _exit_code(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"embckpt {version('embckpt')}"


def test_every_argument_has_help_and_names_match_the_registries() -> None:
    import argparse

    from embckpt.cli import CODEC_NAMES, POLICY_NAMES, build_parser
    from embckpt.codecs.base import _REGISTRY
    from embckpt.codecs.uniform import QUANT_BITS
    from embckpt.policy import POLICIES

    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in subparsers.choices.items():
        for action in sub._actions:
            assert action.help, f"embckpt {name} {action.dest}: no help text"
    demo = {a.dest: a for a in subparsers.choices["demo"]._actions}
    assert sorted(POLICY_NAMES) == sorted(POLICIES)
    # The project's codecs (tests register their own into the same registry).
    assert sorted(CODEC_NAMES) == sorted(
        name for name, cls in _REGISTRY.items() if cls.__module__.startswith("embckpt.")
    )
    assert tuple(demo["bits"].choices) == QUANT_BITS


_NO_TORCH = """
import json, sys, time
start = time.perf_counter()
from embckpt.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "torchrec", "fbgemm_gpu"))
print(json.dumps({"code": code, "heavy": heavy, "seconds": time.perf_counter() - start}))
"""


@pytest.mark.parametrize("command", [["--help"], ["verify"], ["inspect"], ["inspect", "--json"]])
def test_help_verify_and_inspect_never_import_torch(saved_runs: Path, command: list[str]) -> None:
    import subprocess
    import sys

    argv = command if command == ["--help"] else [*command, str(saved_runs / "one_shot")]
    result = subprocess.run(
        [sys.executable, "-c", _NO_TORCH, *argv], capture_output=True, text=True, timeout=120
    )
    doc = json.loads(result.stdout.strip().splitlines()[-1])
    assert doc["code"] == 0, result.stderr
    assert doc["heavy"] == []


def test_unlock_removes_a_held_lock_and_names_its_holder(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    import socket

    from embckpt.storage.fs import CheckpointStore
    from embckpt.storage.layout import LOCK_NAME
    from embckpt.storage.lock import DirectoryLock

    store = CheckpointStore(tmp_path / "ckpts")
    store.create_root()
    lock = DirectoryLock(store.fs, store.root, store.is_local)
    lock.acquire()
    try:
        assert (tmp_path / "ckpts" / LOCK_NAME).is_file()
        assert main(["unlock", str(tmp_path / "ckpts")]) == 0
        out = capsys.readouterr().out
        assert f"removed the lock of process {os.getpid()} on {socket.gethostname()}" in out
        assert not (tmp_path / "ckpts" / LOCK_NAME).exists()
    finally:
        lock.release()
    assert main(["unlock", "--dir", str(tmp_path / "ckpts")]) == 0
    assert capsys.readouterr().out.strip() == f"{tmp_path / 'ckpts'}: no lock"
    (tmp_path / "file").write_text("x")
    assert main(["unlock", str(tmp_path / "file")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main(["unlock", str(tmp_path / "typo")]) == 2
    assert "typo: no such directory" in capsys.readouterr().err
