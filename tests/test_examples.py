"""Tests of the reference workload: synthetic and Criteo data, batches, plan, 2-rank training."""

from __future__ import annotations

import dataclasses
import gzip
import re
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from embckpt import CheckpointStore
from embckpt.config import load_yaml
from embckpt.data import ResumableSampler
from embckpt.errors import ConfigError
from embckpt.examples.criteo import load_criteo_tsv
from embckpt.examples.launcher import run_ranks
from embckpt.examples.model import (
    EBC_MODULE_PATH,
    _auc,
    build_plan,
    build_tables,
    make_batch,
)
from embckpt.examples.synthetic import make_synthetic_dataset
from embckpt.examples.workload import DemoConfig, WorkloadConfig
from embckpt.report import build_report

pytestmark = pytest.mark.slow(25)  # seconds here, on 2 cores: see conftest.py

DEMO_YAML = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
README = Path(__file__).resolve().parents[1] / "README.md"
SMALL = WorkloadConfig(num_samples=20000)


def test_demo_config_loads_with_every_sharding_type() -> None:
    demo = load_yaml(DEMO_YAML, DemoConfig)
    kinds = {kind.split(":")[0] for kind in demo.workload.sharding.values()}
    assert kinds == {"table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel"}
    assert demo.world_size == 2


def test_the_packaged_demo_config_is_the_repositorys() -> None:
    """``embckpt demo`` without ``--config`` runs the package's copy; ``make demo`` runs
    ``configs/demo.yaml``: the same settings, so both print the same table."""
    from embckpt.examples.demo import packaged_config

    packaged = packaged_config()
    assert packaged.is_file() and packaged != DEMO_YAML
    assert load_yaml(packaged, DemoConfig) == load_yaml(DEMO_YAML, DemoConfig)
    assert load_yaml(packaged, DemoConfig) != DemoConfig()  # not the old toy defaults


def test_synthetic_is_deterministic_per_seed() -> None:
    a, b = make_synthetic_dataset(SMALL, 3000), make_synthetic_dataset(SMALL, 3000)
    other = make_synthetic_dataset(dataclasses.replace(SMALL, seed=1), 3000)
    for name in ("dense", "sparse", "labels"):
        assert np.array_equal(getattr(a, name), getattr(b, name))
    assert not np.array_equal(a.sparse, other.sparse)
    assert not np.array_equal(a.labels, other.labels)


def test_synthetic_shapes_ranges_skew_and_ctr() -> None:
    data = make_synthetic_dataset(SMALL)
    assert len(data) == 20000 and data.dense.shape == (20000, 13)
    assert data.sparse.shape == (20000, 26)
    assert (data.sparse >= 0).all()
    assert (data.sparse < np.asarray(SMALL.cardinalities)).all()
    assert (data.dense >= 0).all() and np.isfinite(data.dense).all()
    assert set(np.unique(data.labels)) == {0.0, 1.0}
    assert 0.2 <= data.labels.mean() <= 0.3
    # Table 2 has 4000 rows: its hottest 1% (40 rows) must serve far more than 1% of lookups,
    # and those rows must not simply be the lowest ids.
    counts = np.bincount(data.sparse[:, 2], minlength=4000)
    hottest = np.argsort(counts)[-40:]
    assert counts[hottest].sum() > 0.3 * len(data)
    assert hottest.max() >= 40


def test_synthetic_multiple_ids_per_feature_are_feature_major() -> None:
    cfg = dataclasses.replace(SMALL, ids_per_feature=3)
    data = make_synthetic_dataset(cfg, 2000)
    assert data.sparse.shape == (2000, 78) and data.ids_per_feature == 3
    per_feature = data.sparse.reshape(2000, 26, 3)
    assert (per_feature < np.asarray(cfg.cardinalities)[:, None]).all()
    # Feature 8 has 3 rows and feature 2 has 4000: their id ranges must show in their columns.
    assert per_feature[:, 8].max() == 2 and per_feature[:, 2].max() > 100


def _tsv_line(label: str, ints: list[str], cats: list[str]) -> str:
    return "\t".join([label, *ints, *cats]) + "\n"


def test_criteo_loader_parses_files_gz_and_missing_fields(tmp_path: Path) -> None:
    ints = ["5", "", "-2", "0"] + ["1"] * 9
    cats = ["68fd1e64", "", "zz", "FFFFFFFFFFFFFFFF"] + ["a"] * 22
    (tmp_path / "day_0").write_text(
        _tsv_line("1", ints, cats) + _tsv_line("0", [""] * 13, [""] * 26)
    )
    with gzip.open(tmp_path / "day_1.gz", "wt") as f:
        f.write(_tsv_line("1", ["3"] * 13, ["ff"] * 26))
    (tmp_path / "notes.md").write_text("not a click log")
    data = load_criteo_tsv(tmp_path, WorkloadConfig())
    cards = list(WorkloadConfig().cardinalities)

    assert data.dense.shape == (3, 13) and data.sparse.shape == (3, 26)
    assert data.labels.tolist() == [1.0, 0.0, 1.0]
    assert np.allclose(data.dense[0, :4], np.log1p([5, 0, 0, 0]))
    assert np.allclose(data.dense[1], 0) and np.allclose(data.dense[2], np.log1p(3))
    assert data.sparse[0, :4].tolist() == [
        0x68FD1E64 % cards[0],
        0,
        zlib.crc32(b"zz") % cards[2],
        0xFFFFFFFFFFFFFFFF % cards[3],
    ]
    assert data.sparse[0, 4:].tolist() == [0xA % rows for rows in cards[4:]]
    assert (data.sparse[1] == 0).all()
    assert data.sparse[2].tolist() == [0xFF % rows for rows in cards]

    first = load_criteo_tsv(tmp_path, WorkloadConfig(), max_rows=2)
    assert first.labels.tolist() == [1.0, 0.0]
    single = load_criteo_tsv(tmp_path / "day_1.gz", WorkloadConfig())
    assert np.array_equal(single.sparse, data.sparse[2:])


@pytest.mark.parametrize(
    "text",
    [
        "1\t2\t3\n",
        _tsv_line("1", ["x"] + ["1"] * 12, ["a"] * 26),
        _tsv_line("", ["1"] * 13, ["a"] * 26),
    ],
)
def test_criteo_loader_names_a_malformed_file(tmp_path: Path, text: str) -> None:
    bad = tmp_path / "broken.tsv"
    bad.write_text(text)
    with pytest.raises(ConfigError, match="broken.tsv"):
        load_criteo_tsv(bad, WorkloadConfig())


def test_criteo_loader_rejects_a_folder_without_logs(tmp_path: Path) -> None:
    (tmp_path / "README").write_text("")
    with pytest.raises(ConfigError, match=str(tmp_path)):
        load_criteo_tsv(tmp_path, WorkloadConfig())


@pytest.mark.parametrize("ids_per_feature", [1, 2])
def test_make_batch_matches_dataset_columns(ids_per_feature: int) -> None:
    cfg = dataclasses.replace(SMALL, ids_per_feature=ids_per_feature)
    data = make_synthetic_dataset(cfg, 500)
    indices = np.array([7, 3, 499, 0, 3], dtype=np.int64)
    dense, sparse, labels = make_batch(data, indices, cfg, torch.device("cpu"))
    assert torch.equal(dense, torch.from_numpy(data.dense[indices]))
    assert torch.equal(labels, torch.from_numpy(data.labels[indices]))
    assert sparse.keys() == cfg.feature_names
    features = sparse.to_dict()
    k = ids_per_feature
    for f, name in enumerate(cfg.feature_names):
        expected = data.sparse[indices, f * k : (f + 1) * k]
        assert features[name].lengths().tolist() == [k] * len(indices)
        assert np.array_equal(features[name].values().numpy(), expected.reshape(-1))


def test_build_plan_assigns_each_sharding_type() -> None:
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    cfg = load_yaml(DEMO_YAML, DemoConfig).workload
    ebc = EmbeddingBagCollection(tables=build_tables(cfg), device=torch.device("meta"))
    plan = build_plan(cfg, 2, ebc, device_type="cpu").plan[EBC_MODULE_PATH]
    assert set(plan) == set(cfg.table_names)
    expected = {"t_cat_0": "row_wise", "t_cat_2": "column_wise", "t_cat_3": "table_row_wise"}
    for table, kind in expected.items():
        assert plan[table].sharding_type == kind and plan[table].ranks == [0, 1]
    assert plan["t_cat_1"].ranks == [1]
    assert plan["t_cat_5"].sharding_type == "data_parallel"
    unnamed = [t for t in cfg.table_names if t not in cfg.sharding]
    assert [plan[t].ranks for t in unnamed[:4]] == [[0], [1], [0], [1]]
    for table in cfg.table_names:
        want = "dense" if table == "t_cat_5" else "fused"
        assert plan[table].compute_kernel == want, table


@pytest.mark.parametrize(
    ("sharding", "dim", "match"),
    [
        ({"t_cat_4": "column_wise"}, 15, "t_cat_4"),
        ({"t_cat_4": "table_wise:2"}, 16, "t_cat_4"),
        ({"t_cat_99": "row_wise"}, 16, "t_cat_99"),
    ],
)
def test_build_plan_rejects_impossible_shardings(sharding: dict, dim: int, match: str) -> None:
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    cfg = dataclasses.replace(SMALL, sharding=sharding, embedding_dim=dim, dense_arch=(64, dim))
    ebc = EmbeddingBagCollection(tables=build_tables(cfg), device=torch.device("meta"))
    with pytest.raises(ConfigError, match=match):
        build_plan(cfg, 2, ebc, device_type="cpu")


def test_auc_matches_pairwise_definition() -> None:
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 5, 300).astype(np.float32)  # many ties
    labels = (rng.random(300) < 0.3).astype(np.float32)
    pos, neg = scores[labels == 1], scores[labels == 0]
    pairwise = ((pos[:, None] > neg) + 0.5 * (pos[:, None] == neg)).mean()
    assert _auc(scores, labels) == pytest.approx(pairwise)
    assert np.isnan(_auc(scores, np.zeros(300, np.float32)))


TRAIN_STEPS = 150


def _train_worker(rank: int, world_size: int) -> dict:
    from embckpt.examples.model import build_model, evaluate, train_step

    cfg = load_yaml(DEMO_YAML, DemoConfig).workload
    data = make_synthetic_dataset(cfg)
    device = torch.device("cpu")
    dmp, optimizer = build_model(cfg, device, world_size=2)
    held_out = np.arange(60000, len(data))
    sampler = ResumableSampler(60000, cfg.batch_size, rank=rank, world_size=2, seed=cfg.seed)
    before = evaluate(dmp, data, held_out, cfg, device)
    losses = [
        train_step(dmp, optimizer, make_batch(data, next(sampler), cfg, device))
        for _ in range(TRAIN_STEPS)
    ]
    after = evaluate(dmp, data, held_out, cfg, device)
    again = evaluate(dmp, data, held_out, cfg, device)
    # The dense optimizer's state (keyed by parameter name) loads into a fresh model's.
    _, fresh_optimizer = build_model(cfg, device, world_size=2)
    fresh_optimizer.load_state_dict(optimizer.state_dict())
    trained, loaded = optimizer.state_dict()["state"], fresh_optimizer.state_dict()["state"]
    optimizer_restored = trained.keys() == loaded.keys() and all(
        torch.equal(trained[name]["sum"], loaded[name]["sum"]) for name in trained
    )
    return {
        "before": before,
        "after": after,
        "again": again,
        "losses": losses,
        "optimizer_restored": optimizer_restored,
    }


def test_two_rank_training_learns_the_teacher() -> None:
    results = run_ranks(_train_worker, 2)
    for result in results:
        assert all(np.isfinite(result["losses"]))
        assert result["after"]["auc"] > 0.65, result["after"]
        assert result["after"]["logloss"] < result["before"]["logloss"]
        # Evaluation must not train: a second pass scores identically.
        assert result["again"] == result["after"]
        assert result["optimizer_restored"]
    # Both ranks scored the same samples with the same (sharded) model.
    assert results[0]["after"]["auc"] == pytest.approx(results[1]["after"]["auc"], abs=1e-6)


# -- the demo -------------------------------------------------------------------------------
def test_demo_hides_only_the_known_third_party_warnings(caplog: pytest.LogCaptureFixture) -> None:
    import logging
    import warnings

    from embckpt.examples.demo import _KNOWN_LOG_LINES, _DropLines, quiet_known_warnings

    def shown(category: type[Warning], message: str, module: str) -> bool:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            quiet_known_warnings()
            warnings.warn_explicit(message, category, f"{module.replace('.', '/')}.py", 1, module)
        return bool(caught)

    bb, c10d = "`broadcast_buffers` is deprecated. Use", "torch.distributed.c10d_logger"
    dense = "fbgemm::dense_embedding_codegen_lookup_function: an autograd kernel was not registered"
    for category, message, module in [
        (FutureWarning, bb, "torchrec.distributed.embeddingbag"),
        (FutureWarning, bb, "torchrec.distributed.model_parallel"),
        (FutureWarning, "`torch.distributed.reduce_scatter_tensor` is deprecated.", c10d),
        (FutureWarning, "`torch.distributed.all_gather_into_tensor` is deprecated.", c10d),
        (UserWarning, dense, "torch.autograd.graph"),
    ]:
        assert not shown(category, message, module), message
    # The same words from another module, in another category, or another message still show.
    assert shown(FutureWarning, "`broadcast_buffers` is deprecated", "embckpt.checkpointer")
    assert shown(UserWarning, "`broadcast_buffers` is deprecated", "torchrec.distributed.x")
    assert shown(FutureWarning, "`torch.distributed.scatter` is deprecated", "torch.distributed.x")
    assert shown(UserWarning, "fbgemm::other_op: an autograd kernel", "torch.autograd.graph")

    try:
        with caplog.at_level(logging.WARNING):
            for name, starts in _KNOWN_LOG_LINES.items():
                for start in starts:
                    logging.getLogger(name).warning(start + " and more")
            logging.getLogger("torchrec.distributed.comm").warning("a real problem")
        assert [r.getMessage() for r in caplog.records] == ["a real problem"]
    finally:  # this process's loggers go back to how they were
        for name in _KNOWN_LOG_LINES:
            logger = logging.getLogger(name)
            for added in [f for f in logger.filters if isinstance(f, _DropLines)]:
                logger.removeFilter(added)


def _small_demo_yaml(tmp_path: Path, **workload: object) -> Path:
    """configs/demo.yaml with its tables a hundredth of their size (at least 3 rows) and a
    short synthetic log, so that the demo runs in seconds; ``workload`` overrides more."""
    import yaml

    settings = yaml.safe_load(DEMO_YAML.read_text())
    rows = settings["workload"]["cardinalities"]
    settings["workload"].update(
        cardinalities=[max(3, r // 100) for r in rows], num_samples=8192, **workload
    )
    path = tmp_path / "demo.yaml"
    path.write_text(yaml.safe_dump(settings))
    return path


def test_demo_config_is_criteo_shaped_and_changes_a_few_percent_per_interval() -> None:
    """The demo's tables: a few of 10^5 to 10^6 rows beside small ones, with skewed ids, so
    that one interval between checkpoints looks up a few percent of all rows."""
    demo = load_yaml(DEMO_YAML, DemoConfig)
    rows = np.array(demo.workload.cardinalities)
    assert len(rows) == 26 and 3 <= ((rows >= 10**5) & (rows <= 10**6)).sum() <= 5
    assert rows.max() <= 10**6 and (rows < 10**4).sum() >= 20
    data = make_synthetic_dataset(demo.workload, num_samples=4 * 2 * 2048)
    samples = demo.workload.batch_size * demo.world_size * demo.checkpoint_every
    ids = data.sparse[:samples]
    touched = sum(len(np.unique(ids[:, f])) for f in range(len(rows)))
    assert 0.01 <= touched / rows.sum() <= 0.05, touched / rows.sum()


@pytest.mark.timeout(900)  # five sets of two ranks start one after the other
def test_demo_runs_both_settings_side_by_side(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    """A short demo: the configured lossless run and the headline run are killed at the same
    step and restored; the lossless one ends exactly where the uninterrupted run does."""
    from embckpt.examples.demo import HEADLINE_DIR, run_demo

    out = tmp_path / "out"
    assert run_demo(str(_small_demo_yaml(tmp_path)), str(out), steps=30, kill_at=[15]) == 0
    captured = capfd.readouterr()  # the ranks' output too: they write to the same descriptors
    text = captured.out
    assert text.count("phase 1: workers died at step 15") == 2
    assert text.count("verify: OK (3 checkpoints") == 2
    # The known third-party warnings and log lines are hidden.
    assert not re.search(r"\w+Warning: ", captured.err), captured.err
    assert "[Connection]" not in captured.err and "is_fx_tracing" not in captured.err
    table = text[text.index("side by side:") :].splitlines()
    lossless, headline, reference = table[2:5]
    assert lossless.startswith("intermittent, raw ") and lossless.endswith(" identical"), table
    assert headline.startswith("intermittent, adaptive 4-bit "), table
    assert reference.startswith("uninterrupted, no checkpoint "), table

    def figures(line: str) -> tuple[int, float, float]:
        """(full checkpoints, ratio against full fp32, AUC) of one line of the table."""
        match = re.search(r" (\d+) of 3 .* (\d+\.\d\d)x +(\d\.\d{4})(?:  |$)", line)
        assert match, line
        return int(match.group(1)), float(match.group(2)), float(match.group(3))

    assert figures(lossless)[2] == float(reference.split()[-1])
    assert figures(headline)[1] > 1.5 * figures(lossless)[1], table
    # The figures printed are the ones the report measures on the files.
    for line, folder in ((lossless, out), (headline, out / HEADLINE_DIR)):
        totals = build_report(CheckpointStore(folder), progress=False)["totals"]
        assert figures(line)[0] == totals["full_checkpoints"], (line, totals)
        assert f"{totals['ratio_vs_full_fp32']:.2f}x" in line, (line, totals)
    for folder in (out, out / HEADLINE_DIR):
        assert (folder / "report.png").stat().st_size > 0
        assert (folder / "report.html").stat().st_size > 0
        assert (folder / "step_000000000030" / "MANIFEST.json").is_file()
    closing = text[text.index("where to look next:") :]
    assert f"embckpt report {out / HEADLINE_DIR}" in closing
    assert f"embckpt inspect {out / HEADLINE_DIR}" in closing
    section = re.search(r'README.md, section "([^"]+)"', closing)
    assert section and f"### {section.group(1)}\n" in README.read_text(), closing
    assert re.search(r"demo done in \d+s", text)


def test_a_worker_that_raises_stops_the_demo_with_its_error(
    tmp_path: Path, capfd: pytest.CaptureFixture
) -> None:
    """A worker's error is never taken for the planned kill: the demo stops at once, exit 1,
    with the worker's traceback."""
    from embckpt.examples.demo import run_demo

    config = _small_demo_yaml(tmp_path, data_path=str(tmp_path / "no_such_log.tsv"))
    assert run_demo(str(config), str(tmp_path / "out"), steps=30, kill_at=[15]) == 1
    err = capfd.readouterr().err
    assert "embckpt demo failed: intermittent, raw, phase 1: a worker failed" in err, err
    assert "no_such_log.tsv" in err and "Traceback" in err, err
