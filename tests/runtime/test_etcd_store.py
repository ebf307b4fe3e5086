"""The etcd transport against a real 3-member etcd cluster on loopback: each c10d operation beside a
real TCPStore (same answers, same errors), the job store's protocol over it, a member killed (its
quorum kept: operations go on) and two (quorum lost: an operation fails within its timeout with one
clear error, and works again once they are back), and the coordinator's election between two
candidate processes whose holder is SIGKILLed.

Unmarked (the pure tests' lane): the tests start etcd members and, for the election, two small
Python processes, but no ranks. The cluster's data lives on /dev/shm; the module takes about 20 s.
"""

from __future__ import annotations

import logging
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from datetime import timedelta

import pytest

pytest.importorskip("etcd3gw", reason="etcd3gw (the etcd transport's client) is not installed")

import torch.distributed as dist  # noqa: E402

from ds_recycle.runtime.shared import etcd_transport, keys  # noqa: E402
from ds_recycle.runtime.shared.c10d_store import C10dJobStore  # noqa: E402
from ds_recycle.runtime.shared.etcd_election import Election, announced  # noqa: E402
from ds_recycle.runtime.shared.etcd_transport import EtcdConfig, EtcdStore, EtcdUnavailableError  # noqa: E402
from ds_recycle.runtime.shared.records import FAILED, Change, Decision, Lease, Membership, Request  # noqa: E402
from ds_recycle.testing.etcd_cluster import EtcdCluster, etcd_binary  # noqa: E402

OP_TIMEOUT = 0.5
TOKEN = "a" * 32


@pytest.fixture(scope="module")
def cluster():
    binary, why = etcd_binary()
    if binary is None:
        pytest.skip(why)
    with EtcdCluster(size=3, binary=binary) as started:
        yield started


@pytest.fixture
def config(cluster, request):
    for index, member in enumerate(cluster.members):  # a test that killed members leaves them restarted
        if not member.running():
            cluster.restart(index)
    return EtcdConfig(tuple(cluster.endpoints), f"test-{request.node.name}-{time.monotonic_ns()}")


@pytest.fixture
def tcp():
    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=OP_TIMEOUT)
    )
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=OP_TIMEOUT))
    yield client
    del client, server


def outcome(op, store):
    try:
        return op(store)
    except dist.DistError as exc:
        return type(exc).__name__


# (name, operation on a store): run in order on both stores; each answer (or error class) compared
SCRIPT = [
    ("get missing", lambda s: s.get("missing")),
    ("set str", lambda s: s.set("a", "héllo")),
    ("get str", lambda s: s.get("a")),
    ("set bytes", lambda s: s.set("b", b"\x00\xff\n")),
    ("get bytes", lambda s: s.get("b")),
    ("set empty", lambda s: s.set("empty", "")),
    ("get empty", lambda s: s.get("empty")),
    ("add creates", lambda s: s.add("n", 5)),
    ("add stores ascii", lambda s: s.get("n")),
    ("add negative", lambda s: s.add("n", -7)),
    ("add 0 missing creates", lambda s: s.add("zero", 0)),
    ("check after add 0", lambda s: s.check(["zero"])),
    ("add 0 existing", lambda s: s.add("n", 0)),
    ("add big", lambda s: s.add("big", 2**62)),
    ("cas missing, expected empty: sets", lambda s: s.compare_set("c1", "", "d")),
    ("cas set it", lambda s: s.get("c1")),
    ("cas missing, expected given: answers expected", lambda s: s.compare_set("c2", "x", "d")),
    ("cas missing, expected given: writes nothing", lambda s: s.check(["c2"])),
    ("cas match", lambda s: s.compare_set("c1", "d", "e")),
    ("cas mismatch: current", lambda s: s.compare_set("c1", "zz", "f")),
    ("cas expected empty on existing: current", lambda s: s.compare_set("c1", "", "f")),
    ("cas expected empty on empty value: sets", lambda s: s.compare_set("empty", "", "g")),
    ("cas desired empty", lambda s: s.compare_set("c3", "", "")),
    ("cas desired empty exists", lambda s: s.check(["c3"])),
    ("cas bytes", lambda s: s.compare_set("c4", b"", b"\xff\x00")),
    ("check none", lambda s: s.check([])),
    ("check all", lambda s: s.check(["a", "b", "n"])),
    ("check mixed", lambda s: s.check(["a", "nope"])),
    ("wait present", lambda s: s.wait(["a", "b"])),
    ("wait none", lambda s: s.wait([])),
    ("wait missing timeout", lambda s: s.wait(["a", "nope"], timedelta(seconds=0.2))),
    ("wait missing store timeout", lambda s: s.wait(["nope"])),
    ("multi_get", lambda s: s.multi_get(["a", "b", "n"])),
    ("multi_get none", lambda s: s.multi_get([])),
    ("multi_get missing", lambda s: s.multi_get(["a", "nope"])),
    ("multi_set duplicate: last wins", lambda s: s.multi_set(["d", "e", "d"], ["1", b"2", "3"])),
    ("multi_set read", lambda s: s.multi_get(["d", "e"])),
    ("multi_set none", lambda s: s.multi_set([], [])),
    ("multi_set unequal", lambda s: s.multi_set(["x"], [])),
    ("delete", lambda s: s.delete_key("a")),
    ("delete again", lambda s: s.delete_key("a")),
    ("deleted", lambda s: s.check(["a"])),
    ("set again", lambda s: s.set("a", "back")),
    ("get again", lambda s: s.get("a")),
]


def test_each_op_answers_as_tcpstore(config, tcp):
    etcd = EtcdStore(config, "job/0/", timeout=OP_TIMEOUT)
    for name, op in SCRIPT:
        started = time.monotonic()
        expected = outcome(op, tcp)
        tcp_seconds = time.monotonic() - started
        started = time.monotonic()
        got = outcome(op, etcd)
        etcd_seconds = time.monotonic() - started
        assert got == expected, f"{name}: TCPStore {expected!r}, etcd {got!r}"
        if expected == "DistStoreError":
            assert abs(etcd_seconds - tcp_seconds) < 0.25, (
                f"{name}: blocked {etcd_seconds:.2f} s vs {tcp_seconds:.2f} s"
            )
    assert etcd.num_keys() > 0
    etcd.close()


def test_prefixes_and_jobs_do_not_mix(config, cluster):
    one = EtcdStore(config, "job/1/")
    two = EtcdStore(config, "job/2/")
    other_job = EtcdStore(replace(config, job=config.job + "-other"), "job/1/")
    root = etcd_transport.connect(config, None)
    one.set("k", "1")
    two.set("k", "2")
    assert (one.get("k"), two.get("k"), root.get("job/1/k")) == (b"1", b"2", b"1")
    assert not other_job.check(["k"])
    assert etcd_transport.connect(config, 1).get("k") == b"1"  # keys.prefix(1) is job/1/
    assert keys.prefix(1) == "job/1/"
    clone = one.clone()
    assert (clone.prefix, clone.timeout, clone.config) == (one.prefix, one.timeout, one.config)
    assert clone.prefixed("sub/").prefix == "job/1/sub/"


def test_wait_wakes_at_the_set_and_blocking_reads_too(config):
    writer, waiter = EtcdStore(config), EtcdStore(config, timeout=5.0)
    woke: dict[str, float] = {}

    def wait(name, op):
        op()
        woke[name] = time.monotonic()

    threads = [threading.Thread(target=wait, args=("wait", lambda: waiter.wait(["w1", "w2"], timedelta(seconds=5))))]
    getter = waiter.clone()
    threads.append(threading.Thread(target=wait, args=("get", lambda: getter.get("w2"))))
    many = waiter.clone()
    threads.append(threading.Thread(target=wait, args=("multi_get", lambda: many.multi_get(["w1", "w2"]))))
    for thread in threads:
        thread.start()
    time.sleep(0.3)
    writer.set("w1", "1")
    time.sleep(0.2)
    assert not woke
    written = time.monotonic()
    writer.set("w2", "2")
    for thread in threads:
        thread.join(5)
    lags = {name: at - written for name, at in woke.items()}
    print(f"wake-up after the last key's set: {', '.join(f'{n} {1e3 * lag:.1f} ms' for n, lag in lags.items())}")
    assert set(lags) == {"wait", "get", "multi_get"}
    assert all(lag < 0.5 for lag in lags.values()), lags


def test_add_is_atomic_across_clients(config):
    store = EtcdStore(config)
    per_thread, threads = 40, 4
    answers: list[int] = []
    lock = threading.Lock()

    def adder() -> None:
        client = store.clone()
        for _ in range(per_thread):
            value = client.add("counter", 1)
            with lock:
                answers.append(value)

    workers = [threading.Thread(target=adder) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(30)
    assert sorted(answers) == list(range(1, per_thread * threads + 1))
    assert store.get("counter") == str(per_thread * threads).encode()


@pytest.mark.parametrize("applied", [True, False])
def test_add_whose_answer_was_lost_counts_once(config, applied):
    """An add whose request may have reached etcd but whose answer was lost (a member died
    meanwhile) is sent again; its receipt tells whether the first one applied."""
    store = EtcdStore(config)
    assert store.add("lost", 5) == 5
    original = store._gateway.attempt
    lost = []

    def attempt(path, body, deadline, what):
        if path == "/kv/txn" and not lost:
            lost.append(path)
            if applied:
                original(path, body, deadline, what)
            raise etcd_transport._Ambiguous("the answer was lost")
        return original(path, body, deadline, what)

    store._gateway.attempt = attempt
    assert store.add("lost", 2) == 7
    assert lost and store.get("lost") == b"7"


def test_many_keys_span_transactions(config):
    store = EtcdStore(replace(config, max_txn_ops=16))
    names = [f"k{i}" for i in range(40)]
    store.multi_set(names, [str(i) for i in range(40)])
    assert store.check(names)
    assert store.multi_get(names) == [str(i).encode() for i in range(40)]


def test_config_names_the_problem():
    with pytest.raises(ValueError, match="host:port"):
        EtcdConfig(("localhost",), "job")
    with pytest.raises(ValueError, match="http or https"):
        EtcdConfig(("ftp://h:1",), "job")
    with pytest.raises(ValueError, match="both cert and key"):
        EtcdConfig(("h:1",), "job", cert="c.pem")
    with pytest.raises(ValueError, match="both user and password"):
        EtcdConfig(("h:1",), "job", user="root")
    with pytest.raises(ValueError, match="without '/'"):
        EtcdConfig(("h:1",), "a/b")
    parsed = EtcdConfig("h1:1, h2:2", etcd_transport.job_name("t" * 32))
    assert parsed.endpoints == ("h1:1", "h2:2") and "t" * 32 not in parsed.namespace
    env = {etcd_transport.ENV_ETCD_USER: "u", etcd_transport.ENV_ETCD_PASSWORD: "p"}
    assert etcd_transport.config_from_env("h:1", "job", env).user == "u"


def test_job_store_protocol_over_etcd(config):
    job = C10dJobStore(etcd_transport.connect(config, 0, timeout=5.0), TOKEN, 0)
    job.open_job(4, nodes=2)
    assert (job.world_size(), job.node_count(), job.current_epoch()) == (4, 2, 0)
    assert job.membership() == Membership(0, (0, 1, 2, 3), 0)

    nxt = Membership(1, (0, 1, 2), 7)
    failure = Change(0, FAILED, 3, 1.0)
    first = Decision(0, 7, 1, (failure,), nxt)
    second = Decision(0, 7, 1, (failure,), Membership(1, (0, 1), 7))
    assert job.propose_decision(first) == first
    assert job.propose_decision(second) == first  # the first proposal wins
    job.publish_epoch(nxt)
    job.publish_epoch(nxt)  # a second publisher changes nothing
    assert job.current_epoch() == 1 and job.membership() == nxt
    assert job.decision(0, 7) == first and job.decision(0, 8) is None

    watcher = C10dJobStore(etcd_transport.connect(config, 0, timeout=5.0), TOKEN, 0)
    stop = threading.Event()
    woken: list[tuple[int, float]] = []
    seen = [0]

    def watch() -> None:
        for count in watcher.node_alerts(1, lambda: seen[0], stop):
            woken.append((count, time.monotonic()))
            seen[0] = count
            if count >= 1:
                return

    thread = threading.Thread(target=watch)
    thread.start()
    time.sleep(0.3)
    appended = time.monotonic()
    assert job.append_changes(0, [failure], nodes=2) == 1
    thread.join(5)
    assert woken and woken[0][0] == 1, "the node's watch did not wake"
    print(f"node_alerts woke {1e3 * (woken[0][1] - appended):.1f} ms after append_changes")
    assert job.changes() == [failure]

    job.open_inboxes()
    assert job.inbox_counts() == (0, 0)
    request = Request("leave", 2, 1234, 2.0)
    assert job.post_request(request) == 1
    assert job.inbox_counts() == (1, 0)
    assert Request.from_json(job.posted_request(1)) == request

    job.renew_lease(0, Lease(1, 3.0))
    assert job.leases([0, 1]) == {0: Lease(1, 3.0)}
    assert job.next_node_incarnation(1) == 1 and job.next_node_incarnation(1) == 2
    assert job.claim_forwarding(1, 0, [0, 1]) and not job.claim_forwarding(1, 1, [0, 1])
    assert job.claim_forwarding(1, 1, [1])  # the claimant left: a survivor takes it over
    assert job.await_recovery(1, 0.2) is None  # a bounded wait answers as on c10d


def leader_index(cluster: EtcdCluster) -> int:
    """The member that leads the raft group now."""
    import requests

    for index, member in enumerate(cluster.members):
        if not member.running():
            continue
        status = requests.post(f"http://{member.endpoint}/v3/maintenance/status", json={}, timeout=2).json()
        if status.get("leader") == status["header"]["member_id"]:
            return index
    raise AssertionError("no member leads")


def test_member_killed_ops_go_on(config, cluster):
    store = EtcdStore(config, "job/0/", timeout=10.0)
    store.set("before", "1")
    store.add("count", 1)
    leader = leader_index(cluster)
    # the store talks to the leader first: the leader's loss hits both its connection and the raft group
    store._gateway.current = leader
    cluster.kill(leader)
    started = time.monotonic()
    assert store.get("before") == b"1"
    assert store.add("count", 1) == 2
    assert store.compare_set("cas", "", "x") == b"x"
    store.set("during", "2")
    first_ops = time.monotonic() - started
    print(f"leader (member {leader}) SIGKILLed: the next 4 operations took {first_ops:.2f} s")
    assert first_ops < 5.0
    started = time.monotonic()
    for _ in range(20):
        store.add("count", 1)
    per_add = (time.monotonic() - started) / 20
    print(f"with 2 of 3 members: {1e3 * per_add:.1f} ms per add")
    cluster.restart(leader)
    assert store.add("count", 0) == 22


def test_quorum_lost_then_back(config, cluster):
    store = EtcdStore(replace(config, attempt_timeout=0.5), "job/0/", timeout=1.5)
    store.set("k", "1")
    election = Election(config, "coordinator", "me", ttl=2)
    assert election.campaign(5)
    seen_lost: list[float] = []
    watcher = threading.Thread(target=lambda: election.lost.wait(10) and seen_lost.append(time.monotonic()))
    watcher.start()
    cluster.kill(1)
    cluster.kill(2)
    lost_at = time.monotonic()
    for name, op in [
        ("set", lambda: store.set("k", "2")),
        ("add", lambda: store.add("n", 1)),
        ("get", lambda: store.get("k")),
    ]:
        started = time.monotonic()
        with pytest.raises(EtcdUnavailableError) as raised:
            op()
        took = time.monotonic() - started
        print(f"quorum lost: {name} raised after {took:.2f} s: {str(raised.value)[:160]}")
        assert took < 1.5 + 1.0
        assert "no member of" in str(raised.value) and "timeout" in str(raised.value)
    assert isinstance(raised.value, dist.DistNetworkError)
    watcher.join(10)
    assert seen_lost, "the holder did not see its lease lost"
    assert not election.is_leader()
    print(f"quorum lost: the role's holder saw its lease lost {seen_lost[0] - lost_at:.2f} s later (TTL 2 s)")
    assert seen_lost[0] - lost_at < 2 + 1.0
    cluster.restart(1, wait=False)
    cluster.restart(2, wait=False)
    cluster.wait_healthy()
    back = time.monotonic()
    store.set("k", "3")
    assert store.get("k") == b"3" and store.add("n", 1) == 1
    print(f"quorum back: ops work again {time.monotonic() - back:.2f} s after the members were healthy")
    assert election.campaign(5), "a new lease and the role again once quorum is back"
    election.close()


def test_election_in_process(config):
    first = Election(config, "coordinator", "host-a:1", ttl=2)
    second = Election(config, "coordinator", "host-b:2", ttl=2)
    assert first.campaign(5)
    assert not second.campaign(0.3)
    assert (first.is_leader(), second.is_leader(), second.leader()) == (True, False, b"host-a:1")
    first.announce("rendezvous", "host-a:29500")
    assert announced(config, "rendezvous", 1.0) == b"host-a:29500"
    with pytest.raises(RuntimeError, match="does not hold the role"):
        second.announce("rendezvous", "host-b:29500")
    started = time.monotonic()
    first.resign()
    assert second.campaign(3)
    print(f"resign: the other candidate held the role {1e3 * (time.monotonic() - started):.0f} ms later")
    assert second.leader() == b"host-b:2" and not first.is_leader()
    with pytest.raises(dist.DistStoreError):
        announced(config, "rendezvous", 0.2)  # it went with the holder's lease
    time.sleep(2.5)  # past the TTL: the keepalive holds the role
    assert second.is_leader() and not second.lost.is_set()
    second.close()
    first.close()


def test_election_takeover_after_sigkill(config):
    ttl = 2
    command = [sys.executable, "-m", "ds_recycle.runtime.shared.etcd_election", ",".join(config.endpoints)]
    command += [config.job, "coordinator"]
    env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"}
    candidates = [
        subprocess.Popen([*command, name, str(ttl)], stdout=subprocess.PIPE, text=True, env=env) for name in ("a", "b")
    ]
    try:
        lines: dict[int, list[str]] = {c.pid: [] for c in candidates}
        selector = selectors.DefaultSelector()
        for candidate in candidates:
            selector.register(candidate.stdout, selectors.EVENT_READ, candidate)

        def read_until(predicate, bound: float) -> None:
            deadline = time.monotonic() + bound
            while not predicate() and time.monotonic() < deadline:
                for ready, _ in selector.select(0.1):
                    line = ready.fileobj.readline()
                    if line:
                        lines[ready.data.pid].append(line.split())

        def leaders():
            return [c for c in candidates if any(w[0] == "LEADER" for w in lines[c.pid])]

        read_until(lambda: len(leaders()) == 1 and all(lines[c.pid] for c in candidates), 30)
        holder = leaders()
        assert len(holder) == 1, lines
        time.sleep(0.5)  # the other is in its campaign's watch
        assert len(leaders()) == 1, "two holders at once"
        killed = time.time()
        os.kill(holder[0].pid, signal.SIGKILL)
        holder[0].wait(5)
        other = next(c for c in candidates if c is not holder[0])
        read_until(lambda: other in leaders(), ttl + 5)
        won = [float(w[1]) for w in lines[other.pid] if w[0] == "LEADER"]
        assert won, f"the other candidate never held the role: {lines}"
        takeover = won[0] - killed
        print(f"holder SIGKILLed: the other candidate held the role {takeover:.2f} s later (TTL {ttl} s)")
        assert takeover < ttl + 1.0
    finally:
        for candidate in candidates:
            if candidate.poll() is None:
                candidate.kill()
            candidate.wait(5)


def test_tls_and_authentication():
    """A member that serves clients over TLS with client certificates, and etcd's users: the
    store works with the right files and credentials, and says what is wrong otherwise."""
    binary, why = etcd_binary()
    if binary is None:
        pytest.skip(why)
    import shutil

    if shutil.which("openssl") is None:
        pytest.skip("openssl (to make the test's certificates) is not installed")
    with EtcdCluster(size=1, binary=binary, tls=True) as secure:
        files = {"cacert": secure.cacert, "cert": secure.client_cert, "key": secure.client_key}
        store = EtcdStore(EtcdConfig(tuple(secure.endpoints), "tls", **files), timeout=2.0)
        store.set("k", "v")
        assert store.get("k") == b"v" and store.add("n", 1) == 1
        with pytest.raises(etcd_transport.EtcdRequestError, match="TLS handshake"):
            EtcdStore(EtcdConfig(tuple(secure.endpoints), "tls", cacert=secure.cacert), timeout=2.0).get("k")
    with EtcdCluster(size=1, binary=binary) as plain:
        enable_authentication(plain.endpoints[0], "root", "secret")
        config = EtcdConfig(tuple(plain.endpoints), "auth", user="root", password="secret")
        store = EtcdStore(config, timeout=2.0)
        store.set("k", "v")
        assert store.compare_set("k", "v", "w") == b"w"
        store._gateway.session.headers["Authorization"] = "expired"  # a token etcd no longer knows
        assert store.get("k") == b"w"
        with pytest.raises(etcd_transport.EtcdRequestError, match="invalid user ID or password"):
            EtcdStore(replace(config, password="wrong"), timeout=2.0).get("k")
        with pytest.raises(etcd_transport.EtcdRequestError, match="user name is empty"):
            EtcdStore(replace(config, user=None, password=None), timeout=2.0).get("k")


def enable_authentication(endpoint: str, user: str, password: str) -> None:
    """What ``etcdctl user add root`` and ``etcdctl auth enable`` do, through etcd's gateway (the
    test needs no etcd-client package): the root user, with the root role, and authentication on."""
    import json
    import urllib.request

    for path, body in (
        ("user/add", {"name": user, "password": password}),
        ("role/add", {"name": "root"}),
        ("user/grant", {"user": user, "role": "root"}),
        ("enable", {}),
    ):
        request = urllib.request.Request(
            f"http://{endpoint}/v3/auth/{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=10) as answer:
            assert answer.status == 200, (path, answer.read())


def test_a_strangers_records_in_the_jobs_etcd_keys_are_refused_or_ignored(config):
    """A process with etcd access but another token, writing into this job's keys: its request is
    refused (the coordinator logs the refusal), its lease ignored with one log line, its change
    stops the reader with the key named; nothing of it is taken."""
    from ds_recycle.log import logger
    from ds_recycle.runtime.shared.seal import ForgedRecord

    job = C10dJobStore(etcd_transport.connect(config, 0, timeout=5.0), TOKEN, 0)
    stranger = C10dJobStore(etcd_transport.connect(config, 0, timeout=5.0), "b" * 32, 0)
    job.open_job(4, nodes=2)
    job.open_inboxes()
    stranger.post_request(Request("leave", 1, 4242, 1.0))
    with pytest.raises(ForgedRecord, match="request 1"):
        job.posted_request(1)
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger.addHandler(handler)
    try:
        stranger.renew_lease(1, Lease(9, 1.0))
        assert job.lease(1) is None and job.lease(1) is None
    finally:
        logger.removeHandler(handler)
    assert len(lines) == 1 and "lease/1" in lines[0]
    stranger.append_changes(0, [Change(0, FAILED, 2, 1.0)], 2)
    with pytest.raises(ForgedRecord, match="change/0"):
        job.changes()
