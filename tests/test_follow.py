"""The follower serves what a restore gives, reads only each new checkpoint's files, never shows
a reader a mix of two steps, and keeps serving its last good step through every fault: a
writer's leftover, retention, damaged and missing files, S3 errors, a failed apply."""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from embckpt.examples.launcher import free_port, run_ranks
from embckpt.read.export import reconstruct
from embckpt.serve.follower import Follower
from embckpt.storage.chain import read_chain
from embckpt.storage.fs import CheckpointStore
from embckpt.storage.layout import MANIFEST_NAME

pytestmark = pytest.mark.slow(25)  # seconds here, on 2 cores: see conftest.py

STEPS = 8  # fulls at 1, 4 and 7 (full_every=3), diffs between: rebases, rewinds, extensions
# One case per codec, the four policies among them: (codec, bits, policy).
CASES: dict[str, tuple[str, int | None, str]] = {
    "raw-incremental": ("raw", None, "incremental"),
    "fp16-one_shot": ("fp16", None, "one_shot"),
    "bf16-intermittent": ("bf16", None, "intermittent"),
    "symmetric-full": ("symmetric", 4, "full"),
    "asymmetric-one_shot": ("asymmetric", 4, "one_shot"),  # delta diffs: additive
    "adaptive-incremental": ("adaptive", 2, "incremental"),
    "kmeans-one_shot": ("kmeans", 3, "one_shot"),
    "exponent-incremental": ("exponent", 8, "incremental"),  # additive
}


def _follow_while_saving(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Every case: 2 ranks train and save each step; rank 0's follower polls after each
    commit and keeps its view; then every step is restored and each rank's blocks kept."""
    import toy_model as tm

    from embckpt import CheckpointConfig, Checkpointer

    out: dict[str, Any] = {}
    for name, (codec, bits, policy) in CASES.items():
        directory = f"{root}/{name}"
        config = CheckpointConfig(policy=policy, full_every=3, codec=codec, bits=bits, fsync=False)
        model, opt = tm.build(world_size, seed=0)
        follower = Follower(directory) if rank == 0 else None
        views: dict[int, Any] = {}
        with Checkpointer(model, directory, optimizer=opt, config=config) as ckpt:
            for step in range(1, STEPS + 1):
                tm.train_step(model, opt, step, rank, hot=120)
                ckpt.save(step).wait()
                if follower is not None:
                    assert follower.poll(), follower.last_error
                    update = follower.last_update
                    with follower.view() as view:
                        views[step] = {
                            "tables": {k: t.float().numpy().copy() for k, t in view.items()},
                            "dense": {k: v.numpy().copy() for k, v in view.dense.items()},
                            "path": update.path,
                            "rewound": update.rewound,
                            "held_rows": follower.held_rows,
                        }
            restored = {}
            for step in range(1, STEPS + 1):
                ckpt.restore(step)
                blocks = tm.writer_blocks(model, rank)
                restored[step] = {
                    "blocks": {k: b["weight"].numpy() for k, b in blocks.items()},
                    "dense": {
                        k: v.detach().numpy().copy()
                        for k, v in model.state_dict().items()
                        if not hasattr(v, "local_shards")
                    },
                }
        out[name] = {"views": views, "restored": restored}
    return out


@pytest.fixture(scope="module")
def followed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("follow")
    return root, run_ranks(_follow_while_saving, 2, str(root))


def _block_of(key: str) -> tuple[str, int, int]:
    table, at = key.rsplit("/", 1)
    row, col = at[1:].split("_c")
    return table, int(row), int(col)


def _mismatches(tables: dict[str, np.ndarray], blocks: list[dict[str, np.ndarray]]) -> list[str]:
    """Blocks (each rank's) whose restored weights differ from the view's cells, bit for bit."""
    bad = []
    for rank_blocks in blocks:
        for key, weight in rank_blocks.items():
            table, row, col = _block_of(key)
            cells = tables[table][row : row + weight.shape[0], col : col + weight.shape[1]]
            if not np.array_equal(cells.view(np.uint32), weight.view(np.uint32)):
                bad.append(key)
    return bad


@pytest.mark.parametrize("name", sorted(CASES))
def test_view_equals_restore_at_every_step(followed, name: str) -> None:
    _, results = followed
    views = results[0][name]["views"]
    policy = CASES[name][2]
    for step in range(1, STEPS + 1):
        blocks = [out[name]["restored"][step]["blocks"] for out in results]
        assert _mismatches(views[step]["tables"], blocks) == [], (name, step)
        dense = {  # the data-parallel table is a plain tensor there: a table, not dense
            k: v
            for k, v in results[0][name]["restored"][step]["dense"].items()
            if "embedding_bags." not in k
        }
        assert views[step]["dense"].keys() == dense.keys()
        assert all(np.array_equal(views[step]["dense"][k], v) for k, v in dense.items()), step
        assert views[step]["path"] == (step,), (step, views[step]["path"])  # one checkpoint read
    # The comparison can fail: consecutive steps differ.
    assert _mismatches(views[2]["tables"], [o[name]["restored"][3]["blocks"] for o in results])
    rewound = [s for s in range(1, STEPS + 1) if views[s]["rewound"]]
    # A one-shot diff after another goes back to the full first; other chains only extend.
    if policy == "one_shot":
        assert rewound == [3, 6]
    elif policy in ("incremental", "full"):
        assert rewound == []
    assert views[4]["held_rows"] == 0  # a full: nothing held beyond the tables


def test_late_and_lagging_followers_catch_up_by_the_cheapest_path(followed) -> None:
    root, results = followed
    for name in ("fp16-one_shot", "exponent-incremental"):
        directory = root / name
        late = Follower(directory)
        assert late.poll() and late.step == STEPS
        chain = [m.step for m in read_chain(CheckpointStore(directory), STEPS)]
        assert late.last_update.path == tuple(chain)  # the chain once, full first
        lagging = Follower(directory)
        lagging._update_to(2)  # served step 2, then six steps behind
        assert lagging.poll() and lagging.last_update.path == tuple(chain)  # new full: rebase
        blocks = [out[name]["restored"][STEPS]["blocks"] for out in results]
        for follower in (late, lagging):
            with follower.view() as view:
                tables = {k: t.numpy() for k, t in view.items()}
            assert _mismatches(tables, blocks) == [], name
    one_shot = Follower(root / "fp16-one_shot")
    one_shot._update_to(5)
    update = one_shot._update_to(6)  # 6's parent is 4, the full: 5's rows go back in memory
    assert update.path == (6,) and update.rewound
    assert one_shot.poll() and one_shot.last_update.path == (7, 8)  # a new full: rebase


def _reads(follower: Follower) -> list[tuple[int, str]]:
    """Records every (step, file) the follower's store reads."""
    store, seen = follower._store, []
    for method in ("read_file", "read_head", "open_rows"):
        original = getattr(store, method)

        def recording(step: int, what: Any, *args: Any, _original=original) -> Any:
            seen.append((step, what if isinstance(what, str) else what.path))
            return _original(step, what, *args)

        setattr(store, method, recording)
    return seen


def test_an_update_reads_exactly_the_new_checkpoints_files(saved_runs: Path) -> None:
    directory = saved_runs / "incremental"
    follower = Follower(directory)
    follower._update_to(10)
    seen = _reads(follower)
    assert follower.poll() and follower.step == 15
    store = CheckpointStore(directory)
    manifest = read_chain(store, 15)[-1]
    assert {step for step, _ in seen} == {15}  # nothing of the chain read again
    rows = {f.path: f.bytes for f in manifest.files if f.role == "rows"}
    dense = sum(f.bytes for f in manifest.files if f.role == "dense")
    read = {path for _, path in seen}
    assert set(rows) <= read and "dense/model.safetensors" in read
    manifest_bytes = (Path(store.step_path(15)) / MANIFEST_NAME).stat().st_size
    # Every byte of its rows and dense files (rows files from their footer and row groups:
    # not the 4-byte magic that opens them), the manifest, and each rank file's index.
    expected = manifest_bytes + dense + sum(rows.values()) - 4 * len(rows)
    expected += sum(p.index_bytes for p in manifest.parts)
    update = follower.last_update
    assert update.bytes_read == expected
    assert update.checkpoint_bytes == manifest.total_bytes + manifest_bytes
    assert update.bytes_read < update.checkpoint_bytes  # the rank files' state is not read


def test_a_held_view_pins_its_step_until_released(saved_runs: Path) -> None:
    follower = Follower(saved_runs / "one_shot")
    follower._update_to(10)
    view = follower.view()
    before = {k: t.clone() for k, t in view.items()}
    polling = threading.Thread(target=follower.poll)
    polling.start()
    time.sleep(0.4)
    assert polling.is_alive() and view.step == 10  # the update waits for the reader
    assert all(torch.equal(view[k], t) for k, t in before.items())
    view.release()
    polling.join(10)
    assert follower.step == 15 and follower.view_wait_s > 0.1  # it waited for the release
    with follower.view() as now:
        assert now.step == 15 and any(not torch.equal(now[k], t) for k, t in before.items())
    with pytest.raises(RuntimeError, match="released"):
        view["anything"]


def _exported(directory: Path, step: int) -> dict[str, torch.Tensor]:
    """``reconstruct``'s tables (the export path, a chain read whole) under the follower's
    names: table identities, not weight keys."""
    tables = reconstruct(directory, step).tables
    return {k.replace("embedding_bags.", "").removesuffix(".weight"): t for k, t in tables.items()}


def _table_values(follower: Follower) -> dict[str, torch.Tensor]:
    with follower.view() as view:
        return view.copy()


def test_faults_keep_the_last_good_step_served(run_copy: Path, caplog) -> None:
    directory = run_copy / "one_shot"
    store = CheckpointStore(directory)
    follower = Follower(directory)
    follower._update_to(10)
    good = _table_values(follower)

    # A damaged rows file, then a missing one, in the new step: refused, named, logged.
    rows = sorted((Path(store.step_path(15)) / "tables").rglob("*.parquet"))[0]
    original = rows.read_bytes()
    rows.write_bytes(original[:100] + bytes([original[100] ^ 1]) + original[101:])
    with caplog.at_level(logging.WARNING, logger="embckpt.serve.follower"):
        assert not follower.poll()
    assert follower.step == 10 and rows.name in str(follower.last_error)
    assert any("serving step 10" in r.getMessage() for r in caplog.records)
    rows.unlink()
    assert not follower.poll() and rows.name in str(follower.last_error)
    assert all(torch.equal(t, good[k]) for k, t in _table_values(follower).items())
    rows.write_bytes(original)
    assert follower.poll() and follower.step == 15 and follower.last_error is None

    # A writer crashed mid-save: a folder without a manifest is not a checkpoint.
    leftover = Path(store.step_path(20))
    (leftover / "tables").mkdir(parents=True)
    (leftover / "tables" / "half.parquet").write_bytes(b"PAR1 partial")
    shutil.copy(Path(store.step_path(15)) / "dense" / "model.safetensors", leftover)
    assert not follower.poll() and follower.step == 15 and follower.last_error is None

    # Retention deletes old steps while it follows: the next step still applies.
    late = Follower(directory)
    late._update_to(10)
    store.remove_step(10)
    assert late.poll() and late.last_update.path == (15,)


def test_a_failed_apply_leaves_the_tables_as_they_were(
    run_copy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import embckpt.serve.tables as tables

    follower = Follower(run_copy / "incremental")
    follower._update_to(10)
    good = _table_values(follower)
    real = tables.apply_staged

    def half_then_fail(by_position, threads, *args):  # writes the rows, then fails
        real(by_position, threads, *args)
        raise OSError("decoder failed")

    monkeypatch.setattr(tables, "apply_staged", half_then_fail)
    assert not follower.poll() and "decoder failed" in str(follower.last_error)
    assert follower.step == 10
    assert all(torch.equal(t, good[k]) for k, t in _table_values(follower).items())
    monkeypatch.setattr(tables, "apply_staged", real)
    assert follower.poll() and follower.step == 15


def test_follows_s3_through_its_errors(run_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pyarrow.fs as pafs
    from faultfs import FaultPlan, faulty_filesystem
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            monkeypatch.setenv(key, "testing")
        monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        query = f"endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"
        s3, _ = pafs.FileSystem.from_uri(f"s3://follow?{query}&allow_bucket_creation=true")
        s3.create_dir("follow")
        job = f"follow/{uuid.uuid4().hex[:8]}"
        source = run_copy / "incremental"
        for step in (5, 10):
            folder = Path(CheckpointStore(source).step_path(step))
            pafs.copy_files(str(folder), f"{job}/{folder.name}", destination_filesystem=s3)
        fs, handler = faulty_filesystem(FaultPlan(read_match="step_000000000010"), base=s3)
        follower = Follower(job, filesystem=fs)
        assert follower.poll() and follower.step == 10
        handler.plan = FaultPlan(read_probability=1.0)  # every read fails: S3 is down
        folder = Path(CheckpointStore(source).step_path(15))
        pafs.copy_files(str(folder), f"{job}/{folder.name}", destination_filesystem=s3)
        assert not follower.poll() and follower.step == 10 and follower.last_error is not None
        handler.reset(FaultPlan(fail_reads=frozenset({2}), read_match="step_000000000015"))
        assert not follower.poll() and follower.step == 10  # one GET of the new step fails
        assert handler.read_faults == 1
        handler.plan = FaultPlan()
        assert follower.poll() and follower.step == 15 and follower.last_error is None
    finally:
        server.stop()
    tables = _table_values(follower)
    assert tables.keys() == _exported(source, 15).keys()
    assert all(torch.equal(tables[k], t) for k, t in _exported(source, 15).items())


def _save_slowly(rank: int, world_size: int, root: str) -> list[float]:
    import toy_model as tm

    from embckpt import CheckpointConfig, Checkpointer

    model, opt = tm.build(world_size, seed=0)
    config = CheckpointConfig(policy="one_shot", codec="asymmetric", bits=4, fsync=False)
    with Checkpointer(model, root, optimizer=opt, config=config) as ckpt:
        for step in range(1, 7):
            tm.train_step(model, opt, step, rank, hot=120)
            ckpt.save(step).wait()
            time.sleep(0.3)
    return []


def test_a_follower_in_another_process_follows_two_writing_ranks(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    follower = Follower(directory)
    applied: list[int] = []
    follower.run(0.02, on_update=lambda update: applied.append(update.step))
    try:
        run_ranks(_save_slowly, 2, str(directory))
        deadline = time.monotonic() + 10
        while follower.step != 6 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        follower.close()
    assert follower.step == 6 and applied[-1] == 6 and len(applied) >= 3, applied
    assert applied == sorted(applied)
    tables = _table_values(follower)
    assert all(torch.equal(tables[k], t) for k, t in _exported(directory, 6).items())
    assert follower.last_update.freshness_s < 5


def test_cli_follow_once_exports_the_served_step(saved_runs: Path, tmp_path: Path) -> None:
    import safetensors.torch

    from embckpt.cli import main

    out = tmp_path / "served.safetensors"
    code = main(
        [
            "follow",
            str(saved_runs / "one_shot"),
            "--once",
            "--json",
            "--export",
            f"safetensors:{out}",
        ]
    )
    assert code == 0
    exported = safetensors.torch.load_file(str(out))
    for key, weight in _exported(saved_runs / "one_shot", 15).items():
        assert torch.equal(exported[key], weight), key
    assert main(["follow", str(tmp_path), "--once"]) == 1  # nothing committed there


def test_cli_follow_prints_each_step(saved_runs: Path, capsys) -> None:
    from embckpt.cli import main

    assert main(["follow", str(saved_runs / "incremental"), "--once", "--json"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["step"] == 15 and line["path"] == [5, 10, 15] and line["bytes_read"] > 0
