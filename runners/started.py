"""A call's delayed "started" report: sent only if the call outlives its delay.

Most calls finish well before the delay, and the finished report carries ``started_at``,
so a quick call sends one report. The timer is injectable so tests drive it by hand.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger("kestrel.runner")


class Cancellable(Protocol):
    def cancel(self) -> None: ...


# (delay in seconds, what to run then) -> a started timer that can be cancelled.
StartTimer = Callable[[float, Callable[[], None]], Cancellable]


def daemon_timer(delay_s: float, function: Callable[[], None]) -> threading.Timer:
    """A daemon ``threading.Timer``: a worker process that exits does not wait for it."""
    timer = threading.Timer(delay_s, function)
    timer.daemon = True
    timer.start()
    return timer


class StartedReport:
    """A call's "started" report, sent only if the call outlives ``delay_s``.

    ``finish()`` is called when the tool returned, before the finished report is signed;
    from then on the started report is never sent, so it can never follow the finished one.
    A started report being sent holds the lock, so ``finish()`` waits for it to be handed
    to the broker: started is then sent first.
    """

    def __init__(self, send: Callable[[], None], *, delay_s: float, timer: StartTimer) -> None:
        self._send = send
        self._lock = threading.Lock()
        self._done = False
        self._timer: Cancellable | None = None
        if delay_s <= 0:
            self._fire()
        else:
            self._timer = timer(delay_s, self._fire_in_background)

    def _fire(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
            self._send()

    def _fire_in_background(self) -> None:
        try:
            self._fire()
        except Exception:
            # A timer thread's exception would otherwise only reach stderr; "started" is
            # informational, the finished report is what must arrive.
            log.exception("the started report failed")

    def send_now(self) -> None:
        """Send the started report now if it was not sent yet (the call is about to ask the
        control plane for something that needs it running: a brokered adapter request)."""
        if self._timer is not None:
            self._timer.cancel()
        self._fire()

    def finish(self) -> None:
        """The call ended: cancel the timer, and make sure a late one sends nothing."""
        if self._timer is not None:
            self._timer.cancel()
        with self._lock:
            self._done = True
