"""Watch a launch from outside through its event stream (``ds-recycle launch --events FILE``, one
JSON object per line; ``ds_recycle.runtime.node.launcher.EVENTS`` lists them), not through its log lines.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

Event = dict[str, Any]


class LaunchEvents:
    """The events written to ``path`` so far; every query reads what was appended since the last."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.events: list[Event] = []
        self._offset = 0
        self._partial = b""
        self._lock = threading.Lock()

    def poll(self) -> list[Event]:
        """Read the complete lines appended since the last poll; returns every event so far."""
        with self._lock:
            try:
                with open(self.path, "rb") as f:
                    f.seek(self._offset)
                    data = f.read()
            except FileNotFoundError:
                return list(self.events)
            self._offset += len(data)
            *lines, self._partial = (self._partial + data).split(b"\n")
            self.events += [json.loads(line) for line in lines if line.strip()]
            return list(self.events)

    def select(self, event: str, **match: Any) -> list[Event]:
        """Every ``event`` whose fields equal ``match``."""
        return [e for e in self.poll() if e["event"] == event and all(e.get(k) == v for k, v in match.items())]

    def count(self, event: str, **match: Any) -> int:
        return len(self.select(event, **match))

    def pids(self) -> dict[int, int]:
        """Each slot's latest process."""
        return {e["slot"]: e["pid"] for e in self.select("started")}

    def all_pids(self) -> list[int]:
        """Every rank process the launcher started."""
        return [e["pid"] for e in self.select("started")]

    def ended(self) -> int | None:
        """The launcher's exit code once it wrote its last event, else None."""
        last = self.select("ended")
        return last[-1]["code"] if last else None

    def wait_for(
        self,
        event: str,
        count: int = 1,
        timeout: float = 120.0,
        alive: Callable[[], bool] = lambda: True,
        **match: Any,
    ) -> Event:
        """The ``count``-th ``event`` matching ``match``; raises TimeoutError after ``timeout`` s or
        once ``alive()`` is false (the launcher ended) without it."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.select(event, **match)
            if len(found) >= count:
                return found[count - 1]
            if not alive() or time.monotonic() > deadline:
                found = self.select(event, **match)
                if len(found) >= count:
                    return found[count - 1]
                why = "the launcher ended" if not alive() else f"timed out after {timeout:g} s"
                raise TimeoutError(f"{why} waiting for event {event} #{count} {match}")
            time.sleep(0.01)
