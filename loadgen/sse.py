"""Server-sent events, bytes to `data` payloads, with no network in sight (so tests feed it bytes).

    network reads (any split) ──▶ SSEParser.feed() ──▶ complete events' data strings

Per the SSE spec an event ends at a blank line; its `data:` lines are joined with newlines; lines
starting with `:` are comments (keep-alives); other fields (`event:`, `id:`, `retry:`) are ignored
because OpenAI-compatible servers put everything in `data`. Reads may split a line or a UTF-8
character anywhere, so the parser buffers bytes and decodes only whole lines.
"""

from __future__ import annotations


class SSEParser:
    def __init__(self) -> None:
        self._buf = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        """Add bytes; return the data of every event they completed, in order."""
        self._buf += chunk
        events: list[str] = []
        while True:
            nl = self._buf.find(b"\n")
            if nl < 0:
                break
            raw, self._buf = self._buf[:nl], self._buf[nl + 1:]
            event = self._line(raw.rstrip(b"\r").decode("utf-8", errors="replace"))
            if event is not None:
                events.append(event)
        return events

    def flush(self) -> list[str]:
        """At end of stream: a last event the server did not close with a blank line."""
        events = self.feed(b"\n") if self._buf else []
        if self._data:
            events.append("\n".join(self._data))
            self._data = []
        return events

    def _line(self, line: str) -> str | None:
        if not line:
            if not self._data:
                return None
            event, self._data = "\n".join(self._data), []
            return event
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None
