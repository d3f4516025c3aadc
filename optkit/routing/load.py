"""What the router knows of each engine without asking it: requests in flight, how long they
waited for their first output, and which engine last saw a prompt prefix. No torch."""

import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass


@dataclass
class Ticket:
    name: str
    started: float
    first_output: float | None = None


class LoadTracker:
    """Per model: requests in flight and their queue wait, measured as the time from dispatch to
    the first output (queueing plus the prefill). `queue_wait(name)` is the larger of the oldest
    request still waiting for its first output and the last wait observed within `window_s`."""

    def __init__(self, names: Sequence[str], window_s: float = 5.0, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.window_s = window_s
        self.pending: dict[str, dict[int, Ticket]] = {name: {} for name in names}  # no first output yet
        self.running: dict[str, int] = dict.fromkeys(names, 0)
        self.last_wait: dict[str, tuple[float, float]] = {}  # name -> (when, wait)
        self.in_flight = 0
        self.idle_since = clock()

    def start(self, name: str) -> Ticket:
        ticket = Ticket(name, self.clock())
        self.pending[name][id(ticket)] = ticket
        self.running[name] += 1
        self.in_flight += 1
        return ticket

    def first_output(self, ticket: Ticket) -> None:
        if ticket.first_output is None:
            ticket.first_output = now = self.clock()
            self.pending[ticket.name].pop(id(ticket), None)
            self.last_wait[ticket.name] = (now, now - ticket.started)

    def finish(self, ticket: Ticket) -> None:
        self.pending[ticket.name].pop(id(ticket), None)
        self.running[ticket.name] -= 1
        self.in_flight -= 1
        if self.in_flight == 0:
            self.idle_since = self.clock()

    def queue_wait(self, name: str) -> float:
        now = self.clock()
        oldest = max((now - t.started for t in list(self.pending[name].values())), default=0.0)
        when, wait = self.last_wait.get(name, (now, 0.0))
        return max(oldest, wait if now - when <= self.window_s else 0.0)

    def idle_for(self) -> float:
        """Seconds since the last request finished; 0 while any is in flight."""
        return 0.0 if self.in_flight else self.clock() - self.idle_since


class PrefixTable:
    """Which engine most recently served each prompt prefix, block by block, the way the engines'
    prefix caches key their blocks (docs/runtime.md, "Prefix caching"): a full block's hash chains
    its parent's hash with its tokens. Least recently used blocks are forgotten past `capacity`.
    An approximation of the engines' caches (they evict on their own), good enough to stick."""

    def __init__(self, block_size: int = 16, capacity: int = 100_000):
        self.block_size = block_size
        self.capacity = capacity
        self.owner: OrderedDict[int, str] = OrderedDict()

    def block_hashes(self, token_ids: Sequence[int]) -> list[int]:
        hashes, parent = [], 0
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            parent = hash((parent, tuple(token_ids[start : start + self.block_size])))
            hashes.append(parent)
        return hashes

    def lookup(self, hashes: list[int], candidates: Collection[str]) -> tuple[str | None, int]:
        """The candidate holding the longest prefix, and that prefix's length in tokens."""
        for i in range(len(hashes) - 1, -1, -1):
            owner = self.owner.get(hashes[i])
            if owner in candidates:
                return owner, (i + 1) * self.block_size
        return None, 0

    def record(self, hashes: list[int], name: str) -> None:
        for h in hashes:
            self.owner[h] = name
            self.owner.move_to_end(h)
        while len(self.owner) > self.capacity:
            self.owner.popitem(last=False)
