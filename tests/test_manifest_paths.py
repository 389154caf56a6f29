"""Every path a manifest names stays inside its step folder: no ``..``, no absolute path, no URI
scheme, no symbolic link that leaves the folder. Anything else makes the manifest corrupt, named,
for verify, restore, merge, export and report alike."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import toy_model as tm

from embckpt.cli import main
from embckpt.errors import CheckpointCorruptError
from embckpt.examples.launcher import run_ranks
from embckpt.read.export import reconstruct
from embckpt.read.merge import merge
from embckpt.report import build_report
from embckpt.storage.chain import read_manifest
from embckpt.storage.fs import CheckpointStore
from embckpt.storage.layout import MANIFEST_NAME
from embckpt.storage.paths import path_problem, real_path_below
from embckpt.storage.verify import verify

DENSE = "dense/model.safetensors"


def _step_dir(directory: Path, step: int) -> Path:
    return directory / f"step_{step:012d}"


def _rename_entry(step_dir: Path, old: str, new: str) -> None:
    """Renames file entry ``old`` to ``new`` in the manifest and recomputes its checksum exactly
    as ``embckpt.storage.manifest._checksum`` does (``Manifest.from_json`` refuses such names,
    so the JSON is edited by hand)."""
    manifest = step_dir / MANIFEST_NAME
    body = json.loads(manifest.read_text())
    body.pop("checksum")
    [entry] = [f for f in body["files"] if f["path"] == old]
    entry["path"] = new
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    body["checksum"] = hashlib.sha256(canonical.encode()).hexdigest()
    manifest.write_text(json.dumps(body, indent=1, sort_keys=True))


def _outside_copy(step_dir: Path, name: str, where: Path) -> Path:
    """A byte-identical copy of the step's file ``name`` at ``where``: sizes and checksums
    match, so only the containment check can refuse it."""
    where.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(step_dir / name, where)
    return where


def _lexical(bad: Callable[[Path, Path], str]) -> Callable[[Path, Path], str]:
    """A crafting that renames the dense entry to ``bad(step_dir, outside_root)``."""

    def craft(step_dir: Path, outside: Path) -> str:
        name = bad(step_dir, outside)
        _rename_entry(step_dir, DENSE, name)
        return name

    return craft


def _dotdot(step_dir: Path, outside: Path) -> str:
    # <dir>/step_X/../../outside.safetensors is the run copy's root: readable, same bytes.
    _outside_copy(step_dir, DENSE, step_dir.parent.parent / "outside.safetensors")
    return "../../outside.safetensors"


def _absolute(step_dir: Path, outside: Path) -> str:
    return str(_outside_copy(step_dir, DENSE, outside / "abs" / "model.safetensors"))


def _inner_dotdot(step_dir: Path, outside: Path) -> str:
    _outside_copy(step_dir, DENSE, step_dir.parent / "x")  # dense/../../x from the step folder
    return "dense/../../x"


def _file_symlink(step_dir: Path, outside: Path) -> str:
    """The step's dense file replaced by a symlink to an identical copy outside the folder."""
    copy = _outside_copy(step_dir, DENSE, outside / "linked" / "model.safetensors")
    (step_dir / DENSE).unlink()
    (step_dir / DENSE).symlink_to(copy)
    return DENSE


def _dir_symlink(step_dir: Path, outside: Path) -> str:
    """The step's ``dense`` folder replaced by a symlink to an identical folder outside."""
    shutil.copytree(step_dir / "dense", outside / "dense_dir")
    shutil.rmtree(step_dir / "dense")
    (step_dir / "dense").symlink_to(outside / "dense_dir", target_is_directory=True)
    return DENSE


CRAFTS = {
    "dotdot": _lexical(_dotdot),
    "absolute": _lexical(_absolute),
    "s3_uri": _lexical(lambda s, o: "s3://bucket/x"),
    "file_uri": _lexical(lambda s, o: "file:///etc/passwd"),
    "inner_dotdot": _lexical(_inner_dotdot),
    "dot_prefix": _lexical(lambda s, o: f"./{DENSE}"),
    "empty": _lexical(lambda s, o: ""),
    "file_symlink": _file_symlink,
    "dir_symlink": _dir_symlink,
}


@pytest.mark.parametrize("crafted_step", [15, 10], ids=["head", "parent"])
@pytest.mark.parametrize("kind", sorted(CRAFTS))
def test_a_path_leaving_the_step_folder_corrupts_the_manifest(
    run_copy: Path, tmp_path: Path, kind: str, crafted_step: int
) -> None:
    directory = run_copy / "incremental"
    step_dir = _step_dir(directory, crafted_step)
    entry = CRAFTS[kind](step_dir, tmp_path / "outside")
    manifest = str(step_dir / MANIFEST_NAME)
    named = f"file entry {entry!r}"
    store = CheckpointStore(directory)

    report = verify(store)
    assert not report.ok
    assert any(path == manifest and named in reason for path, reason in report.problems), (
        report.problems
    )

    with pytest.raises(CheckpointCorruptError) as exported:
        reconstruct(directory, 15)
    assert exported.value.path == manifest and named in str(exported.value)

    with pytest.raises(CheckpointCorruptError) as merged:
        merge(store, 15)
    assert merged.value.path == manifest and named in str(merged.value)
    assert not (_step_dir(directory, 15) / "merged").exists()

    unreadable = build_report(store, progress=False)["unreadable"]
    assert [u["path"] for u in unreadable] == [manifest], unreadable
    assert named in unreadable[0]["reason"]

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["verify", str(directory)]) == 1
    assert manifest in out.getvalue() and "FAILED" in out.getvalue()


def test_links_that_stay_inside_are_accepted(run_copy: Path, tmp_path: Path) -> None:
    """Containment compares real paths: a directory reached through a symlink, and a symlink
    to another file of the same step folder, are still inside."""
    step_dir = _step_dir(run_copy / "one_shot", 15)
    shutil.move(step_dir / DENSE, step_dir / "dense" / "real.safetensors")
    (step_dir / DENSE).symlink_to("real.safetensors")
    (tmp_path / "via_link").symlink_to(run_copy, target_is_directory=True)
    directory = tmp_path / "via_link" / "one_shot"
    report = verify(CheckpointStore(directory))
    assert report.ok and report.checked == [5, 10, 15], report.problems
    assert reconstruct(directory, 15).chain == (5, 15)  # one_shot: diffs against the base


@pytest.mark.parametrize(
    "name",
    [
        "tables/t_0/r0_c0.p0.parquet",
        "dense/rank_00001.safetensors",
        "merged/tables/x/y.parquet",
        "MANIFEST.json",
        "tables/user:id/r0_c0.p0.parquet",  # a table name with a colon is not a scheme
        "tables/..t/x..parquet",
    ],
)
def test_path_problem_accepts_names_inside(name: str) -> None:
    assert path_problem(name) is None


@pytest.mark.parametrize(
    "name",
    [
        "../../outside.safetensors",
        "..",
        "/etc/passwd",
        "s3://bucket/x",
        "file:///etc/passwd",
        "C:/x",
        "c:x",
        "dense/../../x",
        "./dense/model.safetensors",
        "dense/./model.safetensors",
        "dense//model.safetensors",
        "dense/",
        "",
        "dense\\..\\..\\x",
        "dense/x\x00",
        None,
        7,
    ],
)
def test_path_problem_refuses_names_that_may_leave(name: object) -> None:
    problem = path_problem(name)
    assert isinstance(problem, str) and problem


def _restore_crafted(rank: int, world_size: int, root: str) -> dict:
    from embckpt import CheckpointConfig, Checkpointer

    out: dict = {}
    model, opt = tm.build(world_size, seed=3)
    before = tm.snapshot_state(model, opt, rank)
    for name in ("one_shot", "incremental"):
        config = CheckpointConfig(policy=name, full_every=0)
        with Checkpointer(model, f"{root}/{name}", optimizer=opt, config=config) as ckpt:
            try:
                ckpt.restore()
                out[name] = None
            except CheckpointCorruptError as exc:
                out[name] = (type(exc).__name__, exc.path, str(exc))
    out["changed"] = tm.differences(before, tm.snapshot_state(model, opt, rank))
    return out


def test_restore_refuses_a_crafted_step_on_every_rank(run_copy: Path, tmp_path: Path) -> None:
    # one_shot: the head's dense entry points at ../../outside.safetensors (same bytes);
    # incremental: a rows file of the parent step is a symlink to a copy outside.
    head = _step_dir(run_copy / "one_shot", 15)
    CRAFTS["dotdot"](head, tmp_path / "outside")
    parent = _step_dir(run_copy / "incremental", 10)
    # A rows file of the parent (its small blocks are packed into one: that one).
    listed = read_manifest(CheckpointStore(run_copy / "incremental"), 10).files
    rows = next(f.path for f in listed if f.role == "rows")
    copy = _outside_copy(parent, rows, tmp_path / "outside" / "rows.parquet")
    os.remove(parent / rows)
    (parent / rows).symlink_to(copy)

    results = run_ranks(_restore_crafted, 2, str(run_copy))
    expected = {
        "one_shot": (head, "file entry '../../outside.safetensors'"),
        "incremental": (parent, f"file entry {rows!r}"),
    }
    for rank, out in enumerate(results):
        for name, (step_dir, named) in expected.items():
            assert out[name] is not None, (rank, name)
            kind, path, message = out[name]
            assert kind == "CheckpointCorruptError", (rank, name, message)
            assert path == str(step_dir / MANIFEST_NAME) and named in message, (rank, message)
        assert out["changed"] == [], (rank, out["changed"][:5])


@pytest.mark.parametrize("name", ["../x.bin", "tables/../../x.bin", "/tmp/x.bin", ""])
def test_a_writer_cannot_name_a_file_outside_the_step_folder(tmp_path: Path, name: str) -> None:
    """A table named ``../..`` must fail the save, not write outside and leave a checkpoint
    that every reader refuses."""
    store = CheckpointStore(tmp_path / "ckpts")
    with pytest.raises(ValueError, match="step_000000000003"):
        store.write_file(3, name, b"data")
    assert not (tmp_path / "x.bin").exists() and not (tmp_path / "ckpts" / "x.bin").exists()


def test_verify_of_one_step_fails_on_its_crafted_parent(run_copy: Path, tmp_path: Path) -> None:
    directory = run_copy / "incremental"
    CRAFTS["dotdot"](_step_dir(directory, 10), tmp_path / "outside")
    report = verify(CheckpointStore(directory), 15)
    assert not report.ok


def test_real_path_below_is_realpath(tmp_path: Path) -> None:
    """The resolution ``check_contained`` uses gives ``os.path.realpath``'s answer: plain
    names, a link in the middle of the path, a link to a link, and a name it refuses."""
    base = tmp_path / "base"
    (base / "a" / "b").mkdir(parents=True)
    (tmp_path / "out").mkdir()
    (base / "a" / "up").symlink_to(tmp_path / "out", target_is_directory=True)
    (base / "a" / "again").symlink_to(base / "a" / "up", target_is_directory=True)
    real = os.path.realpath(base)
    for relative in ("a", "a/b", "a/b/file", "a/up", "a/up/x", "a/again/y", "a/../a/b"):
        expected = os.path.realpath(os.path.join(real, relative))
        assert real_path_below(real, relative) == expected, relative
    assert real_path_below(real, "a/up/x") == os.path.join(os.path.realpath(tmp_path), "out/x")
