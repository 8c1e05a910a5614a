"""The plane link's CURVE keys: written by `nanoplane keys DIR`, read by both planes.

ZeroMQ's CURVE (libsodium, carried by pyzmq's wheels) encrypts the link and authenticates both ends:
the control plane accepts only data planes whose public key is in DIR/authorized/, and a data plane
talks only to the control plane whose public key it holds. What each side reads from DIR:

    control plane  controlplane.key_secret (its keypair), authorized/*.key (data planes it accepts)
    data plane     dataplane.key_secret (its keypair), controlplane.key (the control plane's public key)

So each side can be given only its own files (docker-compose.yml mounts them as secrets).
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

log = logging.getLogger("nanoplane.plane_keys")

CONTROLPLANE, DATAPLANE, AUTHORIZED = "controlplane", "dataplane", "authorized"
KEYS_HELP = ("folder of the plane link's CURVE keys (`nanoplane keys DIR` writes them); the control plane reads "
             "controlplane.key_secret and authorized/*.key, a data plane dataplane.key_secret and controlplane.key")
INSECURE_HELP = "allow a tcp:// plane link without --plane-keys: unauthenticated and in clear (a warning is logged)"


def write_keys(folder: str | os.PathLike) -> list[Path]:
    """Write a keypair for the control plane and one for data planes into `folder`, the data planes'
    public key under authorized/; refuse (FileExistsError) to overwrite keys already there."""
    root = Path(folder)
    names = [f"{CONTROLPLANE}.key", f"{CONTROLPLANE}.key_secret", f"{DATAPLANE}.key_secret",
             f"{AUTHORIZED}/{DATAPLANE}.key"]
    if taken := [n for n in names if (root / n).exists()]:
        raise FileExistsError(f"{root} already holds {', '.join(taken)}: remove them or pick another folder")
    (root / AUTHORIZED).mkdir(parents=True, exist_ok=True)
    for name in (CONTROLPLANE, DATAPLANE):
        zmq.auth.create_certificates(root, name)
        (root / f"{name}.key_secret").chmod(0o600)  # a secret key: its owner's alone
    shutil.move(root / f"{DATAPLANE}.key", root / AUTHORIZED / f"{DATAPLANE}.key")
    return [root / n for n in names]


def _load(path: Path, secret: bool) -> tuple[bytes, bytes | None]:
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the plane key {path}: {e}") from None
    if secret and not secret_key:
        raise ValueError(f"{path} holds no secret key")
    return public, secret_key


@dataclass(frozen=True)
class PlaneKeys:
    """One side's keys: its own keypair, and the control plane's public key (data planes) or the folder of
    authorized data-plane public keys (the control plane)."""

    public: bytes
    secret: bytes
    server_public: bytes | None = None  # a data plane's: the control plane it accepts
    authorized: str = ""  # the control plane's: folder of the accepted data planes' public keys

    @classmethod
    def control_plane(cls, folder: str | os.PathLike) -> PlaneKeys:
        root = Path(folder)
        public, secret = _load(root / f"{CONTROLPLANE}.key_secret", secret=True)
        authorized = root / AUTHORIZED
        if not sorted(authorized.glob("*.key")):
            raise ValueError(f"{authorized} holds no data-plane public key (*.key): no data plane could attach")
        return cls(public, secret, authorized=str(authorized))

    @classmethod
    def data_plane(cls, folder: str | os.PathLike) -> PlaneKeys:
        root = Path(folder)
        public, secret = _load(root / f"{DATAPLANE}.key_secret", secret=True)
        server, _ = _load(root / f"{CONTROLPLANE}.key", secret=False)
        return cls(public, secret, server_public=server)

    def apply(self, sock: zmq.Socket) -> None:
        """Set CURVE on `sock` before it binds (server) or connects (client)."""
        sock.curve_secretkey, sock.curve_publickey = self.secret, self.public
        if self.server_public is None:
            sock.curve_server = True
        else:
            sock.curve_serverkey = self.server_public


def plane_security(address: str, keys_dir: str | None, insecure: bool, side: str) -> PlaneKeys | None:
    """The keys `side` ("control plane" or "data plane") uses on `address`, or None for a link without
    CURVE. ValueError (one line) for tcp:// without keys unless `insecure`."""
    if keys_dir:
        return PlaneKeys.control_plane(keys_dir) if side == "control plane" else PlaneKeys.data_plane(keys_dir)
    if address.startswith("tcp://"):
        if not insecure:
            raise ValueError(f"the plane link {address} is tcp:// without keys: give --plane-keys DIR (written by "
                             "`nanoplane keys DIR`), or --insecure-plane on a trusted network")
        log.warning("the plane link %s is neither authenticated nor encrypted (--insecure-plane): anyone who "
                    "reaches it can read prompts and answer them", address)
    return None
