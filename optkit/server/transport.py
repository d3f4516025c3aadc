"""uvicorn's HTTP/1.1 protocol (h11) with a deadline on each request's head.

uvicorn closes a connection that idles between requests after `timeout_keep_alive`, but not one
that trickles a request line and headers byte by byte (slowloris): the first byte cancels that
timer. Here each request's head must arrive within HEAD_TIMEOUT_S of the connection being ready
for it (opened, or the previous response sent); a body then has BodyLimit's deadline (guards.py).
"""

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

KEEP_ALIVE_S = 5
HEAD_TIMEOUT_S = 10.0


class HeadDeadlineProtocol(H11Protocol):
    head_timeout_s = HEAD_TIMEOUT_S
    _head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
        super().connection_lost(exc)

    def _arm_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
        self._head_deadline = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():  # no request line and headers yet
            self.transport.close()
