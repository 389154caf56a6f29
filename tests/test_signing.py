"""Signed checkpoints: a reader holding the key restores, follows and verifies them, and refuses
an unsigned checkpoint, a forged manifest, a file swapped for one with the same CRC32C, a
signature copied from another manifest and a key it does not trust, naming the file. Without
a key, the files are those of format 5, as before signing existed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import google_crc32c
import pytest

from embckpt import Follower, UntrustedCheckpointError, generate_key_pair
from embckpt.cli import main
from embckpt.examples.launcher import run_ranks
from embckpt.storage.fs import CheckpointStore
from embckpt.storage.layout import MANIFEST_NAME
from embckpt.storage.manifest import _checksum


def _write_and_restore(rank: int, world_size: int, root: str, keys: dict[str, str]) -> dict:
    """A signed chain (thread writer, then the writer process) and an unsigned one, lossless;
    each restored (the signed ones with the public key) and compared with the live state."""
    import toy_model as tm

    from embckpt import CheckpointConfig, Checkpointer

    out: dict[str, Any] = {}
    for name, key, writer in (
        ("signed", keys["private"], "thread"),
        ("signed-process", keys["private"], "process"),
        ("unsigned", None, "thread"),
    ):
        config = CheckpointConfig(
            policy="one_shot",
            fsync=False,
            signing_key=key,
            writer=writer,
            row_group_rows=32,
        )
        model, opt = tm.build(world_size, seed=0)
        verify_key = keys["public"] if key else None
        with Checkpointer(
            model, f"{root}/{name}", optimizer=opt, config=config, verify_key=verify_key
        ) as ckpt:
            for step in range(1, 4):
                tm.train_step(model, opt, step, rank, hot=120)
                ckpt.save(step).wait()
            live = tm.snapshot_state(model, opt, rank)
            tm.train_step(model, opt, 4, rank, hot=120)
            restored = ckpt.restore(3)
            out[name] = {
                "step": restored,
                "diff": tm.differences(live, tm.snapshot_state(model, opt, rank)),
            }
        if key is None:  # a job that requires a signature refuses this directory
            with Checkpointer(
                model, f"{root}/{name}", optimizer=opt, config=config, verify_key=keys["public"]
            ) as refusing:
                with pytest.raises(UntrustedCheckpointError, match="not signed") as info:
                    refusing.restore(3)
            out["refused"] = str(info.value)
    return out


@pytest.fixture(scope="module")
def signed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str], list[dict]]:
    root = tmp_path_factory.mktemp("signed")
    keys = {"private": str(root / "key.pem"), "public": str(root / "key.pub")}
    generate_key_pair(keys["private"], keys["public"])
    keys["other"] = str(root / "other.pub")
    generate_key_pair(root / "other.pem", keys["other"])
    return root, keys, run_ranks(_write_and_restore, 2, str(root), keys)


def _copy(signed, tmp_path: Path, name: str = "signed") -> Path:
    shutil.copytree(signed[0] / name, tmp_path / name)
    return tmp_path / name


def _refusal(directory: Path, key: str | list[str]) -> str:
    """What a follower holding ``key`` says of ``directory``'s newest step (None: served)."""
    follower = Follower(directory, verify_key=key)
    assert not follower.poll()
    return str(follower.last_error)


def test_signed_checkpoints_restore_follow_and_verify_with_the_key(signed) -> None:
    root, keys, results = signed
    for rank, out in enumerate(results):
        for name in ("signed", "signed-process"):
            assert out[name]["step"] == 3 and out[name]["diff"] == [], (rank, name)
    for name in ("signed", "signed-process"):
        text = (root / name / "step_000000000003" / MANIFEST_NAME).read_text()
        body = json.loads(text)
        assert body["format_version"] == 6 and body["signature"]["algorithm"] == "ed25519"
        follower = Follower(root / name, verify_key=keys["public"])
        assert follower.poll() and follower.step == 3
        assert main(["verify", str(root / name), "--key", keys["public"]]) == 0
        # Rotation: several keys, the right one among them.
        assert (
            main(["verify", str(root / name), "--key", keys["other"], "--key", keys["public"]]) == 0
        )


def test_without_a_key_files_are_as_before(signed) -> None:
    root, _, results = signed
    assert all(out["unsigned"]["diff"] == [] for out in results)
    assert all(MANIFEST_NAME in out["refused"] for out in results)
    folder = root / "unsigned" / "step_000000000003"
    body = json.loads((folder / MANIFEST_NAME).read_text())
    assert body["format_version"] == 5 and "signature" not in body
    headers = b"".join(p.read_bytes()[:4096] for p in (folder / "dense").glob("rank_*"))
    assert b"digest" not in (folder / MANIFEST_NAME).read_bytes() and b"digest" not in headers
    assert (
        b"digest"
        in (root / "signed" / "step_000000000003" / "dense" / "rank_00000.safetensors").read_bytes()
    )


def test_an_unsigned_checkpoint_and_an_untrusted_key_are_refused(signed) -> None:
    root, keys, _ = signed
    assert "not signed" in _refusal(root / "unsigned", keys["public"])
    assert MANIFEST_NAME in _refusal(root / "unsigned", keys["public"])
    assert "not among the trusted keys" in _refusal(root / "signed", keys["other"])
    assert main(["verify", str(root / "unsigned"), "--key", keys["public"]]) == 1
    store = CheckpointStore(root / "unsigned", verify_keys=None)
    assert store.newest_committed() == 3  # without a key, read as ever


def _rewrite(path: Path, edit) -> None:
    """``edit`` applied to a manifest's fields, its checksum made right again (what a forger
    can always do: the checksum is no secret)."""
    body = json.loads(path.read_text())
    body.pop("checksum")
    edit(body)
    body["checksum"] = _checksum(body)
    path.write_text(json.dumps(body, sort_keys=True))


def test_a_forged_manifest_and_a_copied_signature_are_refused(signed, tmp_path: Path) -> None:
    _, keys, _ = signed
    directory = _copy(signed, tmp_path)
    manifest = directory / "step_000000000003" / MANIFEST_NAME
    original = manifest.read_text()
    _rewrite(manifest, lambda body: body["stats"].update(rows_written=1))
    refusal = _refusal(directory, keys["public"])
    assert "signature does not verify" in refusal and str(manifest) in refusal
    assert main(["verify", str(directory), "--key", keys["public"]]) == 1
    manifest.write_text(original)
    step2 = json.loads((directory / "step_000000000002" / MANIFEST_NAME).read_text())
    _rewrite(manifest, lambda body: body.update(signature=step2["signature"]))
    assert "signature does not verify" in _refusal(directory, keys["public"])
    manifest.write_text(original)
    assert Follower(directory, verify_key=keys["public"]).poll()


def _same_crc32c(data: bytes, at: int, change: int, fix_at: int) -> bytes:
    """``data`` with byte ``at`` changed and the 4 bytes at ``fix_at`` chosen so that the
    CRC32C of ``data`` (and of any range holding both) stays the same: a CRC is affine in
    its input bits, so 32 free bits solve for any 32-bit difference (GF(2) elimination)."""
    size = len(data)

    def effect(position: int, bit: int) -> int:  # a flipped bit's change to the CRC
        zero = bytes(size)
        flipped = bytearray(zero)
        flipped[position] ^= 1 << bit
        return google_crc32c.value(bytes(flipped)) ^ google_crc32c.value(zero)

    forged = bytearray(data)
    forged[at] ^= change
    target = google_crc32c.value(bytes(forged)) ^ google_crc32c.value(data)
    columns = [(effect(fix_at + i // 8, i % 8), 1 << i) for i in range(32)]
    rows: list[tuple[int, int]] = []  # (crc change, which free bits), reduced
    for value, bits in columns:
        for pivot, pivot_bits in rows:
            if value ^ pivot < value:
                value, bits = value ^ pivot, bits ^ pivot_bits
        if value:
            rows.append((value, bits))
            rows.sort(reverse=True)
    chosen = 0
    for pivot, pivot_bits in rows:
        if target ^ pivot < target:
            target, chosen = target ^ pivot, chosen ^ pivot_bits
    assert target == 0
    for i in range(32):
        if chosen >> i & 1:
            forged[fix_at + i // 8] ^= 1 << (i % 8)
    return bytes(forged)


def test_a_file_swapped_for_one_with_the_same_crc32c_is_refused(signed, tmp_path: Path) -> None:
    _, keys, _ = signed
    directory = _copy(signed, tmp_path)
    rows = max((directory / "step_000000000003").rglob("*.parquet"), key=lambda p: p.stat().st_size)
    data = rows.read_bytes()
    forged = _same_crc32c(data, at=200, change=0x40, fix_at=204)
    assert forged != data and google_crc32c.value(forged) == google_crc32c.value(data)
    rows.write_bytes(forged)
    refusal = _refusal(directory, keys["public"])
    assert "SHA-256 digest does not match" in refusal and rows.name in refusal
    assert main(["verify", str(directory), "--key", keys["public"]]) == 1
    unsigned = _copy(signed, tmp_path, "unsigned")  # without digests, the CRC cannot tell
    plain = max((unsigned / "step_000000000003").rglob("*.parquet"), key=lambda p: p.stat().st_size)
    data = plain.read_bytes()
    plain.write_bytes(_same_crc32c(data, at=200, change=0x40, fix_at=204))
    assert main(["verify", str(unsigned)]) == 0


def test_cli_keygen_writes_a_pair_and_never_overwrites(tmp_path: Path) -> None:
    private, public = tmp_path / "k.pem", tmp_path / "k.pub"
    assert main(["keygen", str(private), str(public)]) == 0
    assert private.stat().st_mode & 0o077 == 0 and b"PUBLIC KEY" in public.read_bytes()
    assert main(["keygen", str(private), str(tmp_path / "other.pub")]) == 2
