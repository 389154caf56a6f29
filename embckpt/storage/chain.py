"""Manifests and chains: the one place that loads manifests and walks parent links.

A diff checkpoint names its ``parent_step``; following parents ends at a full checkpoint, the
chain's base. A restore needs the whole chain; retention must keep it; verify and the report
show it. They all walk it here:

* :func:`read_manifest` / :func:`read_chain` - strict: every link must be committed and sound,
  or the error names the file at fault and what needs it (restore, merge, export);
* :func:`load_manifests` / :func:`chain_steps` - lenient: every readable manifest, and the
  links of a chain that are present, for tools that report problems instead of raising
  (verify, retention, report).
"""

from __future__ import annotations

from collections.abc import Mapping

from embckpt.errors import ChainIncompleteError, CheckpointCorruptError
from embckpt.storage.fs import CheckpointStore
from embckpt.storage.layout import MANIFEST_NAME
from embckpt.storage.manifest import Manifest, ids_of_bare_names


def read_manifest(store: CheckpointStore, step: int) -> Manifest:
    """Reads and checks one committed manifest (its checksum, its step, the paths it names).

    Raises:
        ChainIncompleteError: the step has no manifest.
        CheckpointCorruptError: the manifest is damaged; names it.
    """
    try:  # read first, ask why only on failure: one file-system call less per manifest
        data = store.read_file(step, MANIFEST_NAME).to_pybytes()
    except CheckpointCorruptError:
        if not store.is_committed(step):
            path = store.step_path(step, MANIFEST_NAME)
            raise ChainIncompleteError(
                path, f"checkpoint of step {step} is not committed"
            ) from None
        raise
    return manifest_from_bytes(store, step, data)


def manifest_from_bytes(store: CheckpointStore, step: int, data: bytes) -> Manifest:
    """Step ``step``'s manifest from its bytes, checked as :func:`read_manifest` checks it.

    Raises:
        CheckpointCorruptError: the manifest is damaged; names it.
    """
    path = store.step_path(step, MANIFEST_NAME)
    try:
        text = data.decode()
    except UnicodeDecodeError as exc:
        raise CheckpointCorruptError(path, f"manifest is not UTF-8 text: {exc}") from exc
    manifest = Manifest.from_json(text, path)
    if manifest.step != step:
        raise CheckpointCorruptError(path, f"manifest says step {manifest.step}, folder {step}")
    # Each path once: the blocks of a packed file share one.
    store.check_contained(step, list(dict.fromkeys(f.path for f in manifest.files)), path)
    return manifest


def load_manifests(store: CheckpointStore) -> tuple[dict[int, Manifest], list[tuple[str, str]]]:
    """Every committed manifest that reads and checks, and (path, reason) of those that do not."""
    manifests: dict[int, Manifest] = {}
    problems: list[tuple[str, str]] = []
    for step in store.committed_steps():
        try:
            manifests[step] = read_manifest(store, step)
        except (CheckpointCorruptError, ChainIncompleteError) as exc:
            problems.append((exc.path, exc.reason))
    return manifests, problems


def chain_steps(manifests: Mapping[int, Manifest], step: int) -> list[int]:
    """The steps a restore of ``step`` reads, base first, as far as ``manifests`` hold them:
    the walk stops at a missing link (the first step's ``parent_step`` is then not None) or a
    loop."""
    chain: list[int] = []
    current: int | None = step
    while current is not None and current in manifests and current not in chain:
        chain.append(current)
        current = manifests[current].parent_step
    return chain[::-1]


def missing_parent(manifests: Mapping[int, Manifest], step: int) -> int | None:
    """The first link of ``step``'s chain that is not in ``manifests``; None if complete."""
    chain = chain_steps(manifests, step)
    if not chain:
        return step
    parent = manifests[chain[0]].parent_step
    return parent if parent is not None and parent not in chain else None


def needed_steps(manifests: Mapping[int, Manifest], keep: list[int]) -> set[int]:
    """``keep`` and every step their chains depend on."""
    needed: set[int] = set()
    for step in keep:
        needed.update(chain_steps(manifests, step) or [step])
    return needed


def latest_step(store: CheckpointStore) -> int:
    """The newest committed step.

    Raises:
        ChainIncompleteError: nothing is committed.
    """
    committed = store.committed_steps()
    if not committed:
        raise ChainIncompleteError(store.step_path(0, MANIFEST_NAME), "no committed checkpoint")
    return committed[-1]


def read_chain(store: CheckpointStore, step: int | None) -> list[Manifest]:
    """The manifests a restore of ``step`` (the latest committed one if None) needs, base
    (full) first.

    Raises:
        ChainIncompleteError: no committed checkpoint (``step`` None), or a checkpoint of the
            chain is not committed; the message names it, the checkpoint that needs it and the
            steps that are committed.
        CheckpointCorruptError: a manifest is damaged or the chain does not lead to a full
            checkpoint.
    """
    if step is None:
        step = latest_step(store)
    chain = [read_manifest(store, step)]
    while chain[-1].parent_step is not None:
        child, parent = chain[-1], chain[-1].parent_step
        if parent in {m.step for m in chain} or parent >= child.step:
            raise CheckpointCorruptError(
                store.step_path(child.step, MANIFEST_NAME), f"parent step {parent} is not older"
            )
        try:
            chain.append(read_manifest(store, parent))
        except ChainIncompleteError as exc:
            links = " <- ".join(str(s) for s in [child.base_step, parent, *_steps(chain[::-1])])
            committed = ", ".join(map(str, store.committed_steps())) or "none"
            raise ChainIncompleteError(
                exc.path,
                f"step {parent} is missing (not committed): it is the parent of step "
                f"{child.step}, and step {step} needs the chain {links} (full base "
                f"{child.base_step}); committed steps: {committed}",
            ) from None
    if chain[-1].kind != "full":
        raise ChainIncompleteError(
            store.step_path(chain[-1].step, MANIFEST_NAME),
            "chain does not start at a full checkpoint",
        )
    return _with_one_naming(chain[::-1])


def _with_one_naming(chain: list[Manifest]) -> list[Manifest]:
    """A chain whose older checkpoints name tables bare (before format 3) and newer ones in
    full (a job resumed from an older checkpoint): the bare names take the newest full ones."""
    named = [m for m in chain if m.qualified_tables]
    if not named or len(named) == len(chain):
        return chain
    ids = {t.name for t in named[-1].tables}
    return [
        m if m.qualified_tables else m.with_table_ids(ids_of_bare_names(_names(m), ids))
        for m in chain
    ]


def _names(manifest: Manifest) -> list[str]:
    return [t.name for t in manifest.tables]


def _steps(chain: list[Manifest]) -> list[int]:
    return [m.step for m in chain]
