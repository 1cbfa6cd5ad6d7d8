"""ZeroMQ socket helpers shared by both sides of the engine link.

The gateway binds one ROUTER; every worker connects one DEALER and speaks first (Hello). A ROUTER
can only address peers it has heard from, so this lets workers on other hosts join a gateway whose
address they know. Each worker life uses a fresh random routing id, so a restarted worker can never
receive frames addressed to its previous life.
"""

from __future__ import annotations

import uuid

import zmq

DEFAULT_ENGINE_ADDRESS = "tcp://127.0.0.1:5557"


def new_worker_id() -> str:
    return uuid.uuid4().hex


def configure_router(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    # Sending to a peer that is gone raises EHOSTUNREACH instead of dropping silently.
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)


def configure_dealer(sock: zmq.Socket, worker_id: str) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, worker_id.encode())
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
