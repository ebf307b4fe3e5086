"""A role held by one process at a time through etcd (the coordinator's, on the etcd backend), and
what its holder announces while it holds it (the address of the store it hosts).

Why: on etcd the coordinator's role must outlive its host. Every agent campaigns; one holds the
role; when its host dies, its lease is not kept alive, etcd deletes the role's key when the lease's
TTL runs out, and a waiting candidate, watching the key, takes the role within TTL plus etcd's lease
check (500 ms) and a round trip.

How: a candidate grants itself a lease of ``ttl`` seconds, keeps it alive from a daemon thread
(every ``ttl / 3``), and writes the role's key (``<namespace>election/<role>``, its value the
candidate's, e.g. its address) with that lease only where the key does not exist (one transaction
comparing the key's create revision with 0): one holder at a time. :meth:`Election.is_leader` holds
only while the last keepalive etcd answered is younger than the TTL it granted; once the lease could
not be kept alive, :attr:`Election.lost` is set (the holder must stop acting: another may hold the
role already).
"""

from __future__ import annotations

import threading
import time

from ds_recycle.runtime.shared.etcd_transport import (
    EtcdConfig,
    EtcdUnavailableError,
    Gateway,
    _b64,
    _compare,
    _kvs,
    _put,
    _range,
    _revision,
)

DEFAULT_TTL_SECONDS = 5
"""The role's lease: the time a dead holder keeps it (etcd's minimum is 1.5 election timeouts)."""

REQUEST_TIMEOUT_SECONDS = 5.0
"""Bound on each of the election's own requests (a grant, a campaign's write, a read)."""


class Election:
    """Campaign for ``role`` under the job's namespace, offering ``value`` (what :meth:`leader`
    answers while this candidate holds the role)."""

    def __init__(self, config: EtcdConfig, role: str, value: str | bytes, ttl: int = DEFAULT_TTL_SECONDS) -> None:
        if not role or "/" in role:
            raise ValueError(f"election role {role!r} must be non-empty without '/'")
        if int(ttl) != ttl or ttl < 1:
            raise ValueError(f"election ttl must be a whole number of seconds >= 1, not {ttl}")
        self.config = config
        self.role = role
        self.value = value.encode() if isinstance(value, str) else bytes(value)
        self.ttl = int(ttl)
        self.key = f"{config.namespace}election/{role}".encode()
        self.lost = threading.Event()
        """Set when the lease could not be kept alive (expired, or etcd unreachable for its TTL)."""
        self.lease_id = 0
        self._gateway = Gateway(config)
        self._leader = False
        self._valid_until = 0.0
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None
        self._state = threading.Lock()

    # ---- the lease ---------------------------------------------------------------------------------

    def _grant(self) -> None:
        deadline = time.monotonic() + REQUEST_TIMEOUT_SECONDS
        sent = time.monotonic()
        answer = self._gateway.call(
            "/lease/grant", {"TTL": self.ttl, "ID": 0}, deadline, f"grant a lease for {self.role}"
        )
        if answer.get("error"):
            raise EtcdUnavailableError(f"etcd refused a lease for {self.role}: {answer['error']}")
        with self._state:
            self.lease_id = int(answer["ID"])
            self._valid_until = sent + int(answer.get("TTL", self.ttl))
        self.lost.clear()
        if self._keeper is None or not self._keeper.is_alive():
            self._stop.clear()
            self._keeper = threading.Thread(target=self._keep_alive, name=f"etcd-lease-{self.role}", daemon=True)
            self._keeper.start()

    def _keep_alive(self) -> None:
        gateway = Gateway(self.config)  # its own connection: the campaign's may block in a watch
        try:
            while not self._stop.wait(self.ttl / 3):
                with self._state:
                    lease, valid_until = self.lease_id, self._valid_until
                if not lease:
                    continue
                sent = time.monotonic()
                try:
                    answer = gateway.call(
                        "/lease/keepalive", {"ID": str(lease)}, min(valid_until, sent + self.ttl / 3), "lease keepalive"
                    )
                    granted = int(answer.get("result", {}).get("TTL", 0))
                except (EtcdUnavailableError, RuntimeError):
                    granted = 0 if time.monotonic() >= valid_until else -1
                with self._state:
                    if lease != self.lease_id:
                        continue
                    if granted > 0:
                        self._valid_until = sent + granted
                    elif granted == 0:  # expired at etcd, or unreachable for its whole TTL
                        self._leader = False
                        self.lease_id = 0
                        self.lost.set()
        finally:
            gateway.close()

    # ---- the role ----------------------------------------------------------------------------------

    def campaign(self, timeout: float | None = None) -> bool:
        """Block until this candidate holds the role (True) or ``timeout`` seconds passed (False;
        None: no bound). A candidate whose lease was lost while it waited grants itself a new one."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.is_leader():
                return True
            if not self.lease_id:
                self._grant()
            bound = time.monotonic() + REQUEST_TIMEOUT_SECONDS
            answer = self._gateway.txn(
                bound if deadline is None else min(bound, max(deadline, time.monotonic() + 0.05)),
                f"campaign for {self.role}",
                [_put(self.key, self.value, self.lease_id)],
                [_compare(self.key, "CREATE", "0")],
                [_range(self.key)],
            )
            holder = None if answer.get("succeeded") else (_kvs(answer["responses"][0]) or [None])[0]
            if holder is None or holder.lease == self.lease_id:
                with self._state:
                    self._leader = bool(self.lease_id)
                if self._leader:
                    return True
                continue
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return False
            watch_until = now + 60.0 if deadline is None else deadline
            self._gateway.watch(self.key, _revision(answer) + 1, watch_until, filters=["NOPUT"])

    def is_leader(self) -> bool:
        """Whether this candidate holds the role now: it won it, and its lease is alive by the last
        keepalive etcd answered (measured from when that keepalive was sent)."""
        with self._state:
            return self._leader and not self.lost.is_set() and time.monotonic() < self._valid_until

    def leader(self, timeout: float = REQUEST_TIMEOUT_SECONDS) -> bytes | None:
        """The holder's value (None while no one holds the role)."""
        answer = self._gateway.call(
            "/kv/range", {"key": _b64(self.key)}, time.monotonic() + timeout, f"read the holder of {self.role}"
        )
        kvs = _kvs(answer)
        return kvs[0].value if kvs else None

    def announce(self, key: str, value: str | bytes, timeout: float = REQUEST_TIMEOUT_SECONDS) -> None:
        """Write ``key`` (a key of the job's root, as an EtcdStore without a prefix reads it) with the
        role's lease: it goes when the holder's lease goes. Only the holder announces."""
        if not self.is_leader():
            raise RuntimeError(f"announce {key!r}: this candidate does not hold the role {self.role!r}")
        name = f"{self.config.namespace}kv/{key}".encode()
        data = value.encode() if isinstance(value, str) else bytes(value)
        self._gateway.txn(
            time.monotonic() + timeout,
            f"announce {key}",
            [_put(name, data, self.lease_id)],
        )

    def resign(self) -> None:
        """Give the role up (if held) and revoke the lease: the role's key and every announcement go
        at once, and a waiting candidate takes over without waiting for the TTL."""
        self._stop.set()
        with self._state:
            lease, self.lease_id, self._leader = self.lease_id, 0, False
        if lease:
            try:
                self._gateway.call(
                    "/kv/lease/revoke",
                    {"ID": str(lease)},
                    time.monotonic() + REQUEST_TIMEOUT_SECONDS,
                    f"revoke the lease of {self.role}",
                )
            except (EtcdUnavailableError, RuntimeError):
                pass  # it expires by itself
        if self._keeper is not None:
            self._keeper.join(timeout=REQUEST_TIMEOUT_SECONDS)
            self._keeper = None

    def close(self) -> None:
        self.resign()
        self._gateway.close()


def announced(config: EtcdConfig, key: str, timeout: float) -> bytes:
    """The value a role's holder announced at ``key``, waiting up to ``timeout`` seconds for one
    (DistStoreError after)."""
    from ds_recycle.runtime.shared.etcd_transport import EtcdStore

    store = EtcdStore(config, "", timeout)
    try:
        return store.get(key)
    finally:
        store.close()


def _candidate_main() -> None:
    """``python -m ds_recycle.runtime.shared.etcd_election ENDPOINTS JOB ROLE VALUE TTL``: campaign,
    print ``LEADER <unix time>`` on winning, then hold the role until killed (tests' candidate)."""
    import sys

    endpoints, job, role, value, ttl = sys.argv[1:6]
    election = Election(EtcdConfig(tuple(endpoints.split(",")), job), role, value, int(ttl))
    print("CAMPAIGN", flush=True)
    election.campaign()
    print(f"LEADER {time.time():.6f}", flush=True)
    while not election.lost.wait(0.1):
        pass
    print(f"LOST {time.time():.6f}", flush=True)


if __name__ == "__main__":
    _candidate_main()
