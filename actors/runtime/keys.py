"""CurveZMQ keys for the tcp sockets between actors.

``actorlm keys DIR`` writes one key pair per role (``ROLE.key`` public,
``ROLE.key_secret`` secret, as pyzmq's ``zmq.auth`` reads them). Give every host
the public keys and each actor its own secret one, and name the folder in the
deployment file (``[deploy] keys_dir``). Then every tcp inbox is a CURVE server
that admits only the keys in that folder, every outbox proves its role's key, and
each message's claimed sender must match the key it came with, so a process that
can merely reach a port can neither connect nor pose as another actor. Clients
(``Engine``, any ``client-*`` role) share the ``client`` key pair.

Binding tcp to an address other than loopback without keys is refused unless the
operator says ``--insecure``; ipc sockets live in an owner-only directory instead.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

__all__ = [
    "KEY_ROLES",
    "CurveKeys",
    "InsecureBindError",
    "MissingKeyError",
    "RoleAuthenticator",
    "create_keys",
    "is_loopback",
    "key_name",
]

# The roles `actorlm keys` makes pairs for by default.
KEY_ROLES = (
    "supervisor",
    "gateway",
    "tokenizer",
    "scheduler",
    "cache_manager",
    "worker",
    "lora_loader",
    "client",
)


class MissingKeyError(ValueError):
    """A key that should be there is not (the message says which and where)."""


class InsecureBindError(ValueError):
    pass


def key_name(role: str) -> str:
    """The key pair a role uses: clients share ``client``."""
    return "client" if role.startswith("client") else role


def is_loopback(host: str) -> bool:
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def create_keys(directory: str | Path, roles: tuple[str, ...] = KEY_ROLES) -> list[Path]:
    """A key pair per role in ``directory`` (created owner-only); existing pairs stay."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    made = []
    for role in roles:
        if (folder / f"{role}.key_secret").exists():
            continue
        _public, secret = zmq.auth.create_certificates(folder, role)
        os.chmod(secret, 0o600)
        made.append(Path(secret))
    return made


@dataclass
class CurveKeys:
    """The public keys of every role in ``directory``, and secrets loaded as needed."""

    directory: Path
    publics: dict[str, bytes]  # key name → public key (z85)

    @classmethod
    def load(cls, directory: str | Path) -> CurveKeys:
        folder = Path(directory)
        if not folder.is_dir():
            raise MissingKeyError(
                f"keys_dir {folder} is not a directory (create it: actorlm keys {folder})"
            )
        publics = {}
        for path in sorted(folder.glob("*.key")):
            public, _ = zmq.auth.load_certificate(path)
            publics[path.stem] = public
        if not publics:
            raise MissingKeyError(
                f"no public keys (*.key) in {folder}; create them: actorlm keys {folder}"
            )
        return cls(folder, publics)

    def public(self, role: str) -> bytes:
        name = key_name(role)
        if name not in self.publics:
            raise MissingKeyError(f"no public key for {role!r} in {self.directory} ({name}.key)")
        return self.publics[name]

    def pair(self, role: str) -> tuple[bytes, bytes]:
        """``role``'s own (public, secret) keys."""
        path = self.directory / f"{key_name(role)}.key_secret"
        if not path.exists():
            raise MissingKeyError(f"no secret key for {role!r}: {path} is missing")
        public, secret = zmq.auth.load_certificate(path)
        if secret is None:
            raise MissingKeyError(f"{path} holds no secret key")
        return public, secret

    def user_ids(self) -> dict[bytes, str]:
        """Raw public key → key name: who a CURVE client proved to be."""
        return {zmq.utils.z85.decode(k): name for name, k in self.publics.items()}


class RoleAuthenticator(ThreadAuthenticator):
    """ZAP for a context: admits the keys of ``keys`` only; a message's User-Id is the
    name of the key it came with."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], keys: CurveKeys) -> None:
        super().__init__(context)
        self._names = keys.user_ids()
        self.start()
        self.configure_curve(domain="*", location=str(keys.directory))

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self._names.get(client_public_key, "")
