"""Signed checkpoints: an Ed25519 signature over the manifest, SHA-256 digests of its files.

CRC32C, which every manifest holds, catches accidents; anyone can compute one for a forged
file. A signed checkpoint (format 6: format 5 plus digests and a signature) is trusted along
one chain, each link a SHA-256 digest or the signature:

    signature -> MANIFEST.json -> each part's rank file header (``index_digest``) and the
    dense file (``digest``) -> each rows file's row groups and footer (``digest``,
    ``footer_digest``, in the header's index)

so a reader fetching only some row groups still checks every byte it uses. The signature
covers the manifest's canonical JSON (sorted keys, no spaces) without its ``checksum`` and
``signature`` fields, prefixed by :data:`CONTEXT`; it names its public key, so a reader holding
several keys (rotation) knows which one to try.

Cryptography comes from the ``cryptography`` package (its Ed25519 is OpenSSL's); digests from
``hashlib``. Nothing here is hand-written crypto.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from embckpt.errors import ConfigError, UntrustedCheckpointError, import_extra

DIGEST_PREFIX = "sha256:"
SIGNATURE_ALGORITHM = "ed25519"
CONTEXT = b"embckpt manifest signature v1\n"
"""Prefixed to what is signed, so a signature made for anything else never verifies here."""


def digest(data: Any) -> str:
    """The SHA-256 digest of ``data`` (bytes, a buffer), as a manifest spells it."""
    return DIGEST_PREFIX + hashlib.sha256(memoryview(data)).hexdigest()


def check_digest(data: Any, expected: str, path: str, what: str = "") -> None:
    """Checks ``data`` against a digest this module wrote.

    Raises:
        UntrustedCheckpointError: the digest differs (``what`` says which bytes); names ``path``.
    """
    if not expected.startswith(DIGEST_PREFIX):
        raise UntrustedCheckpointError(path, f"digest {expected!r} is not SHA-256")
    if digest(data) != expected:
        part = f"{what} " if what else ""
        raise UntrustedCheckpointError(
            path, f"{part}SHA-256 digest does not match the signed manifest: altered or swapped"
        )


def _crypto() -> Any:
    return import_extra("cryptography.hazmat.primitives.asymmetric.ed25519", "sign")


def _serialization() -> Any:
    from cryptography.hazmat.primitives import serialization

    return serialization


def key_id(public_key: Any) -> str:
    """A public key's name in a signature: its 32 raw bytes in hex."""
    s = _serialization()
    return public_key.public_bytes(s.Encoding.Raw, s.PublicFormat.Raw).hex()


class SigningKey:
    """An Ed25519 private key that signs manifests.

    Args:
        path: a PEM (PKCS #8, unencrypted) private key file, as ``openssl genpkey -algorithm
            ed25519`` or :func:`generate_key_pair` writes it.

    Raises:
        ConfigError: the file is missing, or not an Ed25519 private key; names it.
    """

    def __init__(self, path: str | Path) -> None:
        ed25519 = _crypto()
        try:
            key = _serialization().load_pem_private_key(Path(path).read_bytes(), password=None)
        except (OSError, ValueError, TypeError) as exc:
            raise ConfigError(f"{path}: not a readable PEM private key: {exc}") from exc
        if not isinstance(key, ed25519.Ed25519PrivateKey):
            raise ConfigError(f"{path}: not an Ed25519 private key ({type(key).__name__})")
        self.path = str(path)
        self._key = key
        self.key_id = key_id(key.public_key())

    def sign(self, message: bytes) -> dict[str, str]:
        """The manifest's ``signature`` field for ``message`` (:func:`signed_bytes`)."""
        return {
            "algorithm": SIGNATURE_ALGORITHM,
            "key": self.key_id,
            "value": self._key.sign(CONTEXT + message).hex(),
        }

    def __reduce__(self) -> tuple[Any, ...]:  # sent to a writer process by its path
        return (SigningKey, (self.path,))


class VerifyKeys:
    """The public keys a reader trusts (one, or several while keys rotate)."""

    def __init__(self, keys: Iterable[Any]) -> None:
        self._by_id = {key_id(k): k for k in keys}
        if not self._by_id:
            raise ValueError("no verify key given")

    @property
    def ids(self) -> list[str]:
        return sorted(self._by_id)

    def __reduce__(self) -> tuple[Any, ...]:  # travels with a store to a writer process
        return (_keys_from_ids, (self.ids,))

    def check(self, message: bytes, signature: Mapping[str, Any] | None, path: str) -> None:
        """Checks a manifest's signature over ``message``.

        Raises:
            UntrustedCheckpointError: unsigned, signed by a key not trusted, or the signature
                does not verify (forged, or copied from another manifest); names ``path``.
        """
        if signature is None:
            raise UntrustedCheckpointError(
                path, "the checkpoint is not signed, and a key is required"
            )
        try:
            algorithm, name, value = signature["algorithm"], signature["key"], signature["value"]
        except (KeyError, TypeError) as exc:
            raise UntrustedCheckpointError(path, f"signature is not valid: {exc}") from exc
        if algorithm != SIGNATURE_ALGORITHM:
            raise UntrustedCheckpointError(
                path, f"signature algorithm {algorithm!r} is not ed25519"
            )
        key = self._by_id.get(name)
        if key is None:
            raise UntrustedCheckpointError(
                path, f"signed by key {str(name)[:16]}..., which is not among the trusted keys"
            )
        from cryptography.exceptions import InvalidSignature

        try:
            key.verify(bytes.fromhex(value), CONTEXT + message)
        except (InvalidSignature, ValueError, TypeError):
            raise UntrustedCheckpointError(
                path,
                "signature does not verify: the manifest was altered, or the signature "
                "belongs to another manifest",
            ) from None


def _keys_from_ids(ids: list[str]) -> VerifyKeys:
    ed25519 = _crypto()
    return VerifyKeys(ed25519.Ed25519PublicKey.from_public_bytes(bytes.fromhex(i)) for i in ids)


def load_verify_keys(keys: Any) -> VerifyKeys | None:
    """Trusted keys from what a user passes: None; a PEM public key file's path; PEM bytes; an
    ``Ed25519PublicKey``; a :class:`VerifyKeys`; or a list of any of these.

    Raises:
        ConfigError: a key cannot be read or is not an Ed25519 public key; names it.
    """
    if keys is None or isinstance(keys, VerifyKeys):
        return keys
    ed25519 = _crypto()
    many = keys if isinstance(keys, (list, tuple)) else [keys]
    loaded = []
    for key in many:
        if isinstance(key, ed25519.Ed25519PublicKey):
            loaded.append(key)
            continue
        try:
            pem = key if isinstance(key, bytes) else Path(key).read_bytes()
            public = _serialization().load_pem_public_key(pem)
        except (OSError, ValueError, TypeError) as exc:
            raise ConfigError(f"{key}: not a readable PEM public key: {exc}") from exc
        if not isinstance(public, ed25519.Ed25519PublicKey):
            raise ConfigError(f"{key}: not an Ed25519 public key ({type(public).__name__})")
        loaded.append(public)
    if not loaded:
        raise ConfigError("verify_key: an empty list trusts no key")
    return VerifyKeys(loaded)


def generate_key_pair(private_path: str | Path, public_path: str | Path) -> None:
    """Writes a new Ed25519 key pair as PEM files (the private one readable by its owner only)."""
    ed25519, s = _crypto(), _serialization()
    key = ed25519.Ed25519PrivateKey.generate()
    private = key.private_bytes(s.Encoding.PEM, s.PrivateFormat.PKCS8, s.NoEncryption())
    public = key.public_key().public_bytes(s.Encoding.PEM, s.PublicFormat.SubjectPublicKeyInfo)
    Path(private_path).touch(mode=0o600)
    Path(private_path).write_bytes(private)
    Path(public_path).write_bytes(public)


def require_digests(entries: Iterable[Any], path: str) -> None:
    """Refuses a signed manifest (or index) listing a file without its digest.

    Raises:
        UntrustedCheckpointError: names the manifest and the file.
    """
    for entry in entries:
        if not entry.digest:
            raise UntrustedCheckpointError(
                path, f"file {entry.path!r} has no SHA-256 digest in a signed checkpoint"
            )
