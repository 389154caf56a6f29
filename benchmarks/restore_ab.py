"""A restore change measured before and after: two code trees restore the same kept chain in
turn, in fresh processes (issue 39's evidence, "before and after on the same machine").

Why a tool: on the 2-core machine of ``benchmarks/results/`` a restore's time moves 15-30% from
run to run, so a change worth a few percent shows only in pairs run in turn on the same files.
And a rank started with a checkout as its working directory imports ``embckpt`` from there
before ``PYTHONPATH`` (the launcher's fork server puts the working directory first): a
comparison once ran the new code on both sides that way. Here every side runs with a scratch
folder as its working directory, and every rank reports the package it imported, which must
lie in that side's tree.

One chain of a ``benchmarks/family.py`` workload (headline codecs, ``policy: incremental``, no
forced full: a full, then ``--links - 1`` diffs) and its ``dcp.save`` are written once, by this
checkout. Then, ``--pairs`` times, the ``--before`` tree (a folder, or a git revision checked
out into a scratch worktree, its kernels compiled first) and this checkout each restore, in a
fresh pair of gloo ranks, the newest checkpoint (the chain), its full alone and ``dcp.load``
in turn, ``--rounds`` times; a time is the slowest rank's. The sides alternate which goes first
(before-after, then after-before), so that an order effect cancels. Per side and pair: the best
of the rounds; ``per_link`` = (chain - full) / (links - 1). ``summary`` gives each side's best and
median over the pairs and the after/before ratio of those medians. The workload code is this
checkout's for both sides (the trees should differ in ``embckpt`` only).

    python benchmarks/restore_ab.py --before HEAD~1 [--workload long_interval] [--links 10]
        [--pairs 4] [--rounds 12]

Writes ``benchmarks/results/restore_ab.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from common import build_workload, dcp_save, dcp_state, timed_load, write_result  # noqa: E402
from family import FAMILY, Member, chain_config  # noqa: E402

from embckpt.examples.launcher import run_ranks  # noqa: E402

CHECKOUT = Path(__file__).resolve().parent.parent
WORLD_SIZE = 2
MARK = "restore_ab:"  # the line of a side's run that carries its figures


def _member(name: str) -> Member:
    for member in FAMILY:
        if member.name == name:
            return member
    raise SystemExit(f"no family workload {name!r}: {[m.name for m in FAMILY]}")


def _write(rank: int, world_size: int, name: str, links: int, root: str) -> int:
    from embckpt import Checkpointer

    member = _member(name)
    work = build_workload(rank, world_size, member.demo_config(world_size))
    for _ in range(member.warmup):
        work.step()
    ours = Checkpointer(work.model, f"{root}/ours", optimizer=work.optimizer, config=chain_config())
    with ours:
        for link in range(links):
            for _ in range(member.every):
                work.step()
            ours.save(member.warmup + (link + 1) * member.every).wait()
    dcp_save(dcp_state(work.model, work.optimizer), f"{root}/dcp", threads=2)
    return 0


def _restore(rank: int, world_size: int, name: str, root: str, rounds: int) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    import embckpt
    from embckpt import Checkpointer

    member = _member(name)
    work = build_workload(rank, world_size, member.demo_config(world_size))
    times: dict[str, list[float]] = {"chain": [], "full": [], "dcp_load": []}
    with Checkpointer(
        work.model, f"{root}/ours", optimizer=work.optimizer, config=chain_config()
    ) as ck:
        newest = ck.load()  # warm: the first restore of a process loads what later ones reuse
        assert newest is not None, f"{root}/ours holds no checkpoint"
        full = newest.chain[0]
        loads = {
            "chain": ck.load,
            "full": lambda: ck.load(full),
            "dcp_load": lambda: dcp.load(
                dcp_state(work.model, work.optimizer), checkpoint_id=f"{root}/dcp"
            ),
        }
        for _ in range(rounds):
            for what, load in loads.items():
                times[what].append(timed_load(load))
    return {"package": str(Path(embckpt.__file__).resolve().parent), "times": times}


def _side(tree: Path, args: argparse.Namespace, root: str, scratch: str) -> dict[str, Any]:
    """One side's run: a fresh pair of ranks importing ``tree``'s package; its best times."""
    command = [sys.executable, __file__, "--phase", "restore", "--root", root]
    command += ["--workload", args.workload, "--rounds", str(args.rounds)]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(command, cwd=scratch, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith(MARK)]
    if out.returncode or not lines:
        raise RuntimeError(
            f"{tree}: the restores failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
        )
    ranks = json.loads(lines[-1][len(MARK) :])
    expected = (tree / "embckpt").resolve()
    for rank, found in enumerate(ranks):
        if Path(found["package"]) != expected:
            raise RuntimeError(f"rank {rank} imported {found['package']}, not {expected}")
    best = {
        what: min(max(r["times"][what][i] for r in ranks) for i in range(args.rounds))
        for what in ("chain", "full", "dcp_load")
    }
    best["per_link"] = (best["chain"] - best["full"]) / (args.links - 1)
    return best


def _tree(before: str, scratch: str) -> tuple[Path, bool]:
    """The before side's tree: a folder as given, or ``before`` checked out into a worktree
    (True: to remove) with its kernels compiled."""
    if Path(before).is_dir():
        return Path(before).resolve(), False
    tree = Path(scratch) / "before"
    git = ["git", "-C", str(CHECKOUT)]
    subprocess.run([*git, "worktree", "add", "--detach", str(tree), before], check=True)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    precompile = [sys.executable, "-m", "embckpt.codecs.precompile"]
    subprocess.run(precompile, cwd=scratch, env=env, check=True)
    return tree, True


def _summary(sides: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for what in ("chain", "full", "per_link", "dcp_load"):
        for side, runs in sides.items():
            values = [run[what] for run in runs]
            out[f"{side}_{what}_s"] = {"best": min(values), "median": statistics.median(values)}
        before = out[f"before_{what}_s"]["median"]
        out[f"after_vs_before_{what}"] = out[f"after_{what}_s"]["median"] / before
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--before", help="a git revision, or a folder holding embckpt/")
    parser.add_argument("--workload", default="long_interval")
    parser.add_argument("--links", type=int, default=10)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--phase", choices=["write", "restore"], help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase == "write":
        run_ranks(_write, WORLD_SIZE, args.workload, args.links, args.root, timeout_s=3600)
        return
    if args.phase == "restore":
        ranks = run_ranks(_restore, WORLD_SIZE, args.workload, args.root, args.rounds)
        print(MARK + json.dumps(ranks), flush=True)
        return
    if not args.before:
        parser.error("--before is required")
    with tempfile.TemporaryDirectory(prefix="restore_ab-") as scratch:
        tree, remove = _tree(args.before, scratch)
        try:
            root = f"{scratch}/chain"
            write = [sys.executable, __file__, "--phase", "write", "--root", root]
            write += ["--workload", args.workload, "--links", str(args.links)]
            env = {**os.environ, "PYTHONPATH": str(CHECKOUT)}
            subprocess.run(write, cwd=scratch, env=env, check=True, capture_output=True)
            sides: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
            for pair in range(args.pairs):
                order = [("before", tree), ("after", CHECKOUT)]
                for side, where in order if pair % 2 == 0 else order[::-1]:
                    sides[side].append(_side(where, args, root, scratch))
                    run = sides[side][-1]
                    print(
                        f"pair {pair} {side:6} chain {run['chain'] * 1e3:6.1f} ms  full "
                        f"{run['full'] * 1e3:6.1f} ms  per link {run['per_link'] * 1e3:5.2f} ms  "
                        f"dcp.load {run['dcp_load'] * 1e3:6.1f} ms",
                        flush=True,
                    )
        finally:
            if remove:
                git = ["git", "-C", str(CHECKOUT), "worktree"]
                subprocess.run([*git, "remove", "--force", str(tree)], check=False)
                subprocess.run([*git, "prune"], check=False)
    revision = subprocess.run(
        ["git", "-C", str(CHECKOUT), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    path = write_result(
        "restore_ab",
        {
            "args": vars(args),
            "after": f"this checkout at {revision} (and its uncommitted changes)",
            "sides": sides,
            "summary": _summary(sides),
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
