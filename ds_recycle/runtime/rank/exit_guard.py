"""End a trainer process without C++ teardown while an abandoned wait is still blocked.

After a failure, :class:`~ds_recycle.runtime.rank.waiting.Waiter` abandons the helper thread that is
blocked in a gloo ``wait()`` (gloo cannot abort it; ``ProcessGroup.abort`` does not release it).
That thread returns when the peer's sockets close or the group's timeout fires. If that happens
while the interpreter finalizes, the thread cannot take the GIL back, CPython ends it with
``pthread_exit``, and the forced unwind through the C++ frames of ``wait()`` aborts the process
("terminate called without an active exception"): a rank that finished training would exit by
SIGABRT. So, at exit, while such a thread is alive, the process waits for it briefly and then
ends with ``os._exit`` after flushing, skipping finalization. The same holds for ReCycle's own
threads that live in store calls (the failure watcher, the heartbeat): each is stopped by an
atexit handler, and one that does not stop in time is abandoned too. :func:`install` runs before
those handlers are registered, so that its own handler runs after them.

The exit code ``os._exit`` gets: 1 after an uncaught exception, the code ds_recycle itself exited
with (``exit(code)`` here), else 0. A script's own ``sys.exit(n)`` cannot be seen from an atexit
handler; it is reported as 0 in this one case (an abandoned wait alive at exit).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time

GRACE_SECONDS = 1.0
"""How long the exit waits for abandoned threads to return by themselves."""

_abandoned: list[threading.Thread] = []
_code = 0
_installed = False


def abandoned(thread: threading.Thread) -> None:
    """``thread`` is blocked in a wait nobody will collect."""
    install()
    _abandoned.append(thread)


def exit(code: int) -> SystemExit:
    """The SystemExit for ds_recycle to raise, its code remembered for :func:`_at_exit`."""
    global _code
    _code = code
    return SystemExit(code)


def install() -> None:
    """Register the exit check (once). atexit runs handlers last-registered first: call this before
    registering a handler that may abandon a thread."""
    global _installed
    if _installed:
        return
    _installed = True
    previous = sys.excepthook

    def record_failure(*args) -> None:
        global _code
        _code = 1
        previous(*args)

    sys.excepthook = record_failure
    atexit.register(_at_exit)


def _at_exit() -> None:
    deadline = time.monotonic() + GRACE_SECONDS
    while any(t.is_alive() for t in _abandoned) and time.monotonic() < deadline:
        time.sleep(0.01)
    if not any(t.is_alive() for t in _abandoned):
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_code)
