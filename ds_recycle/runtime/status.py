"""A live status page of a running job, served by the coordinator's host (``--status-port``).

``GET /`` is an HTML page (refreshing itself every two seconds), ``GET /status.json`` the same as
JSON: the epoch and its members; per slot its worker, its state (``live``, ``failed``, ``leaving``,
``joining``, ``out``), its incarnation, heartbeat age and iteration time; per node its lease age;
the changes not yet decided. Everything is read fresh from the store through a client of its own.
"""

from __future__ import annotations

import html
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ds_recycle.runtime import protocol as proto
from ds_recycle.runtime.protocol import Lease


class StatusServer:
    def __init__(self, address: str, generation: int, host: str, port: int, per_node: int, nnodes: int) -> None:
        self._store = proto.connect(address, generation, timeout=5.0)
        self._lock = threading.Lock()
        self.per_node, self.nnodes = per_node, nnodes
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path not in ("/", "/status.json"):
                    self.send_error(404, "try / or /status.json")
                    return
                status = server.status()
                body = json.dumps(status, indent=1) if self.path == "/status.json" else _page(status)
                self.send_response(200)
                kind = "application/json" if self.path == "/status.json" else "text/html; charset=utf-8"
                self.send_header("Content-Type", kind)
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, *args) -> None:
                pass

        self._http = ThreadingHTTPServer((host, port), Handler)
        self.port = self._http.server_address[1]
        self._thread = threading.Thread(target=self._http.serve_forever, name="recycle-status", daemon=True)

    def start(self) -> StatusServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._http.shutdown()
        self._http.server_close()

    def status(self) -> dict:
        with self._lock:
            store = self._store
            membership = proto.read_membership(store)
            pending = proto.read_pending(store)
            world = int(store.get(proto.WORLD_SIZE))
            now = time.time()
            last = {change.slot: change for change in pending}
            slots = []
            for slot in range(world):
                beat = _read(store, proto.heartbeat_key(slot))
                seconds = _read(store, proto.iteration_seconds_key(slot))
                change = last.get(slot)
                if slot in membership.members:
                    state = {"failed": "failed", "leave": "leaving"}.get(change.kind, "live") if change else "live"
                else:
                    state = "joining" if change and change.kind == proto.JOIN else "out"
                slots.append(
                    {
                        "slot": slot,
                        "node": slot // self.per_node,
                        "state": state,
                        "heartbeat_age_s": None if _float(beat) is None else round(now - _float(beat), 3),
                        "iteration_s": _float(seconds),
                    }
                )
            nodes = []
            for node in range(self.nnodes):
                lease = _read(store, proto.lease_key(node))
                age = None if lease is None else round(now - Lease.from_json(lease).time, 3)
                nodes.append({"node": node, "lease_age_s": age})
            return {
                "epoch": membership.epoch,
                "since_iteration": membership.iteration,
                "members": list(membership.members),
                "slots": slots,
                "nodes": nodes,
                "pending": [vars(change) for change in pending[-20:]],
                "time": now,
            }


def _read(store, key: str) -> str | None:
    return store.get(key).decode() if store.check([key]) else None


def _float(text: str | None) -> float | None:
    try:
        return None if text is None else float(text)
    except ValueError:
        return None


def _page(status: dict) -> str:
    rows = "".join(
        f"<tr class={s['state']}><td>{s['slot']}</td><td>{s['node']}</td><td>{s['state']}</td>"
        f"<td>{s['heartbeat_age_s']}</td><td>{s['iteration_s']}</td></tr>"
        for s in status["slots"]
    )
    changes = "".join(f"<li>{html.escape(json.dumps(c))}</li>" for c in status["pending"])
    return (
        "<!doctype html><meta http-equiv=refresh content=2><title>ds-recycle job</title>"
        "<style>td,th{padding:2px 8px}.failed{background:#fbb}.leaving,.joining{background:#ffd}"
        ".out{color:#888}</style>"
        f"<h1>epoch {status['epoch']} (from iteration {status['since_iteration']}): "
        f"{len(status['members'])} of {len(status['slots'])} slots live</h1>"
        "<table><tr><th>slot<th>node<th>state<th>heartbeat age (s)<th>iteration (s)</tr>"
        f"{rows}</table><h2>recent changes</h2><ul>{changes}</ul>"
    )
