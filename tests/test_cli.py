"""The command line: verify finds every problem, inspect and report describe what is on disk."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

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
    for table, kind in [("t_rw", "row_wise"), ("t_cw", "column_wise"), ("t_dp", "data_parallel")]:
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
