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

from collections.abc import Callable, Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from embckpt.errors import ChainIncompleteError, CheckpointCorruptError
from embckpt.storage.fs import CheckpointStore
from embckpt.storage.layout import MANIFEST_NAME, rank_file
from embckpt.storage.manifest import FileEntry, Manifest, collector_paused, ids_of_bare_names
from embckpt.storage.rank_parts import check_header, parse_index

Select = Callable[[Manifest], Collection[int] | None]
"""Which ranks' parts of a chain link a reader needs (None: every rank's)."""
PART_READERS = 16  # parts' indexes read at once when a reader needs many


def read_manifest(
    store: CheckpointStore, step: int, ranks: Collection[int] | None = None
) -> Manifest:
    """Reads and checks one committed manifest (its checksum, its step, the paths it names),
    with the rows files of ``ranks``' parts (None: every rank's; format 5, see
    ``storage/rank_parts.py``) and its tables (a format-5 diff may leave them to an older
    manifest).

    Raises:
        ChainIncompleteError: the step has no manifest.
        CheckpointCorruptError: the manifest or a part's index is damaged; names it.
    """
    root = read_root(store, step)
    return load_parts(store, _with_tables(store, root, {}), ranks)


def read_root(store: CheckpointStore, step: int) -> Manifest:
    """The manifest of ``step`` alone: in format 5, without its parts' rows files and maybe
    without its tables (``Manifest.tables_from``).

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


def load_parts(
    store: CheckpointStore, manifest: Manifest, ranks: Collection[int] | None = None
) -> Manifest:
    """``manifest`` with the rows files of ``ranks``' parts (None: every part) added to its
    ``files``: each part's index read (a ranged read of its rank file's header) and checked
    against the manifest. Parts read already are not read again.

    Raises:
        CheckpointCorruptError: an index is missing, damaged or lists what it may not; names
            the rank file.
    """
    if manifest.loaded is None:
        return manifest
    by_rank = {p.rank: p for p in manifest.parts}
    wanted = set(by_rank) if ranks is None else set(ranks) & set(by_rank)
    todo = sorted(wanted - manifest.loaded)
    if not todo:
        return manifest

    def index_of(rank: int) -> list[FileEntry]:
        part, relative = by_rank[rank], rank_file(rank)
        path = store.step_path(manifest.step, relative)
        header = store.read_head(manifest.step, relative, part.index_bytes)
        check_header(header, part, path)
        return parse_index(header, part, path)

    with collector_paused():
        if len(todo) == 1 or store.is_local:  # a local read does not wait: no thread helps
            found = [index_of(rank) for rank in todo]
        else:  # one ranged read each: an object store answers them in parallel
            with ThreadPoolExecutor(min(PART_READERS, len(todo))) as pool:
                found = list(pool.map(index_of, todo))
    added = tuple(e for entries in found for e in entries)
    path = store.step_path(manifest.step, MANIFEST_NAME)
    paths = [rank_file(r) for r in todo] + list(dict.fromkeys(e.path for e in added))
    store.check_contained(manifest.step, paths, path)
    loaded = replace(manifest, files=manifest.files + added, loaded=manifest.loaded | set(todo))
    with collector_paused():
        twice = loaded.repeated_paths()
    if twice:
        raise CheckpointCorruptError(
            path, f"file entry {twice[0]!r} is listed more than once: one file cannot hold both"
        )
    return loaded


def _with_tables(
    store: CheckpointStore, manifest: Manifest, known: Mapping[int, Manifest]
) -> Manifest:
    """``manifest`` with its tables: a format-5 diff that does not list them has those of the
    nearest older link of its chain that does (its full when written; after a merge turned a
    later link into a full, that one), from ``known`` or read. Where a link on the way is
    missing or damaged, the step ``tables_from`` names lists them (verify still reports it).

    Raises:
        ChainIncompleteError: a needed manifest is not committed.
        CheckpointCorruptError: no manifest lists them.
    """
    source = manifest
    while source.tables_from is not None:
        parent = source.parent_step
        if parent is None or parent >= source.step:
            raise CheckpointCorruptError(
                store.step_path(manifest.step, MANIFEST_NAME),
                f"its tables are those of an older link, and step {source.step} has none",
            )
        try:
            source = known.get(parent) or read_root(store, parent)
        except (ChainIncompleteError, CheckpointCorruptError):
            source = _named_source(store, manifest, known)
            break
    return manifest if source is manifest else replace(manifest, tables=source.tables)


def _named_source(
    store: CheckpointStore, manifest: Manifest, known: Mapping[int, Manifest]
) -> Manifest:
    """The manifest ``manifest.tables_from`` names, which must list tables."""
    assert manifest.tables_from is not None
    source = known.get(manifest.tables_from) or read_root(store, manifest.tables_from)
    if source.tables_from is not None or source.step >= manifest.step:
        raise CheckpointCorruptError(
            store.step_path(manifest.step, MANIFEST_NAME),
            f"its tables are those of step {source.step}, which does not list them",
        )
    return source


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
    manifest = Manifest.from_json(text, path, store.verify_keys)
    if manifest.step != step:
        raise CheckpointCorruptError(path, f"manifest says step {manifest.step}, folder {step}")
    # Each path once: the blocks of a packed file share one. Parts' rank files are checked
    # when their index is read (``load_parts``) or the file itself (side state).
    ranks = {p.rank for p in manifest.parts}
    listed = (f.path for f in manifest.files if not (f.role == "rank" and f.rank in ranks))
    store.check_contained(step, list(dict.fromkeys(listed)), path)
    return manifest


def load_manifests(
    store: CheckpointStore, parts: bool = True
) -> tuple[dict[int, Manifest], list[tuple[str, str]]]:
    """Every committed manifest that reads and checks, and (path, reason) of those that do not;
    ``parts`` False reads no part's index (the chain's links and tables only: retention)."""
    manifests: dict[int, Manifest] = {}
    problems: list[tuple[str, str]] = []
    roots: dict[int, Manifest] = {}
    for step in store.committed_steps():
        try:
            roots[step] = read_root(store, step)
        except (CheckpointCorruptError, ChainIncompleteError) as exc:
            problems.append((exc.path, exc.reason))
    for step, root in roots.items():
        try:
            manifests[step] = _with_tables(store, root, roots)
        except (CheckpointCorruptError, ChainIncompleteError) as exc:
            problems.append((exc.path, exc.reason))
            continue
        if not parts or not root.parts:
            continue
        try:  # every part at once; one by one only to tell the bad ones from the good
            manifests[step] = load_parts(store, manifests[step])
            continue
        except CheckpointCorruptError:
            pass
        for part in root.parts:
            try:
                manifests[step] = load_parts(store, manifests[step], [part.rank])
            except CheckpointCorruptError as exc:
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
    newest = store.newest_committed()
    if newest is None:
        raise ChainIncompleteError(store.step_path(0, MANIFEST_NAME), "no committed checkpoint")
    return newest


def read_chain(
    store: CheckpointStore,
    step: int | None,
    select: Select | None = None,
    known: Mapping[int, Manifest] | None = None,
) -> list[Manifest]:
    """The manifests a restore of ``step`` (the latest committed one if None) needs, base
    (full) first; of each, the rows files of the ranks ``select`` picks (None: every rank's).
    Manifests in ``known`` (read before, by step) are not read again: a follower reads only
    the new links of a chain.

    Raises:
        ChainIncompleteError: no committed checkpoint (``step`` None), or a checkpoint of the
            chain is not committed; the message names it, the checkpoint that needs it and the
            steps that are committed.
        CheckpointCorruptError: a manifest is damaged or the chain does not lead to a full
            checkpoint.
    """
    if step is None:
        step = latest_step(store)
    known = known or {}

    def root(at: int) -> Manifest:
        return known.get(at) or read_root(store, at)

    chain = [root(step)]
    while chain[-1].parent_step is not None:
        child, parent = chain[-1], chain[-1].parent_step
        if parent in {m.step for m in chain} or parent >= child.step:
            raise CheckpointCorruptError(
                store.step_path(child.step, MANIFEST_NAME), f"parent step {parent} is not older"
            )
        try:
            chain.append(root(parent))
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
    by_step = {m.step: m for m in chain}
    chain = [_with_tables(store, m, by_step) for m in chain[::-1]]
    chain = [load_parts(store, m, None if select is None else select(m)) for m in chain]
    return _with_one_naming(chain)


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
