"""A node's identity: an Ed25519 key pair kept in the node's state directory.

The coordinator binds a node id to the public key that first registered it, and every later call of the node is
signed with the private key (protocol.auth), so that a token holder cannot speak for another member. The run token
proves membership of the run; the key proves which member is speaking.
"""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

KEY_FILE = "node.key"
"""The key's file name in a node's state directory (PKCS#8 PEM, readable by its owner only)."""
PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64


class IdentityError(ValueError):
    """A key file that cannot be read as a node key."""


class NodeKey:
    """A node's private key: signs its calls; `public` is what the coordinator binds its id to."""

    def __init__(self, private: Ed25519PrivateKey) -> None:
        self._private = private
        self.public = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    @classmethod
    def generate(cls) -> NodeKey:
        """A fresh key (kept only in memory)."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load_or_create(cls, state_dir: str | Path) -> tuple[NodeKey, bool]:
        """The key in state_dir/node.key, created there on first use; returns it and whether it was created.
        IdentityError when the file is there but holds no Ed25519 key, or cannot be read or written."""
        path = Path(state_dir) / KEY_FILE
        try:
            if path.exists():
                try:
                    private = serialization.load_pem_private_key(path.read_bytes(), password=None)
                except (ValueError, TypeError) as e:
                    raise IdentityError(f"{path} is not a node key: {e}") from None
                if not isinstance(private, Ed25519PrivateKey):
                    raise IdentityError(f"{path} holds another kind of key than Ed25519")
                return cls(private), False
            key = cls.generate()
            key._write(path)
            return key, True
        except OSError as e:
            raise IdentityError(f"cannot keep the node's key in {state_dir}: {e.strerror or e}") from None

    def _write(self, path: Path) -> None:
        """Write the key under a temporary name, readable by its owner only, and rename it when whole."""
        path.parent.mkdir(parents=True, exist_ok=True)
        pem = self._private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        tmp = path.with_name(f".{path.name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, pem)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def sign(self, message: bytes) -> bytes:
        """The signature of message."""
        return self._private.sign(message)


def verify(public_key: bytes, signature: bytes, message: bytes) -> bool:
    """True when signature is public_key's signature of message (False for a malformed key or signature)."""
    if len(public_key) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
    except (InvalidSignature, ValueError):  # ValueError: 32 bytes that are no point of the curve
        return False
    return True
