"""Config values are checked against their fields' types, from Python and from YAML alike."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest

from embckpt import CheckpointConfig, ConfigError, load_yaml
from embckpt.config import typed_value
from embckpt.examples.workload import DemoConfig, WorkloadConfig
from embckpt.units import parse_duration, parse_size


def _yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "line, message",
    [
        ("fsync: 'no'", r"checkpoint\.fsync: expected true or false, got 'no'"),
        ("fsync: 0", r"checkpoint\.fsync: expected true or false, got 0"),
        ("interval: 1.5", r"checkpoint\.interval: expected an integer, got 1\.5"),
        ("io_threads: true", r"checkpoint\.io_threads: expected an integer, got True"),
        ("keep_last: '2'", r"checkpoint\.keep_last: expected an integer, got '2'"),
        ("bits: true", r"checkpoint\.bits: expected an integer"),
        ("codec: 3", r"checkpoint\.codec: expected a string, got 3"),
        ("stall_bound: '2%'", r"checkpoint\.stall_bound: expected a number"),
        ("policy_options: [rule]", r"checkpoint\.policy_options: expected a mapping"),
        ("staging_budget_bytes: 4XB", r"checkpoint\.staging_budget_bytes: '4XB' is not a size"),
        ("lock_lease_s: soon", r"checkpoint\.lock_lease_s: 'soon' is not a duration"),
        ("keep_last: -1", r"checkpoint: keep_last must be >= 0"),
    ],
)
def test_yaml_refuses_a_value_of_the_wrong_type(tmp_path: Path, line: str, message: str) -> None:
    path = _yaml(tmp_path, f"checkpoint:\n  {line}\n")
    with pytest.raises(ConfigError, match=message):
        load_yaml(path, DemoConfig)


@pytest.mark.parametrize(
    "line, message",
    [
        ("batch_size: '256'", r"workload\.batch_size: expected an integer, got '256'"),
        ("cardinalities: [10, ten]", r"workload\.cardinalities\[1\]: expected an integer"),
        ("dense_arch: 16", r"workload\.dense_arch: expected a list, got 16"),
        ("sharding: {t_cat_0: 3}", r"workload\.sharding\['t_cat_0'\]: expected a string"),
        ("learning_rate: fast", r"workload\.learning_rate: expected a number"),
        ("data_path: 7", r"workload\.data_path: expected a string"),
        ("batch_size: 0", r"WorkloadConfig\.batch_size must be > 0"),
    ],
)
def test_yaml_checks_the_workload_too(tmp_path: Path, line: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_yaml(_yaml(tmp_path, f"workload:\n  {line}\n"), DemoConfig)


def test_demo_settings_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"run\.yaml\.steps: expected an integer, got '60'"):
        load_yaml(_yaml(tmp_path, "steps: '60'\n"), DemoConfig)
    with pytest.raises(ConfigError, match=r"DemoConfig\.world_size must be > 0, got 0"):
        load_yaml(_yaml(tmp_path, "world_size: 0\n"), DemoConfig)
    with pytest.raises(ConfigError, match=r"run\.yaml\.checkpoint: expected a mapping"):
        load_yaml(_yaml(tmp_path, "checkpoint: full\n"), DemoConfig)


def test_sizes_and_durations_are_spelt_as_on_the_command_line(tmp_path: Path) -> None:
    text = (
        "checkpoint:\n  staging_budget_bytes: 512MiB\n  lock_lease_s: 5min\n"
        "workload:\n  dense_arch: [64, 16]\n  sharding: {t_cat_0: row_wise}\n"
    )
    cfg = load_yaml(_yaml(tmp_path, text), DemoConfig)
    assert cfg.checkpoint.staging_budget_bytes == parse_size("512MiB") == 512 * 2**20
    assert cfg.checkpoint.lock_lease_s == parse_duration("5min") == 300.0
    assert cfg.workload.dense_arch == (64, 16)  # a YAML list becomes the field's tuple
    assert CheckpointConfig(staging_budget_bytes="4GB").staging_budget_bytes == 4 * 10**9  # type: ignore[arg-type]
    assert CheckpointConfig(lock_lease_s=90).lock_lease_s == 90.0


def test_python_construction_is_checked_as_yaml_is() -> None:
    with pytest.raises(ConfigError, match=r"CheckpointConfig\.fsync: expected true or false"):
        CheckpointConfig(fsync="no")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"CheckpointConfig\.interval: expected an integer"):
        CheckpointConfig(interval=1.5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"CheckpointConfig\.io_threads: expected an integer"):
        CheckpointConfig(io_threads=True)
    with pytest.raises(ConfigError, match=r"lock_lease_s must be > 0"):
        CheckpointConfig(lock_lease_s=0)
    with pytest.raises(ConfigError, match=r"io_threads must be > 0, got 0"):
        CheckpointConfig(io_threads=0)
    with pytest.raises(ConfigError, match=r"writer 'fork' is not one of \('auto', 'process'"):
        CheckpointConfig(writer="fork")
    # The range checks still run after the type checks, and dataclasses.replace re-checks.
    with pytest.raises(ConfigError, match=r"CheckpointConfig\.keep_last: expected an integer"):
        dataclasses.replace(CheckpointConfig(), keep_last="2")


def test_defaults_and_field_names_are_unchanged() -> None:
    """Every field of CheckpointConfig, in order, with its default and the default's type
    (``True == 1``): YAML files and callers name these, so a change must be deliberate."""
    expected = [
        ("policy", "one_shot"),
        ("full_every", None),
        ("policy_options", {}),
        ("expected_restores", None),
        ("keep_last", 0),
        ("codec", "raw"),
        ("bits", None),
        ("entropy", "auto"),
        ("codec_options", {}),
        ("diff_deltas", True),
        ("optimizer_codec", "auto"),
        ("base_codec", "raw"),
        ("row_group_rows", 65536),
        ("max_file_rows", 1 << 20),
        ("pack_below_bytes", 4 << 20),
        ("fsync", True),
        ("pipeline", "full"),
        ("staging_budget_bytes", 4 << 30),
        ("io_threads", None),
        ("writer", "auto"),
        ("interval", 100),
        ("adaptive_interval", True),
        ("stall_bound", 0.02),
        ("lock_lease_s", 60.0),
        ("write_retries", 4),
        ("retry_backoff_s", 0.1),
        ("local_dir", None),
        ("replicas", 0),
        ("durable_every", 1),
        ("local_keep_last", 2),
        ("partial_recovery", False),
        ("signing_key", None),
    ]
    config = CheckpointConfig()
    actual = [(f.name, getattr(config, f.name)) for f in dataclasses.fields(config)]
    assert [name for name, _ in actual] == [name for name, _ in expected]
    assert actual == expected
    assert [type(value) for _, value in actual] == [type(value) for _, value in expected]


def test_every_field_type_has_a_check() -> None:
    """A field with a type the checker does not know fails here, not in a user's run."""
    for cls in (CheckpointConfig, WorkloadConfig, DemoConfig):
        hints = typing.get_type_hints(cls)
        instance = cls()
        for f in dataclasses.fields(instance):
            value = getattr(instance, f.name)
            assert typed_value(f"{cls.__name__}.{f.name}", hints[f.name], value) == value
