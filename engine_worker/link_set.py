"""One worker joined to several gateway processes (a gateway run with --api-server-count K binds K
engine links; the worker gets all K addresses, comma-separated).

    K WorkerLinks (each: its own DEALER, Hello, heartbeats) ──put()──▶ one inbound queue
        a Generate: its request remembered as link i's; a Reset: tagged with link i
    engine loop ──StepOutputs──▶ split by each row's request ──▶ the link its Generate came from

Each link announces 1/K of max_num_seqs (open_link does), so the K gateways together send what
one would. A Reset from one gateway (it restarted) aborts only the requests that came from it.
The engine loop sees the same surface as one WorkerLink's (inbound, cancel_arrivals, stats,
draining, rejected, open_outbound, start, stop, reset_scope).
"""

from __future__ import annotations

import queue
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from engine_worker.link import WorkerLink
from protocol import messages as m


@dataclass(frozen=True)
class LinkReset(m.Reset):
    """A Reset, local to this process: which link's gateway asked for it."""

    origin: int = 0


class _Inbox:
    """What link i puts into: the shared queue, with each request's origin noted."""

    def __init__(self, links: LinkSet, index: int) -> None:
        self.links, self.index = links, index

    def put(self, msg: Any) -> None:
        if isinstance(msg, m.Generate):
            self.links.origin[msg.request_id] = [self.index, msg.params.n]
        elif isinstance(msg, m.Reset):
            msg = LinkReset(msg.reason, self.index)
        self.links.inbound.put(msg)


class LinkSet:
    def __init__(self, links: list[WorkerLink]) -> None:
        self.links = links
        self.inbound: queue.Queue[Any] = queue.Queue()
        self.cancel_arrivals: dict[str, float] = {}
        # request id -> [link index, choices not finished]; written by the links' I/O threads
        # (a Generate), updated and emptied by the engine loop as the frames go out
        self.origin: dict[str, list[int]] = {}
        for i, link in enumerate(links):
            link.inbound = _Inbox(self, i)  # type: ignore[assignment]
            link.cancel_arrivals = self.cancel_arrivals

    @property
    def worker_id(self) -> str:
        return self.links[0].hello.worker_id  # one Hello, sent by every link

    @property
    def rejected(self) -> str | None:
        return next((link.rejected for link in self.links if link.rejected is not None), None)

    @property
    def stats(self) -> m.Stats:
        return self.links[0].stats

    @stats.setter
    def stats(self, value: m.Stats) -> None:
        for link in self.links:
            link.stats = value

    @property
    def draining(self) -> bool:
        return self.links[0].draining

    @draining.setter
    def draining(self, value: bool) -> None:
        for link in self.links:
            link.draining = value

    def forget(self, request_id: str) -> None:
        """A request that ended with no frame to send (cancelled while its grammar was being
        built): no finish will pop its origin, so it is popped here."""
        self.origin.pop(request_id, None)

    def start(self) -> None:
        for link in self.links:
            link.start()

    def quiet(self, seconds: float, wait_s: float = 1.0) -> None:
        for link in self.links:
            link.quiet(seconds, wait_s)

    def stop(self, dying_reason: str | None = None, timeout: float = 2.0) -> None:
        for link in self.links:
            link.stop(dying_reason, timeout)

    def reset_scope(self, msg: m.Reset, request_ids: Iterable[str]) -> list[str]:
        """The requests a Reset ends: those its gateway sent."""
        origin = msg.origin if isinstance(msg, LinkReset) else None
        return [r for r in request_ids if origin is None or self._link_of(r) == origin]

    def open_outbound(self) -> RoutedOutbound:
        return RoutedOutbound(self, [link.open_outbound() for link in self.links])

    def _link_of(self, request_id: str) -> int | None:
        entry = self.origin.get(request_id)
        return None if entry is None else entry[0]


class RoutedOutbound:
    """The engine loop's way out: each message to the link its request came from."""

    def __init__(self, links: LinkSet, outs: list[Any]) -> None:
        self.links, self.outs = links, outs

    def send(self, msg: Any) -> None:
        origin = self.links.origin
        if isinstance(msg, m.StepOutputs):
            parts: dict[int, list[m.TokenOutput]] = defaultdict(list)
            for out in msg.outputs:
                entry = origin.get(out.request_id)
                if entry is None:
                    continue  # not a request any gateway of ours sent
                parts[entry[0]].append(out)
                if out.finish_reason is not None:
                    entry[1] -= 1
                    if entry[1] <= 0:
                        origin.pop(out.request_id, None)
            for index, outputs in parts.items():
                self.outs[index].send(m.StepOutputs(outputs))
        elif isinstance(msg, m.RequestError):
            entry = origin.pop(msg.request_id, None)
            if entry is not None:
                self.outs[entry[0]].send(msg)
        else:
            for out in self.outs:
                out.send(msg)

    def close(self) -> None:
        for out in self.outs:
            out.close()
