"""The job's store on etcd: :class:`EtcdStore`, torch c10d's ``TCPStore`` operations with its
semantics, on an etcd cluster (3.4 or newer) through etcd's grpc-gateway (HTTP/JSON, the
``etcd3gw`` client's transport).

Why: a ``TCPStore`` lives in one process, and a job loses its store with that process's host. An
etcd cluster of 3 members keeps every key through the loss of any one member, so the control plane
(:class:`~ds_recycle.runtime.shared.c10d_store.C10dJobStore` speaks the whole protocol over any
:class:`~ds_recycle.runtime.shared.transport.Store`) outlives every single host.

What matches c10d, operation by operation (tests/runtime/test_etcd_store.py runs each beside a real
``TCPStore``): values are bytes (a ``str`` is written as UTF-8); ``get`` and ``multi_get`` block
until every key exists or the store's timeout passes; ``add`` creates a key from 0 and stores ASCII
decimal; ``compare_set`` sets a missing key only when ``expected`` is empty and otherwise answers
``expected`` without writing (c10d's answer), sets an existing key whose value equals ``expected``
and answers ``desired``, and answers the current value otherwise; ``check`` is True when every key
exists; ``wait`` and a blocking read raise ``torch.distributed.DistStoreError`` on timeout (callers'
``except DistStoreError`` clauses keep working); ``delete_key`` answers whether it deleted.

How: each key lives at ``<namespace>kv/<prefix><key>`` (the namespace is per job, the prefix plays
``PrefixStore``); ``add`` is a transaction that compares the key's ``mod_revision`` (retried when
another writer came between); ``compare_set`` one transaction comparing the value (two for an
existing empty value); ``multi_get``/``multi_set``/``check`` one transaction each (up to
``max_txn_ops`` keys per transaction, etcd's default 128; more go in order in several); a wait is
an etcd watch from the revision its check read, so no write between is missed.

Failures: endpoints are tried in turn; each attempt is bounded by ``attempt_timeout`` (a request
caught by a leader's loss hangs in etcd until its own 5-7 s request timeout), and an operation
retries until its timeout, then raises :class:`EtcdUnavailableError` (a ``DistNetworkError``, as a
``TCPStore`` client whose server is gone raises). Retried writes are idempotent (``set``,
``multi_set``, ``compare_set``), or, for ``add``, made so: its transaction also writes a receipt
(``<namespace>receipts/<client>``) that the retry reads to learn whether the lost attempt applied.

The class derives from ``torch.distributed.Store``, so torch's own ``PrefixStore`` and process
groups can be built on it (slowly: every operation is a round of consensus).
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import requests
import torch.distributed as dist
from etcd3gw import exceptions as etcd_errors
from etcd3gw.client import Etcd3Client

from ds_recycle.runtime.shared import keys as job_keys

ENV_ETCD_CACERT = "DS_RECYCLE_ETCD_CACERT"
ENV_ETCD_CERT = "DS_RECYCLE_ETCD_CERT"
ENV_ETCD_KEY = "DS_RECYCLE_ETCD_KEY"
ENV_ETCD_USER = "DS_RECYCLE_ETCD_USER"
ENV_ETCD_PASSWORD = "DS_RECYCLE_ETCD_PASSWORD"

NAMESPACE_ROOT = "/ds_recycle/"
"""Every job's keys are under ``/ds_recycle/<job>/``: two jobs on one etcd never share a key."""

ATTEMPT_TIMEOUT_SECONDS = 2.0
"""Bound on one HTTP request to one member. A healthy etcd answers in about a millisecond; a request
that reached a member as the leader died waits for etcd's own request timeout (5 s + 2 election
timeouts), so it is abandoned and retried (on the next endpoint) well before."""

CONNECT_TIMEOUT_SECONDS = 1.0
"""Bound on opening a connection to one member (a lost host does not refuse: it never answers)."""

MAX_TXN_OPS = 128
"""etcd's default ``--max-txn-ops``: the most keys one transaction may read or write."""


class EtcdUnavailableError(dist.DistNetworkError):
    """No member answered an operation within its timeout (the cluster lost its quorum, or every
    endpoint is unreachable). A ``DistNetworkError``, as a TCPStore client's error when its server
    is gone."""


class EtcdRequestError(dist.DistStoreError):
    """etcd refused a request (a bad request, a permission, an oversized transaction): retrying
    would not help."""


@dataclass(frozen=True)
class EtcdConfig:
    """Where the job's etcd is, how to reach it, and the job's namespace on it."""

    endpoints: tuple[str, ...]
    """Members' client endpoints, ``host:port`` (``http://`` or ``https://`` may lead)."""
    job: str
    """The job's name in the namespace (:func:`job_name` makes one from the job's token)."""
    cacert: str | None = None
    """CA bundle that signed the members' certificates (then ``host:port`` means https)."""
    cert: str | None = None
    """Client certificate, with ``key``, for etcd's ``--client-cert-auth``."""
    key: str | None = None
    user: str | None = None
    """etcd user (``etcdctl user add``), with ``password``."""
    password: str | None = field(default=None, repr=False)
    attempt_timeout: float = ATTEMPT_TIMEOUT_SECONDS
    max_txn_ops: int = MAX_TXN_OPS

    def __post_init__(self) -> None:
        if isinstance(self.endpoints, str):
            object.__setattr__(self, "endpoints", parse_endpoints(self.endpoints))
        else:
            object.__setattr__(self, "endpoints", tuple(self.endpoints))
        if not self.endpoints:
            raise ValueError("etcd needs at least one endpoint, host:port")
        for endpoint in self.endpoints:
            _endpoint_url(endpoint, self.cacert is not None)
        if not self.job or "/" in self.job:
            raise ValueError(f"etcd job name {self.job!r} must be non-empty without '/'")
        if (self.cert is None) != (self.key is None):
            raise ValueError("etcd client TLS needs both cert and key (got only one)")
        if (self.user is None) != (self.password is None):
            raise ValueError("etcd authentication needs both user and password (got only one)")
        if self.attempt_timeout <= 0:
            raise ValueError(f"attempt_timeout must be > 0 s, not {self.attempt_timeout}")
        if self.max_txn_ops < 1:
            raise ValueError(f"max_txn_ops must be >= 1, not {self.max_txn_ops}")

    @property
    def namespace(self) -> str:
        """The job's root: ``/ds_recycle/<job>/``."""
        return f"{NAMESPACE_ROOT}{self.job}/"


def parse_endpoints(spec: str | Sequence[str]) -> tuple[str, ...]:
    """``host:port[,host:port...]`` (or a list of them) as a tuple of endpoints."""
    parts = spec.split(",") if isinstance(spec, str) else list(spec)
    endpoints = tuple(p.strip() for p in parts if p.strip())
    if not endpoints:
        raise ValueError(f"etcd endpoints {spec!r}: expected host:port[,host:port...]")
    return endpoints


def job_name(token: str) -> str:
    """The job's name in etcd from its token: a hash (the token itself is never written)."""
    return hashlib.sha256(b"ds_recycle etcd namespace\0" + token.encode()).hexdigest()[:24]


def _endpoint_url(endpoint: str, tls: bool) -> tuple[str, str, int]:
    scheme = "https" if tls else "http"
    rest = endpoint
    if "://" in endpoint:
        scheme, _, rest = endpoint.partition("://")
        if scheme not in ("http", "https"):
            raise ValueError(f"etcd endpoint {endpoint!r}: the scheme must be http or https")
    host, _, port = rest.rstrip("/").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"etcd endpoint {endpoint!r} must be host:port (or http(s)://host:port)")
    return scheme, host.strip("[]"), int(port)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def _bytes(value: str | bytes) -> bytes:
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"a store value is str or bytes, not {type(value).__name__}")


def _range_end(prefix: bytes) -> bytes:
    """The end of the key range of every key that starts with ``prefix``."""
    end = bytearray(prefix)
    while end and end[-1] == 0xFF:
        end.pop()
    if not end:
        return b"\0"
    end[-1] += 1
    return bytes(end)


@dataclass(frozen=True)
class KeyValue:
    """One key's state as etcd read it."""

    value: bytes
    mod_revision: int
    create_revision: int
    version: int
    lease: int = 0

    @classmethod
    def from_json(cls, kv: dict[str, Any]) -> KeyValue:
        return cls(
            _unb64(kv.get("value", "")),
            int(kv.get("mod_revision", 0)),
            int(kv.get("create_revision", 0)),
            int(kv.get("version", 0)),
            int(kv.get("lease", 0)),
        )


class _Ambiguous(Exception):
    """An attempt failed after its request may have reached etcd (it may have applied)."""


class Gateway:
    """One client's HTTP connection to the cluster: the endpoint it uses now (the next on a failure),
    authentication, and each request's bounds. Not for concurrent use by threads (a client per
    thread, as with a TCPStore client)."""

    def __init__(self, config: EtcdConfig) -> None:
        self.config = config
        self.session = requests.Session()
        # the environment's proxies and CA bundle (REQUESTS_CA_BUNDLE) would override the cluster's
        # own CA, and route a loopback or cluster-network endpoint through a proxy
        self.session.trust_env = False
        if config.cacert is not None:
            self.session.verify = config.cacert
        if config.cert is not None and config.key is not None:
            self.session.cert = (config.cert, config.key)
        self.clients = []
        for endpoint in config.endpoints:
            scheme, host, port = _endpoint_url(endpoint, config.cacert is not None)
            self.clients.append(Etcd3Client(host, port, protocol=scheme, api_path="/v3/", session=self.session))
        self.current = 0
        self._token_valid = False

    def close(self) -> None:
        self.session.close()

    def _authenticate(self, client: Etcd3Client, deadline: float) -> None:
        client.timeout = self._bounds(deadline)
        self.session.headers.pop("Authorization", None)  # a stale token would fail the authentication itself
        answer = client.post(
            client.get_url("/auth/authenticate"), json={"name": self.config.user, "password": self.config.password}
        )
        self.session.headers["Authorization"] = answer["token"]
        self._token_valid = True

    def _bounds(self, deadline: float) -> tuple[float, float]:
        """(connect, read) timeouts of one attempt. The read gets at most half of what is left, so
        that a request stuck at a member that lost its leader leaves time for a retry elsewhere
        within the operation's deadline."""
        remaining = max(deadline - time.monotonic(), 0.05)  # past the deadline: one quick last try
        read = min(self.config.attempt_timeout, max(remaining / 2, 0.05))
        return min(CONNECT_TIMEOUT_SECONDS, remaining), read

    def call(self, path: str, body: dict[str, Any], deadline: float, what: str) -> dict[str, Any]:
        """POST ``body`` to ``/v3/<path>`` on the current endpoint, moving to the next on a failure,
        until one answers; EtcdUnavailableError naming ``what`` once ``deadline`` (time.monotonic)
        passed. For requests that may be repeated (reads, puts, compare-and-set)."""
        pause = 0.02
        while True:
            try:
                return self.attempt(path, body, deadline, what)
            except _Ambiguous as exc:
                if time.monotonic() >= deadline:
                    raise self.unavailable(what, str(exc)) from None
                pause = self.back_off(pause, deadline)

    @staticmethod
    def back_off(pause: float, deadline: float) -> float:
        """Sleep ``pause`` (not past ``deadline``) after a failed attempt (a member without a leader
        answers at once); the next pause, doubled up to 250 ms."""
        time.sleep(min(pause, max(deadline - time.monotonic(), 0)))
        return min(pause * 2, 0.25)

    def unavailable(self, what: str, last: str) -> EtcdUnavailableError:
        return EtcdUnavailableError(
            f"etcd: {what} failed: no member of {', '.join(self.config.endpoints)} answered before the "
            f"operation's timeout (a lost quorum, or every member unreachable); last error: {last}"
        )

    def attempt(self, path: str, body: dict[str, Any], deadline: float, what: str) -> dict[str, Any]:
        """Like :meth:`call`, but raises _Ambiguous at the first attempt that failed after its
        request may have been sent (a read timeout, a reset, etcd's own timeout): the caller learns
        whether it applied before it retries. A refused connection moves to the next endpoint."""
        last = "no attempt"
        pause = 0.02
        failures = 0
        while True:
            if time.monotonic() >= deadline and failures:
                raise self.unavailable(what, last)
            client = self.clients[self.current]
            try:
                if self.config.user is not None and not self._token_valid:
                    self._authenticate(client, deadline)
                client.timeout = self._bounds(deadline)
                return client.post(client.get_url(path), json=body)
            except etcd_errors.ConnectionFailedError as exc:
                last = f"{client.base_url}: {exc.detail_text or exc}"
                if "SSLError" in last:
                    raise EtcdRequestError(
                        f"etcd: {what}: the TLS handshake with {client.base_url} failed (check cacert, cert "
                        f"and key: {ENV_ETCD_CACERT}, {ENV_ETCD_CERT}, {ENV_ETCD_KEY}): {last}"
                    ) from None
                sent = "NewConnectionError" not in str(exc.detail_text) and "Connection refused" not in str(
                    exc.detail_text
                )
            except etcd_errors.ConnectionTimeoutError as exc:
                last = f"{client.base_url}: timed out ({exc.detail_text or exc})"
                sent = "ConnectTimeout" not in str(exc.detail_text) and "connect timeout" not in str(exc.detail_text)
            except etcd_errors.InternalServerError as exc:
                last = f"{client.base_url}: {exc.detail_text}"
                sent = True
            except etcd_errors.Etcd3Exception as exc:
                text = str(exc.detail_text or exc)
                if "invalid auth token" in text and self.config.user is not None and self._token_valid:
                    self._token_valid = False
                    continue
                raise EtcdRequestError(f"etcd refused {what}: {text}") from None
            except requests.exceptions.RequestException as exc:
                last = f"{client.base_url}: {type(exc).__name__}: {exc}"
                sent = True
            failures += 1
            self.current = (self.current + 1) % len(self.clients)
            if sent:
                raise _Ambiguous(last)
            if failures % len(self.clients) == 0:
                pause = self.back_off(pause, deadline)

    def txn(
        self,
        deadline: float,
        what: str,
        success: list[dict[str, Any]],
        compare: list[dict[str, Any]] | None = None,
        failure: list[dict[str, Any]] | None = None,
        ambiguous: bool = False,
    ) -> dict[str, Any]:
        body = {"compare": compare or [], "success": success, "failure": failure or []}
        if ambiguous:
            return self.attempt("/kv/txn", body, deadline, what)
        return self.call("/kv/txn", body, deadline, what)

    def watch(
        self, key: bytes, start_revision: int, deadline: float, filters: list[str] | None = None
    ) -> KeyValue | None:
        """Watch ``key`` from ``start_revision``: the key's state at its first event, or None when
        ``deadline`` passes or the stream fails (the caller checks again: a watch from the revision
        its check read misses nothing)."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        client = self.clients[self.current]
        request: dict[str, Any] = {"key": _b64(key), "start_revision": start_revision}
        if filters:
            request["filters"] = filters
        try:
            response = self.session.post(
                client.get_url("/watch"),
                json={"create_request": request},
                stream=True,
                timeout=(min(CONNECT_TIMEOUT_SECONDS, remaining), remaining),
            )
        except requests.exceptions.RequestException:
            self._next_after_failure(deadline)
            return None
        try:
            if response.status_code != 200:
                self._next_after_failure(deadline)
                return None
            for message in _json_lines(response.iter_content(chunk_size=None)):
                result = message.get("result", {})
                events = result.get("events")
                if events:
                    return KeyValue.from_json(events[0].get("kv", {}))
                if result.get("canceled") or "error" in message:
                    return None
            return None
        except (requests.exceptions.RequestException, ValueError):
            if time.monotonic() < deadline:
                self._next_after_failure(deadline)
            return None
        finally:
            response.close()

    def _next_after_failure(self, deadline: float) -> None:
        self.current = (self.current + 1) % len(self.clients)
        time.sleep(min(0.05, max(deadline - time.monotonic(), 0)))


def _json_lines(chunks: Iterator[bytes]) -> Iterator[dict[str, Any]]:
    """The JSON messages of a grpc-gateway stream (one per line; a chunk may hold part of one)."""
    buffer = b""
    for chunk in chunks:
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            if line.strip():
                yield json.loads(line)
    if buffer.strip():
        yield json.loads(buffer)


def _range(key: bytes, **options: Any) -> dict[str, Any]:
    return {"request_range": {"key": _b64(key), **options}}


def _put(key: bytes, value: bytes, lease: int = 0) -> dict[str, Any]:
    put: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
    if lease:
        put["lease"] = str(lease)
    return {"request_put": put}


def _compare(key: bytes, target: str, value: Any) -> dict[str, Any]:
    field_name = {"CREATE": "create_revision", "MOD": "mod_revision", "VALUE": "value"}[target]
    return {"key": _b64(key), "result": "EQUAL", "target": target, field_name: value}


def _kvs(response: dict[str, Any]) -> list[KeyValue]:
    return [KeyValue.from_json(kv) for kv in response.get("response_range", response).get("kvs", [])]


def _revision(answer: dict[str, Any]) -> int:
    return int(answer.get("header", {}).get("revision", 0))


class EtcdStore(dist.Store):
    """torch c10d ``TCPStore`` operations on etcd, under the job's namespace and ``prefix`` (a
    ``PrefixStore``'s prefix, joined as is: ``job/3/`` makes ``job/3/<key>``).

    Operations are bounded by the store's timeout (``set_timeout`` changes it; ``wait`` may take its
    own). One client per thread that may block (as with a TCPStore client): :meth:`clone` makes one.

    Where torch's C++ holds it (``dist.PrefixStore(p, store)``, a process group), keep a Python
    reference to the EtcdStore as long: pybind drops the Python half of an object that only C++
    holds, and torch then fails every call ("Not implemented"). :meth:`prefixed` needs no wrapper.
    """

    def __init__(self, config: EtcdConfig, prefix: str = "", timeout: float = job_keys.STORE_TIMEOUT_SECONDS) -> None:
        super().__init__()
        self.config = config
        self.prefix = prefix
        self._root = f"{config.namespace}kv/{prefix}".encode()
        self._receipt = f"{config.namespace}receipts/{uuid.uuid4().hex}".encode()
        self._gateway = Gateway(config)
        self._seen: dict[bytes, KeyValue] = {}  # add's last view of each counter: its first guess
        self.set_timeout(timedelta(seconds=timeout))

    # ---- plumbing ---------------------------------------------------------------------------------

    def _key(self, key: str) -> bytes:
        return self._root + key.encode()

    def _deadline(self, timeout: timedelta | None = None) -> float:
        bound = self.timeout if timeout is None else timeout
        return time.monotonic() + bound.total_seconds()

    def _chunks(self, items: Sequence[Any]) -> Iterator[Sequence[Any]]:
        step = self.config.max_txn_ops
        for start in range(0, len(items), step):
            yield items[start : start + step]

    def _read(
        self, names: list[bytes], deadline: float, what: str, count_only: bool = False
    ) -> tuple[list[KeyValue | None], int]:
        """Each key's state (None: missing), read at one revision, and that revision."""
        found: list[KeyValue | None] = []
        revision = 0
        for chunk in self._chunks(names):
            options: dict[str, Any] = {"count_only": True} if count_only else {}
            if revision:
                options["revision"] = revision
            answer = self._gateway.txn(deadline, what, [_range(name, **options) for name in chunk])
            revision = revision or _revision(answer)
            for response in answer.get("responses", [{}] * len(chunk)):
                ranged = response.get("response_range", {})
                if count_only:
                    found.append(KeyValue(b"", 0, 0, 0) if int(ranged.get("count", 0)) else None)
                else:
                    kvs = _kvs(response)
                    found.append(kvs[0] if kvs else None)
        return found, revision

    def _await(self, keys: list[str], deadline: float, timeout: timedelta | None = None) -> KeyValue | None:
        """Block until every key exists; DistStoreError (c10d's message) when ``deadline`` passes.
        Returns the last missing key's state where its watch saw it written (None: every key was
        found by a read)."""
        names = [self._key(key) for key in keys]
        while True:
            found, revision = self._read(names, deadline, f"wait for {keys}", count_only=True)
            missing = [name for name, kv in zip(names, found, strict=True) if kv is None]
            if not missing:
                return None
            if time.monotonic() >= deadline:
                bound = self.timeout if timeout is None else timeout
                shown = ", ".join(keys)
                raise dist.DistStoreError(
                    f"wait timeout after {int(bound.total_seconds() * 1000)}ms, keys: {shown} "
                    f"(etcd {self.config.namespace}kv/{self.prefix})"
                )
            written = self._gateway.watch(missing[0], revision + 1, deadline, filters=["NODELETE"])
            if written is not None and len(missing) == 1:
                return written

    # ---- the c10d operations ----------------------------------------------------------------------

    def set(self, key: str, value: str | bytes) -> None:
        self._gateway.call(
            "/kv/put", {"key": _b64(self._key(key)), "value": _b64(_bytes(value))}, self._deadline(), f"set {key}"
        )

    def get(self, key: str) -> bytes:
        deadline = self._deadline()
        name = self._key(key)
        while True:
            answer = self._gateway.call("/kv/range", {"key": _b64(name)}, deadline, f"get {key}")
            kvs = _kvs(answer)
            if kvs:
                return kvs[0].value
            written = self._await([key], deadline)
            if written is not None:
                return written.value

    def add(self, key: str, amount: int) -> int:
        deadline = self._deadline()
        name, what = self._key(key), f"add {amount} to {key}"
        # The transaction also writes this client's receipt (this add's nonce and the value it
        # wrote): after an attempt whose outcome is unknown, the same transaction is sent again,
        # and if the lost one applied, the retry fails its comparison and reads the receipt.
        nonce = uuid.uuid4().hex.encode() + b":"
        # the first attempt guesses the key as this client last saw it (or missing); a wrong guess
        # costs nothing more, since the failed transaction answers the key's state
        current = self._seen.get(name) if amount else None
        known = current is not None
        pause = 0.02
        while True:
            if known and current is not None:
                base = self._integer(key, current.value)
                if amount == 0:
                    return base
                compare = _compare(name, "MOD", str(current.mod_revision))
            else:
                base = 0
                compare = _compare(name, "CREATE", "0")
            value = base + amount
            try:
                answer = self._gateway.txn(
                    deadline,
                    what,
                    [_put(name, str(value).encode()), _put(self._receipt, nonce + str(value).encode())],
                    [compare],
                    [_range(name), _range(self._receipt)],
                    ambiguous=True,
                )
            except _Ambiguous as exc:
                if time.monotonic() >= deadline:
                    raise self._gateway.unavailable(f"{what} (whether it applied is unknown)", str(exc)) from None
                pause = self._gateway.back_off(pause, deadline)
                continue
            if answer.get("succeeded"):
                self._remember(name, KeyValue(str(value).encode(), _revision(answer), 0, 0))
                return value
            now, receipt = (_kvs(response) for response in answer["responses"])
            if receipt and receipt[0].value.startswith(nonce):
                return int(receipt[0].value[len(nonce) :])  # an attempt whose answer was lost applied
            current, known = (now[0] if now else None), True

    def _remember(self, name: bytes, kv: KeyValue) -> None:
        if len(self._seen) >= 4096:
            self._seen.clear()
        self._seen[name] = kv

    @staticmethod
    def _integer(key: str, value: bytes) -> int:
        try:
            return int(value)
        except ValueError:
            raise dist.DistStoreError(f"add on {key}: its value {value[:40]!r} is not an integer") from None

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        deadline = self._deadline()
        name, what = self._key(key), f"compare_set {key}"
        expected_b, desired_b = _bytes(expected), _bytes(desired)
        while True:
            if expected_b:
                compare = _compare(name, "VALUE", _b64(expected_b))
            else:
                compare = _compare(name, "CREATE", "0")
            answer = self._gateway.txn(deadline, what, [_put(name, desired_b)], [compare], [_range(name)])
            if answer.get("succeeded"):
                return desired_b
            kvs = _kvs(answer["responses"][0])
            if not kvs:
                # c10d answers `expected` for a missing key it was not asked to create
                if expected_b:
                    return expected_b
                continue
            if expected_b or kvs[0].value:
                return kvs[0].value
            # an existing empty value equals an empty `expected`: c10d sets it
            answer = self._gateway.txn(
                deadline, what, [_put(name, desired_b)], [_compare(name, "VALUE", "")], [_range(name)]
            )
            if answer.get("succeeded"):
                return desired_b
            kvs = _kvs(answer["responses"][0])
            if kvs:
                return kvs[0].value

    def check(self, keys: list[str]) -> bool:
        if not keys:
            return True
        found, _ = self._read([self._key(k) for k in keys], self._deadline(), f"check {keys}", count_only=True)
        return all(kv is not None for kv in found)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if keys:
            self._await(list(keys), self._deadline(timeout), timeout)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        if not keys:
            return []
        deadline = self._deadline()
        names = [self._key(k) for k in keys]
        while True:
            found, _ = self._read(names, deadline, f"multi_get {keys}")
            if all(kv is not None for kv in found):
                return [kv.value for kv in found if kv is not None]
            self._await([k for k, kv in zip(keys, found, strict=True) if kv is None], deadline)

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        if len(keys) != len(values):
            raise dist.DistStoreError(
                f"multi_set: {len(keys)} keys and {len(values)} values: the lists must be of the same size"
            )
        latest = dict(zip(keys, values, strict=True))  # etcd refuses a key twice in a txn; the last wins, as in c10d
        deadline = self._deadline()
        puts = [_put(self._key(k), _bytes(v)) for k, v in latest.items()]
        for chunk in self._chunks(puts):
            self._gateway.txn(deadline, f"multi_set {list(latest)[:4]}...", list(chunk))

    def delete_key(self, key: str) -> bool:
        answer = self._gateway.call("/kv/deleterange", {"key": _b64(self._key(key))}, self._deadline(), f"delete {key}")
        return int(answer.get("deleted", 0)) > 0

    def num_keys(self) -> int:
        """The keys under this store's prefix (a TCPStore counts its whole store)."""
        answer = self._gateway.call(
            "/kv/range",
            {"key": _b64(self._root), "range_end": _b64(_range_end(self._root)), "count_only": True},
            self._deadline(),
            "num_keys",
        )
        return int(answer.get("count", 0))

    def clone(self) -> EtcdStore:
        """A new client (connection) on the same endpoints, namespace, prefix and timeout."""
        return EtcdStore(self.config, self.prefix, self.timeout.total_seconds())

    def prefixed(self, prefix: str) -> EtcdStore:
        """A new client under this one's prefix followed by ``prefix`` (a PrefixStore on a clone)."""
        return EtcdStore(self.config, self.prefix + prefix, self.timeout.total_seconds())

    def close(self) -> None:
        """Remove this client's receipt key and close its connections."""
        try:
            self._gateway.call(
                "/kv/deleterange", {"key": _b64(self._receipt)}, time.monotonic() + 1.0, "delete the receipt"
            )
        except (dist.DistError, RuntimeError):
            pass
        self._gateway.close()

    def __repr__(self) -> str:
        return f"EtcdStore({','.join(self.config.endpoints)}, {self.config.namespace}kv/{self.prefix})"


def connect(config: EtcdConfig, generation: int | None, timeout: float = job_keys.STORE_TIMEOUT_SECONDS) -> EtcdStore:
    """A new client of the job's etcd under generation ``generation``'s key prefix (None: the job's
    root), as :func:`~ds_recycle.runtime.shared.transport.connect` is for a TCPStore."""
    return EtcdStore(config, "" if generation is None else job_keys.prefix(generation), timeout)


def config_from_env(endpoints: str | Sequence[str], job: str, environ: dict[str, str] | None = None) -> EtcdConfig:
    """An EtcdConfig whose TLS files and user come from ``DS_RECYCLE_ETCD_*`` (unset: none)."""
    import os

    env = os.environ if environ is None else environ
    return EtcdConfig(
        parse_endpoints(endpoints),
        job,
        cacert=env.get(ENV_ETCD_CACERT) or None,
        cert=env.get(ENV_ETCD_CERT) or None,
        key=env.get(ENV_ETCD_KEY) or None,
        user=env.get(ENV_ETCD_USER) or None,
        password=env.get(ENV_ETCD_PASSWORD) or None,
    )
