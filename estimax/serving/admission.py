"""Admission: a request's deadline and priority, and each model's share of the run threads.

**Deadlines.** A request's deadline is the earliest of v2's ``parameters.timeout`` (microseconds,
Triton's), the gRPC call's deadline (``context.time_remaining()``) and
``--rest_api_timeout_in_ms``. A request whose deadline passes while it waits (for a batch, for
its model's share of the run threads, or for a run thread) is answered at once with the
protocol's deadline error, HTTP 504 / gRPC ``DEADLINE_EXCEEDED`` with Triton's message
``Request timeout expired``, and the model never runs for it; it is counted in
``estimax_serving_deadline_exceeded_total{model_name, stage}`` (``stage``: ``queued``, the model
never ran for it, or ``running``, it ran but the answer came too late). Triton answers a queue
timeout ``UNAVAILABLE``; TF Serving, whose shapes the issue asks for, answers a deadline 504 /
``DEADLINE_EXCEEDED``, which is also what a gRPC client's own deadline reports.

**Priorities.** Triton's levels: ``N`` levels, 1 the highest, per model (its config's
``dynamic_batching.priority_levels``, else ``--priority_levels``;
``estimax.serving.model_settings``); a request's ``parameters.priority`` 0 (or none) takes the
model's default level (``default_priority_level``, else ``--default_priority_level``). A value that
is not an integer, negative, or above ``N`` is refused (400 / ``INVALID_ARGUMENT``, one line;
Triton maps an out-of-range priority to the default silently, which hides a client's mistake). The
level orders each model's batching queue and each model's wait for its share of the run threads.
**No starvation (aging):** a waiting request's effective level rises one level per
``--priority_aging_ms`` waited, and ties go to the older request, so no request arriving more than
``(N - 1) x --priority_aging_ms`` after a request of the lowest level goes ahead of it: only the
finitely many that came before then can, and it is never starved.

**Sharing between models** (Triton's rate limiter, simplified): ``--max_concurrent_per_model=K``
lets each model hold at most ``K`` of the shared run threads (``--num_batch_threads``) at once,
running or queued for one; its other requests wait in the model's own queue (``Gate``), ordered
by priority. The run threads take work first come, first served, so a request of another model
waits behind at most ``K`` runs of a flooded model per thread rather than behind the whole
flood: the models share the threads about round robin. With ``--enable_batching`` each model's
batching queue runs at most ``min(K, --num_batch_threads)`` batches at once. 0 (the default):
no cap, today's behaviour.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

from estimax.serving.batching import rank
from estimax.serving.protocol import ApiError

__all__ = [
    "CURRENT",
    "DEADLINE_MESSAGE",
    "Gate",
    "Ticket",
    "current",
    "parse_priority",
    "parse_timeout",
    "rank",
    "use",
    "v2_ticket",
    "grpc_ticket",
    "level_of",
]

# Triton's message for a request whose timeout expired before it ran.
DEADLINE_MESSAGE = "Request timeout expired"
# Most microseconds a timeout may give (about 31 years; more is a client's mistake).
MAX_TIMEOUT_US = 1 << 50


@dataclasses.dataclass(frozen=True)
class Ticket:
    """What a request asks of admission.

    Attributes:
      priority: the level asked for, 1 the highest; 0: the model's default level.
      deadline: ``time.monotonic()`` by which it must be answered; None: none of its own.
      source: what set the deadline (``parameters.timeout``, ``gRPC deadline``), for messages.
    """

    priority: int = 0
    deadline: float | None = None
    source: str = ""

    def merged(self, other: Ticket) -> Ticket:
        """This ticket with ``other``'s priority (if set) and the earlier of the deadlines."""
        deadline, source = self.deadline, self.source
        if other.deadline is not None and (deadline is None or other.deadline < deadline):
            deadline, source = other.deadline, other.source
        return Ticket(other.priority or self.priority, deadline, source)


CURRENT: contextvars.ContextVar[Ticket | None] = contextvars.ContextVar(
    "estimax_admission", default=None
)


def current() -> Ticket:
    """The ticket of the request being handled (an empty one if none was given)."""
    return CURRENT.get() or Ticket()


@contextlib.contextmanager
def use(ticket: Ticket) -> Iterator[Ticket]:
    """Makes ``ticket`` (merged into the current one) the request's for the block."""
    merged = current().merged(ticket)
    token = CURRENT.set(merged)
    try:
        yield merged
    finally:
        CURRENT.reset(token)


def _integer(value: Any, name: str) -> int:
    # JSON true is an int to Python; a client sending it meant something else.
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ApiError(
            400, f"parameters.{name} must be an integer, got {type(value).__name__} {value!r:.40}"
        )
    return value


def parse_priority(value: Any, levels: int) -> int:
    """A request's ``parameters.priority``: 0 (the default level) or 1..``levels``.

    Raises:
      ApiError: 400 naming the parameter if it is not an integer in range.
    """
    priority = _integer(value, "priority")
    if not 0 <= priority <= levels:
        raise ApiError(
            400,
            f"parameters.priority={priority} is out of range: give 1 (highest) to {levels} "
            "(the model's priority_levels), or 0 for the model's default level",
        )
    return priority


def parse_timeout(value: Any) -> Ticket:
    """A request's ``parameters.timeout`` (microseconds, Triton's; 0: none) as a ticket.

    Raises:
      ApiError: 400 naming the parameter if it is not a non-negative integer.
    """
    timeout = _integer(value, "timeout")
    if not 0 <= timeout <= MAX_TIMEOUT_US:
        raise ApiError(
            400,
            f"parameters.timeout={timeout} is out of range: give microseconds from 0 (no "
            f"timeout) to {MAX_TIMEOUT_US}",
        )
    if timeout == 0:
        return Ticket()
    return Ticket(0, time.monotonic() + timeout / 1e6, "parameters.timeout")


def v2_ticket(parameters: dict[str, Any], levels: int) -> Ticket:
    """The ticket of a v2 request's ``parameters`` (``priority``, ``timeout``), checked."""
    ticket = Ticket()
    if "timeout" in parameters:
        ticket = parse_timeout(parameters["timeout"])
    if "priority" in parameters:
        ticket = dataclasses.replace(
            ticket, priority=parse_priority(parameters["priority"], levels)
        )
    return ticket


def grpc_ticket(time_remaining: float | None) -> Ticket:
    """The ticket of a gRPC call's deadline (``context.time_remaining()``; None: none)."""
    if time_remaining is None or math.isinf(time_remaining):
        return Ticket()
    return Ticket(0, time.monotonic() + max(0.0, time_remaining), "gRPC deadline")


def level_of(priority: int, default_level: int) -> int:
    """The level a request waits at: its priority, or the default level for 0."""
    return priority or default_level


@dataclasses.dataclass(order=True)
class _Waiter:
    level: int
    arrived: float
    seq: int
    future: asyncio.Future = dataclasses.field(compare=False)


class Gate:
    """One model's share of the run threads: at most ``cap`` requests hold it at once; the
    others wait, the best effective level first (``rank``), then the oldest.

    Used on the event loop only (``leave`` from a thread goes through ``call_soon_threadsafe``).
    """

    def __init__(
        self, cap: int, aging_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """``cap`` >= 1 holders at once; ``aging_s``: the aging step (``rank``)."""
        self.cap = cap
        self.aging_s = aging_s
        self._clock = clock
        self.holding = 0
        self._waiting: list[_Waiter] = []
        self._seq = itertools.count()

    @property
    def waiting(self) -> int:
        """Requests waiting for the gate now (some may have given up)."""
        return sum(1 for w in self._waiting if not w.future.done())

    async def enter(self, level: int) -> None:
        """Waits until the request may run (cancelled: it leaves the queue, holding nothing)."""
        if self.holding < self.cap and not self.waiting:
            self.holding += 1
            return
        waiter = _Waiter(
            level, self._clock(), next(self._seq), asyncio.get_running_loop().create_future()
        )
        self._waiting.append(waiter)
        try:
            await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                self.leave()  # handed the slot as it gave up: hand it on
            raise

    def leave(self) -> None:
        """Ends a holder's turn: the best waiter (if any) takes its place."""
        self._waiting = [w for w in self._waiting if not w.future.done()]
        if self._waiting:
            now = self._clock()
            best = min(
                self._waiting, key=lambda w: (rank(w.level, w.arrived, now, self.aging_s), w.seq)
            )
            self._waiting.remove(best)
            best.future.set_result(None)  # the slot passes on: holding is unchanged
            return
        self.holding -= 1
