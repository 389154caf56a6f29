"""Frozen settings of the checkpointer, loadable from YAML.

Every knob of embckpt lives in :class:`CheckpointConfig` so that a run is described by one YAML
file (see ``configs/``) and unknown keys fail loudly instead of being ignored. Every value is
checked against its field's type (:func:`check_fields`), so ``fsync: 'no'`` or ``interval: 1.5``
is an error naming the field rather than a silently different run; fields ending in ``_bytes``
also take sizes (``4GB``, ``512MiB``) and fields ending in ``_s`` durations (``30s``, ``5min``),
spelt as on the command line (:mod:`embckpt.units`). Names of policies and codecs are checked
against their registries (``policy.POLICIES``, the codec registry), never against lists kept
here.
"""

from __future__ import annotations

import dataclasses
import numbers
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from embckpt.codecs import Codec, make_codec
from embckpt.codecs.delta import deltas_for
from embckpt.errors import ConfigError
from embckpt.policy import make_policy
from embckpt.units import parse_duration, parse_size

PIPELINES = ("full", "persist", "off")
WRITERS = ("auto", "process", "thread")


@dataclass(frozen=True)
class CheckpointConfig:
    """How checkpoints are taken and encoded.

    Attributes:
        policy: ``full`` (every checkpoint full), ``one_shot`` (diffs against the last full),
            ``incremental`` (diffs against the previous checkpoint) or ``intermittent`` (diffs,
            and a full when its predictor says a full is cheaper).
        full_every: a full checkpoint at the latest when the chain since the last full holds
            this many checkpoints (0: no full is ever forced). None (the default) takes the
            policy's own: 4 for ``one_shot`` and ``incremental``, off for ``intermittent``,
            whose predictor decides when a full is cheaper (a value given there caps the
            chain's length; the predictor may still take fulls sooner).
        policy_options: settings of the policy (``intermittent``: ``rule`` = ``cost`` or
            ``checknrun``, ``restore_weight``, ``diffs`` = ``auto``, the default under ``cost``,
            or ``one_shot``, ``max_chain``: the most a restore of the chain may read, in fulls,
            1.2 by default under ``cost``).
        expected_restores: if set, the bit width of quantizing codecs follows the restores the
            job expects (Check-N-Run: 2 bits for 1, 3 for 3, 4 for 20, 8 beyond), widening once
            more restores happened than planned; overrides ``bits``.
        keep_last: keep the last N committed checkpoints and everything they need; older ones
            are deleted after each commit (0 keeps everything).
        codec: registry id of the row codec (``raw`` is lossless fp32).
        bits: code width of quantizing codecs (2, 3, 4 or 8); None for the codec's default.
        entropy: entropy stage over the codes: ``none``, ``huffman``, ``zstd`` or ``lz4``;
            ``auto`` keeps the codec's own default (the stage measured best for it).
        codec_options: extra settings passed to the codec.
        diff_deltas: diffs of a quantizing codec (``asymmetric``, ``symmetric``, ``adaptive``,
            ``kmeans``) hold each row's change since what a restore starts from, every row at
            the narrowest width (none at all, 2 to 8 bits, or fp32) that restores it within
            the error a whole-row code at ``bits`` would leave (``codecs/delta.py``); fulls
            keep whole rows. The writer keeps the last full's encoded rows in host memory to
            take changes against. False: diffs hold whole rows, as fulls do.
        optimizer_codec: codec of optimizer state: element-wise always, row-wise too unless
            lossless (``log8``: one byte per value); additive codecs are refused (a restore
            copies optimizer state, it never adds to it). ``auto`` (the default) follows the
            rows: lossless ``raw`` when ``codec`` is lossless (so ``CheckpointConfig()`` keeps
            ``raw``), ``log8`` when it is lossy, where it wrote 4% to 19% less at no measured
            AUC cost (README, Measured); :func:`state_codec_name` resolves it.
        base_codec: codec of full checkpoints when ``codec`` is an additive codec (``exponent``):
            deltas need a base to be deltas against.
        row_group_rows: Parquet row-group size; smaller groups make row-range reads finer.
        max_file_rows: rows per Parquet file; a larger block is split into several files so
            that encoding one file never holds more than this many rows in memory.
        pack_below_bytes: blocks whose encoded rows take less than this share *packed* rows
            files: a rank writes the small blocks of a checkpoint with the same columns into
            one file, each in row groups of its own (format 4), so a checkpoint of many small
            tables is a few files per rank, not one per table; larger blocks keep a file each,
            which restores read in parallel. 0 packs nothing.
        fsync: fsync files and the manifest before a checkpoint counts as committed.
        pipeline: ``full`` (snapshot copy and persist in the background; the next weight
            update waits for the copy), ``persist`` (copy on the training thread, persist in the
            background) or ``off`` (``save`` returns once committed).
        staging_budget_bytes: the most staging buffers may hold; larger checkpoints are staged
            and written in pieces.
        io_threads: threads encoding and writing files in parallel; None (the default): the
            cores the host gives this rank (``LOCAL_WORLD_SIZE`` ranks share them) but one,
            which the training thread keeps, between 1 and 16.
        writer: who encodes and writes a copy-on-write save's rows: ``process`` (the rank's
            writer process, started with the ``Checkpointer``: the training process only
            copies rows, so no thread of it holds the GIL its steps need; its slabs are
            shared memory), ``thread`` (threads of the training process) or ``auto`` (the
            default): ``process`` for models on a GPU, ``thread`` on the CPU, where the
            training's own threads already keep the cores busy and a second interpreter
            costs its start (about 4 s and 0.3 GB per rank) for little. Saves without
            copy-on-write (``pipeline`` other than ``full``, EMA or managed-collision
            models) always use threads.
        interval: checkpoint interval (iterations) ``maybe_save`` starts with.
        adaptive_interval: re-choose the interval from measured costs at every checkpoint.
        stall_bound: share of training time checkpointing may cost (adaptive interval).
        lock_lease_s: seconds the directory lock lasts unrenewed (renewed every third of it);
            a job gone this long without releasing it is taken over by the next one.
        write_retries: times a file write failing with a transient error (an object store's
            503 Slow Down, a dropped connection, EIO) is tried again before the save fails;
            0 disables retries. 4 retries wait at most 1.5 s in all: enough for a throttling
            burst, short enough not to hold a failing save.
        retry_backoff_s: the wait before the first retry, doubled for each next one, with
            full jitter (a uniformly random part of it) and at most 5 s per wait.
        local_dir: the node-local tier (``embckpt/tiers``): every checkpoint also goes to
            ``<local_dir>/<node>/`` on each node (the node is the hostname, or the
            ``EMBCKPT_NODE`` environment variable), and restores read each file from the
            nearest copy; None (the default): the directory alone, as without tiers.
        replicas: 1 sends each node's files to one peer node over the process group, which
            keeps them as a replica under its local_dir (0: none).
        durable_every: with local_dir, every this-many-th checkpoint also goes to the
            Checkpointer's directory (the durable tier), with its chain.
        local_keep_last: checkpoints (with their chains) each node keeps of its own and of its
            replica (retention per tier; 0 keeps every one; ``keep_last`` rules the durable).
        partial_recovery: when a node and its replica are both lost, restore the surviving
            blocks from the newest step and the lost ones from the newest older step that
            holds them (CPR), instead of the newest step restorable whole.
        signing_key: a PEM file holding an Ed25519 private key: each checkpoint is signed
            (its manifest, which then holds a SHA-256 digest of every file: format 6), so
            readers holding the public key (``verify_key``) refuse anything else. None (the
            default): unsigned, format 5. Needs ``embckpt[sign]`` (the ``cryptography``
            package).
    """

    policy: str = "one_shot"
    full_every: int | None = None
    policy_options: Mapping[str, Any] = field(default_factory=dict)
    expected_restores: int | None = None
    keep_last: int = 0
    codec: str = "raw"
    bits: int | None = None
    entropy: str = "auto"
    codec_options: Mapping[str, Any] = field(default_factory=dict)
    diff_deltas: bool = True
    optimizer_codec: str = "auto"
    base_codec: str = "raw"
    row_group_rows: int = 65536
    max_file_rows: int = 1 << 20
    pack_below_bytes: int = 4 << 20
    fsync: bool = True
    pipeline: str = "full"
    staging_budget_bytes: int = 4 << 30
    io_threads: int | None = None
    writer: str = "auto"
    interval: int = 100
    adaptive_interval: bool = True
    stall_bound: float = 0.02
    lock_lease_s: float = 60.0
    write_retries: int = 4
    retry_backoff_s: float = 0.1
    local_dir: str | None = None
    replicas: int = 0
    durable_every: int = 1
    local_keep_last: int = 2
    partial_recovery: bool = False
    signing_key: str | None = None

    def __post_init__(self) -> None:
        check_fields(self)
        if self.keep_last < 0:
            raise ConfigError(f"keep_last must be >= 0, got {self.keep_last}")
        if self.expected_restores is not None and self.expected_restores < 1:
            raise ConfigError(f"expected_restores must be >= 1, got {self.expected_restores}")
        if self.io_threads is not None and self.io_threads <= 0:
            raise ConfigError(f"io_threads must be > 0, got {self.io_threads}")
        for name in ("full_every", "write_retries", "retry_backoff_s", "pack_below_bytes"):
            if (getattr(self, name) or 0) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        check_tiers(self)
        if self.pipeline not in PIPELINES:
            raise ConfigError(f"pipeline {self.pipeline!r} is not one of {PIPELINES}")
        if self.writer not in WRITERS:
            raise ConfigError(f"writer {self.writer!r} is not one of {WRITERS}")
        if not 0 < self.stall_bound < 1:
            raise ConfigError(f"stall_bound must be in (0, 1), got {self.stall_bound}")
        for name in (
            "row_group_rows",
            "max_file_rows",
            "staging_budget_bytes",
            "interval",
            "lock_lease_s",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        # Names are checked by the registries themselves, so a newly registered policy or
        # codec is accepted and the lists are written once.
        make_policy(self)
        state_codec = state_codec_name(self)
        for name in (state_codec, self.base_codec):
            make_codec(name)
        if make_codec(state_codec).additive:  # the one place such codecs are refused
            raise ConfigError(
                f"optimizer_codec {state_codec!r} is additive (it encodes changes to "
                "add onto a reference): optimizer state is restored as written, never added "
                "to; use a lossless codec or 'log8'"
            )
        if self.expected_restores is None:
            codec_for(self)


_T = TypeVar("_T")


def check_tiers(config: CheckpointConfig) -> None:
    """The node-local tier's settings: they need ``local_dir``, and one peer replica at most."""
    if config.replicas not in (0, 1):
        raise ConfigError(f"replicas must be 0 or 1, got {config.replicas}")
    if config.durable_every < 1:
        raise ConfigError(f"durable_every must be >= 1, got {config.durable_every}")
    if config.local_keep_last < 0:
        raise ConfigError(f"local_keep_last must be >= 0, got {config.local_keep_last}")
    if config.local_dir is None:
        given = [
            name
            for name, value in (
                ("replicas", config.replicas != 0),
                ("durable_every", config.durable_every != 1),
                ("partial_recovery", config.partial_recovery),
            )
            if value
        ]
        if given:
            raise ConfigError(f"{', '.join(given)} need local_dir (the node-local tier)")


def _shown(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def typed_value(where: str, hint: Any, value: Any) -> Any:
    """``value`` checked against the type hint of field ``where``; sizes (``where`` ends in
    ``_bytes``) and durations (``_s``) given as strings become numbers, lists become tuples.

    Raises:
        ConfigError: the value does not have the field's type; the message names ``where``.
        TypeError: a hint this checker does not know (a new field needs a rule here).
    """
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = (a for a in args if a is not type(None))
        return typed_value(where, inner, value)
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true or false, got {_shown(value)}")
    if hint in (int, float):
        parse = parse_size if where.endswith("_bytes") else parse_duration
        if isinstance(value, str) and where.endswith(("_bytes", "_s")):
            try:
                value = parse(value)
            except ValueError as exc:
                raise ConfigError(f"{where}: {exc}") from None
        numeric = numbers.Integral if hint is int else numbers.Real
        if isinstance(value, numeric) and not isinstance(value, bool):
            return hint(value)
        kind = "an integer" if hint is int else "a number"
        raise ConfigError(f"{where}: expected {kind}, got {_shown(value)}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: expected a string, got {_shown(value)}")
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {_shown(value)}")
        return tuple(typed_value(f"{where}[{i}]", args[0], v) for i, v in enumerate(value))
    if origin in (Mapping, dict):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {_shown(value)}")
        for key, item in value.items():
            typed_value(f"{where} key {key!r}", args[0], key)
            typed_value(f"{where}[{key!r}]", args[1], item)
        return value
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            return value
        raise ConfigError(f"{where}: expected a mapping of {hint.__name__}, got {_shown(value)}")
    raise TypeError(f"{where}: no type check for {hint!r}")


def check_fields(instance: Any) -> None:
    """Checks (and coerces, see :func:`typed_value`) every field of a frozen dataclass."""
    cls = type(instance)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(instance):
        value = getattr(instance, f.name)
        checked = typed_value(f"{cls.__name__}.{f.name}", hints[f.name], value)
        if checked is not value:
            object.__setattr__(instance, f.name, checked)


def from_mapping(cls: type[_T], values: Mapping[str, Any], where: str = "config") -> _T:
    """Builds dataclass ``cls`` from a mapping, recursing into nested dataclasses; every value
    is checked against its field's type first (:func:`typed_value`).

    Raises:
        ConfigError: a key is unknown or a value is invalid; the message names ``where`` and
            the field.
    """
    known = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(f"{where}: unknown keys {unknown}; known: {sorted(known)}")
    kwargs: dict[str, Any] = {}
    hints = typing.get_type_hints(cls)
    for name, value in values.items():
        hint = hints[name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint) and isinstance(value, Mapping):
            kwargs[name] = from_mapping(hint, value, f"{where}.{name}")
        else:
            kwargs[name] = typed_value(f"{where}.{name}", hint, value)
    try:
        return cls(**kwargs)
    except (TypeError, ConfigError) as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def load_yaml(path: str | Path, cls: type[_T]) -> _T:
    """Loads a YAML file into dataclass ``cls``.

    Raises:
        ConfigError: the file is missing, is not a mapping, or holds unknown keys.
    """
    path = Path(path)
    try:
        values = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc}") from exc
    if not isinstance(values, Mapping):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return from_mapping(cls, values, str(path))


def state_codec_name(config: CheckpointConfig) -> str:
    """The optimizer state's codec: ``config.optimizer_codec``, with ``auto`` resolved from the
    rows' codec (lossless rows keep lossless ``raw`` state, lossy rows take ``log8``)."""
    if config.optimizer_codec != "auto":
        return config.optimizer_codec
    return "raw" if make_codec(config.codec).lossless else "log8"


def codec_for(config: CheckpointConfig) -> Codec:
    """The row codec a checkpoint configuration asks for.

    ``config.codec`` names the codec; ``config.codec_options`` are its keyword options;
    ``config.bits`` and ``config.entropy`` (unless ``"auto"``) are added to them as ``bits`` and
    ``entropy``. ``entropy="auto"`` leaves the codec's own default: the stage measured best for
    it (see each codec's signature and benchmarks/results/codecs.json; none for ``raw`` and
    the uniform quantizers, ``common.UNIFORM_ENTROPY`` says why, zstd for the others and for
    a delta diff's changes). With ``diff_deltas``,
    a quantizing codec comes wrapped in its ``delta`` codec, which writes fulls with it.

    Raises:
        ConfigError: ``bits`` or ``entropy`` conflict with the same key in ``codec_options``, or
            the codec does not take an option (e.g. ``bits`` for ``raw``) or rejects its value.
        UnknownCodecError: no codec is registered under ``config.codec``.
    """
    options: dict[str, Any] = dict(config.codec_options)
    given = {"bits": config.bits, "entropy": None if config.entropy == "auto" else config.entropy}
    for name, value in given.items():
        if value is None:
            continue
        if name in options and options[name] != value:
            raise ConfigError(
                f"codec {config.codec!r}: {name}={value!r} conflicts with "
                f"codec_options[{name!r}]={options[name]!r}"
            )
        options[name] = value
    codec = make_codec(config.codec, options)
    if config.diff_deltas:
        return deltas_for(codec, config.entropy) or codec
    return codec
