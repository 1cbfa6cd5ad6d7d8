"""ZeroMQ socket helpers shared by both sides of the engine link: options, limits, CURVE keys.

The gateway binds one ROUTER; every worker connects one DEALER and speaks first (Hello). A ROUTER
can only address peers it has heard from, so this lets workers on other hosts join a gateway whose
address they know. Each worker life uses a fresh random routing id, so a restarted worker can never
receive frames addressed to its previous life.

Security (CURVE): the gateway holds a key pair and a folder of the worker public keys it allows;
each worker holds its own key pair and the gateway's public key. Keys are pyzmq certificate files
(`kestrel-keygen` writes them). The ROUTER is a CURVE server; the gateway runs pyzmq's ZAP
authenticator before it binds, so a client whose key is not in the folder fails the handshake and
no frame of it is ever read. Without keys the link is plain TCP: fine on loopback, warned about
elsewhere.

Limits: MAXMSGSIZE makes libzmq drop the connection of a peer that announces a message over
codec.MAX_FRAME_BYTES before reading it whole; finite high-water marks bound what either side
queues for a slow or absent peer.
"""

from __future__ import annotations

import ipaddress
import uuid
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

from protocol.codec import MAX_FRAME_BYTES

DEFAULT_ENGINE_ADDRESS = "tcp://127.0.0.1:5557"
# Messages queued per peer before sends fail (ROUTER: EAGAIN, then the peer counts as gone) or
# receives stop being read from the network. Token frames are small; a Hello is at most one.
LINK_HWM = 10_000


def new_worker_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class KeyPair:
    public: bytes  # Z85, 40 bytes
    secret: bytes


def load_secret_key(path: str | Path) -> KeyPair:
    """A key pair from a pyzmq `.key_secret` certificate file (it holds both keys)."""
    public, secret = zmq.auth.load_certificate(str(path))
    if not secret:
        raise ValueError(f"{path} holds no secret key (pass the .key_secret file)")
    return KeyPair(public, secret)


def load_public_key(path: str | Path) -> bytes:
    """The public key of a pyzmq `.key` (or `.key_secret`) certificate file."""
    public, _ = zmq.auth.load_certificate(str(path))
    return public


def is_loopback(address: str) -> bool:
    """Whether a ZeroMQ address stays on this host (ipc/inproc, or tcp on 127.0.0.0/8 or ::1)."""
    if address.startswith(("ipc://", "inproc://")):
        return True
    host = address.removeprefix("tcp://").rsplit(":", 1)[0].split(";")[-1].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name or "*": not provably local
        return False


def _limits(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + 64)  # + the type frame and framing
    sock.setsockopt(zmq.SNDHWM, LINK_HWM)
    sock.setsockopt(zmq.RCVHWM, LINK_HWM)


def configure_router(sock: zmq.Socket, keys: KeyPair | None = None) -> None:
    _limits(sock)
    # Sending to a peer that is gone raises EHOSTUNREACH instead of dropping silently (and with
    # a finite HWM, a send to a peer that stopped reading raises EAGAIN instead of blocking).
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if keys is not None:
        sock.curve_server = True
        sock.curve_publickey = keys.public
        sock.curve_secretkey = keys.secret


def configure_dealer(sock: zmq.Socket, worker_id: str, keys: KeyPair | None = None,
                     server_public: bytes | None = None) -> None:
    _limits(sock)
    sock.setsockopt(zmq.IDENTITY, worker_id.encode())
    # Queue nothing for a connection that is not up: while the gateway is away, frames (and
    # the 3.5 MB Hello) are refused at send instead of piling up, and none reach a restarted
    # gateway stale.
    sock.setsockopt(zmq.IMMEDIATE, 1)
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
    if keys is not None and server_public is not None:
        sock.curve_serverkey = server_public
        sock.curve_publickey = keys.public
        sock.curve_secretkey = keys.secret
