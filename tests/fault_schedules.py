"""Seeded fault schedules: train, save, fault, restore, reshard-restore, merge and retention
steps on 2 gloo ranks, checking after every restore that it gave exactly what the writer meant
the restored step to hold.

A schedule is drawn from its seed alone (:func:`make_schedule`), so a failure reproduces from
the seed it prints. Faults come in two ways:

- through ``filesystem=``: a :class:`faultfs.FaultyHandler` on the failing rank fails chosen
  writes (a single one, which the store's retries absorb, or a burst longer than the retries,
  which fails the save) or reads (a restore fails: reads are never retried);
- in-process: an :mod:`embckpt.failpoints` point of a save, restore or merge phase, armed on
  the failing rank.

What is checked (each a count in the summary; the test and ``benchmarks/faults.py`` assert
``silent_errors == 0`` and ``hangs == 0``):

- every committed step N: the writer's reconstruction (``Checkpointer.reconstruction()``) is
  recorded, and for lossless codecs it must equal the live state at N;
- every restore of N that returns: the live blocks (weights and optimizer states) equal that
  record exactly, and the dense state and dense optimizer equal the live ones at N; a
  resharded restore compares whole tables' weights;
- every operation: both ranks raise, or both return the same thing (a disagreement is a
  silent error); a schedule that does not finish within its time is a hang.

Training goes on after every failure and every restore (continuation), so later saves and
restores check the state a failure or a restore left behind.
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass, field
from typing import Any

import pyarrow.fs as pafs
import torch
import torch.distributed as dist
import toy_model as tm
from faultfs import FaultPlan, FaultyHandler

CODECS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("raw", {"codec": "raw"}),
    ("fp16", {"codec": "fp16"}),
    ("bf16", {"codec": "bf16"}),
    ("symmetric4", {"codec": "symmetric", "bits": 4, "diff_deltas": False}),
    ("asymmetric4", {"codec": "asymmetric", "bits": 4, "diff_deltas": False}),
    ("adaptive4", {"codec": "adaptive", "bits": 4, "diff_deltas": False}),
    ("kmeans4", {"codec": "kmeans", "bits": 4, "diff_deltas": False}),
    ("exponent3", {"codec": "exponent", "bits": 3}),
    ("adaptive4-delta", {"codec": "adaptive", "bits": 4}),
    ("asymmetric2-delta", {"codec": "asymmetric", "bits": 2}),
    ("adaptive4-delta-log8", {"codec": "adaptive", "bits": 4, "optimizer_codec": "log8"}),
    ("raw-log8", {"codec": "raw", "optimizer_codec": "log8"}),
)
LOSSLESS = {"raw"}  # codecs whose reconstruction is the live state, optimizer state included
POLICIES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("full", {"policy": "full"}),
    ("one_shot", {"policy": "one_shot", "full_every": 4}),
    ("incremental", {"policy": "incremental", "full_every": 5}),
    (
        "intermittent",  # Check-N-Run's one-shot diffs (diffs: auto is the default since issue 22)
        {"policy": "intermittent", "full_every": 0, "policy_options": {"diffs": "one_shot"}},
    ),
    (
        "intermittent-auto",
        {"policy": "intermittent", "full_every": 0, "policy_options": {"diffs": "auto"}},
    ),
)
SAVE_POINTS = (
    "save.decide",
    "save.plan",
    "save.stage",
    "save.encode",
    "save.write",
    "save.dense",
    "save.agree",
    "save.manifest",
    "save.retention",  # after the commit: the save must still commit
)
WRITER_POINTS = ("save.encode", "save.write")  # reached in the writer process, when there is one
RESTORE_POINTS = ("restore.plan", "restore.fetch", "restore.side_state", "restore.apply")
RESHARD = {"tw": "rw", "rw": "cw", "cw": "tw", "twrw": "rw"}  # data-parallel stays
WRITE_RETRIES = 2  # the schedules' store: a burst of 3 failed attempts fails a save
HOT = 60  # rows of each table the batches draw from: diffs stay small


@dataclass(frozen=True)
class Fault:
    """One fault: ``kind`` is ``write`` / ``read`` (through the filesystem; ``match`` selects
    the paths, ``indices`` the matching calls that fail), ``point`` (a failpoint; the writer
    process's own for the points it reaches) or ``exit`` (the writer process exits at
    ``point``)."""

    kind: str
    rank: int
    point: str = ""
    match: str = ""
    indices: tuple[int, ...] = ()
    fail_at: str = "open"


@dataclass(frozen=True)
class Schedule:
    seed: int
    codec: str
    policy: str
    settings: dict[str, Any]
    ops: tuple[tuple[Any, ...], ...]


def make_schedule(
    seed: int,
    codec: str | None = None,
    policy: str | None = None,
    faults: bool = True,
    writer: str | None = None,
) -> Schedule:
    """The schedule of ``seed``: a codec and a policy (drawn, unless named), settings and 8-16
    operations; ``faults=False``: a short one without faults, for the invariant alone;
    ``writer="process"``: copy-on-write saves written by the rank's writer process, whose
    faults include its death mid-save."""
    rng = random.Random(seed)
    codecs, policies = dict(CODECS), dict(POLICIES)
    drawn_codec = CODECS[rng.randrange(len(CODECS))][0]
    drawn_policy = POLICIES[rng.randrange(len(POLICIES))][0]
    codec, policy = codec or drawn_codec, policy or drawn_policy
    settings = {
        **codecs[codec],
        **policies[policy],
        "pipeline": rng.choice(("full", "persist", "off")),
        "keep_last": rng.choice((0, 0, 3)),
        "max_file_rows": rng.choice((1 << 20, 50)),  # 50: several files per block
        "write_retries": WRITE_RETRIES,
        "retry_backoff_s": 0.001,
        "fsync": False,
        "adaptive_interval": False,
    }
    if writer is not None:
        settings.update(writer=writer, pipeline="full")
    ops: list[tuple[Any, ...]] = [("train", rng.randint(1, 3)), ("save", None)]
    if not faults:  # one step between saves: every diff still holds rows (hot rows, 16 ids)
        for _ in range(3):  # a full and three diffs: incremental diffs on diffs
            ops.extend([("train", 1), ("save", None)])
        ops.extend([("restore", rng.random(), None), ("train", 1), ("save", None)])
        ops.append(("restore", 1.0, None))
        return Schedule(seed, codec, policy, settings, tuple(ops))
    for _ in range(rng.randint(7, 14)):
        what = rng.choices(("save", "restore", "reshard", "merge"), weights=(10, 4, 1, 1), k=1)[0]
        ops.append(("train", rng.randint(1, 3)))
        if what == "save":
            fault = _save_fault(rng) if rng.random() < 0.45 else None
            if writer == "process" and rng.random() < 0.2:
                fault = Fault("exit", rng.randint(0, 1), point="save.encode")
            ops.append(("save", fault))
        elif what == "restore":
            fault = _restore_fault(rng) if rng.random() < 0.35 else None
            ops.append(("restore", rng.random(), fault))
        elif what == "reshard":
            ops.append(("reshard",))
        else:
            fault = Fault("point", 0, point="merge.write") if rng.random() < 0.4 else None
            ops.append(("merge", fault))
    ops.extend([("train", 1), ("save", None), ("restore", 1.0, None)])
    return Schedule(seed, codec, policy, settings, tuple(ops))


def _save_fault(rng: random.Random) -> Fault:
    rank = rng.randint(0, 1)
    roll = rng.random()
    if roll < 0.45:
        point = rng.choice(SAVE_POINTS)
        return Fault("point", 0 if point == "save.manifest" else rank, point=point)
    target = rng.choice(("tables/", "dense/", "MANIFEST"))
    if target == "MANIFEST":
        rank = 0
    burst = roll >= 0.6  # more failures than retries: the save fails
    first = rng.randint(0, 2) if target == "tables/" else 0
    count = WRITE_RETRIES + 1 if burst else 1
    return Fault(
        "write",
        rank,
        match=target,
        indices=tuple(range(first, first + count)),
        fail_at=rng.choice(("open", "close")),
    )


def _restore_fault(rng: random.Random) -> Fault:
    rank = rng.randint(0, 1)
    if rng.random() < 0.5:
        return Fault("point", rank, point=rng.choice(RESTORE_POINTS))
    target = rng.choice(("tables/", "dense/", "MANIFEST"))
    return Fault("read", rank, match=target, indices=(rng.randint(0, 1),))


# -- running schedules on the ranks ---------------------------------------------------------------
@dataclass
class Outcome:
    """One rank's record of one schedule."""

    seed: int
    codec_policy: str
    events: list[tuple[Any, ...]] = field(default_factory=list)  # compared across ranks
    fired: list[int] = field(default_factory=list)  # faults fired here during each event
    errors: list[str] = field(default_factory=list)  # what each failed operation raised here
    silent: list[str] = field(default_factory=list)
    faults: int = 0
    saves_failed: int = 0
    saves_committed: int = 0
    restores_checked: int = 0
    seconds: float = 0.0


class _Run:
    """One schedule on one rank."""

    def __init__(self, rank: int, root: str, schedule: Schedule, models: dict) -> None:
        from embckpt import CheckpointConfig, Checkpointer

        self.rank = rank
        self.schedule = schedule
        self.models = models
        self.model, self.opt = models["main"]
        self.rng = random.Random(schedule.seed * 7919 + 1)
        self.directory = f"{root}/s{schedule.seed}"
        self.handler = FaultyHandler()
        self.fs = pafs.PyFileSystem(self.handler)
        self.config = CheckpointConfig(**schedule.settings)
        self.ckpt = Checkpointer(
            self.model, self.directory, optimizer=self.opt, config=self.config, filesystem=self.fs
        )
        self.ckpt.track_reconstruction()
        self.out = Outcome(schedule.seed, f"{schedule.codec}, {schedule.policy}")
        self._point_armed = False  # a failpoint armed on this rank for the current operation
        self._in_writer = False  # a fault armed in this rank's writer process
        self._fired_now = 0  # faults fired here since the last recorded operation
        self.step = 0
        self.expected: dict[int, tuple[dict, dict]] = {}

    def run(self) -> Outcome:
        started = time.perf_counter()
        try:
            for op in self.schedule.ops:
                getattr(self, f"_op_{op[0]}")(*op[1:])
        finally:
            self._disarm()
            self.ckpt.close()
        self.out.seconds = time.perf_counter() - started
        return self.out

    # -- faults ---------------------------------------------------------------------------------
    def _arm(self, fault: Fault | None) -> None:
        from embckpt import failpoints

        if fault is None or fault.rank != self.rank:
            return
        process = self.ckpt._saver.process
        if fault.kind == "exit" or (
            fault.kind == "point" and process is not None and fault.point in WRITER_POINTS
        ):
            process.arm(fault.point, exit_code=3 if fault.kind == "exit" else None)
            self._in_writer = True
            return
        if fault.kind == "point":
            failpoints.arm(fault.point)
            return
        indices = frozenset(fault.indices)
        plan = (
            FaultPlan(fail_writes=indices, write_match=fault.match, fail_at=fault.fail_at)
            if fault.kind == "write"
            else FaultPlan(fail_reads=indices, read_match=fault.match)
        )
        self.handler.reset(plan)

    def _disarm(self) -> None:
        """Counts the faults that fired and disarms whatever did not."""
        from embckpt import failpoints

        armed = failpoints.armed()
        fired = self.handler.write_faults + self.handler.read_faults
        fired += 1 if self._point_armed and not armed else 0
        if self._in_writer:  # not observable from here: counted as fired
            self.ckpt._saver.process.disarm()
            fired += 1
            self._in_writer = False
        self.out.faults += fired
        self._fired_now += fired
        failpoints.disarm()
        self.handler.reset(FaultPlan())
        self._point_armed = False

    def _event(self, *event: Any) -> None:
        """Records an operation's outcome and the faults this rank injected into it."""
        self.out.events.append(event)
        self.out.fired.append(self._fired_now)
        self._fired_now = 0

    def _attempt(self, fault: Fault | None, fn: Any) -> tuple[Any, str | None]:
        self._arm(fault)
        self._point_armed = (
            fault is not None
            and fault.kind == "point"
            and fault.rank == self.rank
            and not self._in_writer
        )
        from embckpt import EmbckptError

        try:
            return fn(), None
        except Exception as exc:
            if not isinstance(exc, EmbckptError):  # every failure must reach users as ours
                self.out.silent.append(f"not an embckpt error: {type(exc).__name__}: {exc}")
            self.out.errors.append(f"{type(exc).__name__}: {exc}")
            return None, type(exc).__name__
        finally:
            self._disarm()

    # -- operations ------------------------------------------------------------------------------
    def _op_train(self, steps: int) -> None:
        for _ in range(steps):
            self.step += 1
            tm.train_step(self.model, self.opt, self.step, self.rank, hot=HOT)

    def _op_save(self, fault: Fault | None) -> None:
        step = self.step
        manifest, error = self._attempt(fault, lambda: self.ckpt.save(step).wait())
        committed = error is None and manifest is not None
        self._event("save", step, "committed" if committed else "failed")
        if not committed:
            self.out.saves_failed += 1
            if fault is not None and fault.point == "save.retention":
                self.out.silent.append(f"step {step}: a retention failure failed the save")
            return
        self.out.saves_committed += 1
        reconstruction = self.ckpt.reconstruction()
        live = _live(self.model, self.opt, self.rank)
        self.expected[step] = (reconstruction, live["dense"])
        if self.schedule.codec in LOSSLESS:
            for where in _differences(reconstruction, live["blocks"]):
                self.out.silent.append(f"step {step}: lossless reconstruction != live: {where}")

    def _committed(self) -> list[int]:
        return [s for s in self.ckpt.store.committed_steps() if s in self.expected]

    def _op_restore(self, pick: float, fault: Fault | None) -> None:
        committed = self._committed()
        if not committed:
            return
        target = committed[min(int(pick * len(committed)), len(committed) - 1)]
        restored, error = self._attempt(
            fault, lambda: self.ckpt.restore(target, discard_newer=True)
        )
        self._event("restore", target, restored if error is None else "failed")
        if error is not None:
            return
        if restored != target:
            self.out.silent.append(f"restore({target}) returned {restored}")
            return
        self.step = target  # training goes on from the restored step
        self.expected = {s: v for s, v in self.expected.items() if s <= target}
        self._check(target, _live(self.model, self.opt, self.rank))

    def _check(self, step: int, live: dict) -> None:
        self.out.restores_checked += 1
        blocks, dense = self.expected[step]
        for where in _differences(blocks, live["blocks"]):
            self.out.silent.append(f"restore({step}): {where}")
        for key, value in dense.items():
            if key not in live["dense"] or not torch.equal(live["dense"][key], value):
                self.out.silent.append(f"restore({step}): dense {key}")

    def _op_reshard(self) -> None:
        from embckpt import Checkpointer

        committed = self._committed()
        if not committed:
            return
        target = committed[-1]
        if "reshard" not in self.models:
            self.models["reshard"] = tm.build(2, seed=5, sharding=RESHARD)
        model, opt = self.models["reshard"]
        # It only restores: no writer process of its own (it would start one, never used).
        config = dataclasses.replace(self.config, writer="thread")
        with Checkpointer(
            model, self.directory, optimizer=opt, config=config, filesystem=self.fs
        ) as other:
            restored, error = self._attempt(None, lambda: other.restore(target))
        self._event("reshard", target, restored if error is None else error)
        # Whole tables: every rank's expected blocks and every rank's resharded blocks.
        expected_blocks = self.expected[target][0]
        mine = _live(model, opt, self.rank)["blocks"]
        gathered: list[Any] = [None, None]
        dist.all_gather_object(gathered, (_by_table(expected_blocks), _by_table(mine)))
        if error is not None or restored != target:
            self.out.silent.append(f"reshard restore({target}): {error or restored}")
            return
        self.out.restores_checked += 1
        truth = _assemble([g[0] for g in gathered])
        for table, row, col, weight in gathered[self.rank][1]:
            rows, cols = weight.shape
            want = truth[table][row : row + rows, col : col + cols]
            if not torch.equal(want, weight):
                self.out.silent.append(f"reshard restore({target}): {table} r{row} c{col}")

    def _op_merge(self, fault: Fault | None) -> None:
        from embckpt import merge

        committed = self._committed()
        if not committed:
            return
        target = committed[-1]
        error = None
        if self.rank == 0:
            _, error = self._attempt(fault, lambda: merge(self.ckpt.store, target))
        flags: list[Any] = [None, None]
        dist.all_gather_object(flags, error)
        self._event("merge", target, flags[0] or "ok")
        self._op_restore((committed.index(target) + 0.5) / len(committed), None)


def _live(model: Any, opt: Any, rank: int) -> dict:
    """This rank's writer blocks as the reconstruction spells them, and its dense state."""
    blocks = tm.writer_blocks(model, rank)
    state = tm.snapshot_state(model, opt, rank)
    # Data-parallel tables are in the state dict as plain tensors: their rows are checked as
    # the writer's blocks (rank 0's), encoded by the row codec like every table's.
    dense = {
        k: v for k, v in state.items() if k.startswith(("d:", "o:")) and "embedding_bags" not in k
    }
    return {"blocks": blocks, "dense": dense}


def _differences(expected: dict, live: dict) -> list[str]:
    out = []
    for key in sorted(set(expected) | set(live)):
        if key not in expected or key not in live:
            out.append(f"block {key} on one side only")
            continue
        for name, value in expected[key].items():
            got = live[key].get(name)
            if got is None or not torch.equal(got, value):
                out.append(f"block {key} {name}")
    return out


def _by_table(blocks: dict) -> list[tuple[str, int, int, torch.Tensor]]:
    """(table, row offset, column offset, weights) of each block (keys are ``TableShard.key``:
    ``<table>/r<row>_c<col>``)."""
    out = []
    for key, values in blocks.items():
        table, _, offsets = key.rpartition("/")
        row, col = offsets[1:].split("_c")
        out.append((table, int(row), int(col), values["weight"]))
    return out


def _assemble(per_rank: list[list[tuple[str, int, int, torch.Tensor]]]) -> dict:
    tables: dict[str, torch.Tensor] = {}
    for blocks in per_rank:
        for table, row, col, weight in blocks:
            full = tables.setdefault(table, torch.full((tm.ROWS, tm.DIM), float("nan")))
            full[row : row + weight.shape[0], col : col + weight.shape[1]] = weight
    return tables


def run_schedules(
    rank: int, world_size: int, root: str, schedules: list[Schedule]
) -> list[Outcome]:
    """Runs ``schedules`` in order on this rank (one model for all of them: each schedule
    starts from the state the previous one left)."""
    models: dict[str, Any] = {"main": tm.build(world_size, seed=0)}
    return [_Run(rank, root, schedule, models).run() for schedule in schedules]


def disagreements(per_rank: list[list[Outcome]]) -> list[str]:
    """Operations whose outcome differs between ranks, and operations that failed although no
    rank injected a fault into them."""
    problems = []
    for outcomes in zip(*per_rank, strict=True):
        first = outcomes[0]
        for other in outcomes[1:]:
            if other.events != first.events:
                problems.append(
                    f"seed {first.seed}: ranks disagree: {first.events} vs {other.events}"
                )
        for i, event in enumerate(first.events):
            failed = event[2] not in ("committed", "ok") and not isinstance(event[2], int)
            if failed and not any(o.fired[i] for o in outcomes if i < len(o.fired)):
                problems.append(f"seed {first.seed}: {event} failed with no fault injected")
    return problems
