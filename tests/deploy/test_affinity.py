"""Prefix-affinity routing through the shipped Envoy and HAProxy configs, in front of three live
replicas: 12 chat sessions of 6 turns each, with the affinity key (x-tokenspout-affinity) and
without. With it, the share of prompt tokens served from cache comes within 0.9 of one replica
alone that has room for every session, and the busiest replica serves at most 1.5x the mean; a
replica killed mid-run fails only the streams it was serving and its sessions move to the others;
its keys move, and only its keys (through HAProxy; through Envoy also a few of the others').
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter

import grpc
import pytest

from tests.harness.chat_sessions import Run, run_sessions
from tests.harness.helpers import greedy
from tests.harness.proxies import AFFINITY_HEADER, REPLICA_FLAGS, Envoy, HAProxy, requests_finished, start_replicas, stop_replicas
from tests.harness.servers import REPORT, start_server
from tokenspout.v1 import generation_pb2_grpc as pb_grpc

SESSIONS, TURNS = 12, 6

# The first test also pays for the module's fixtures: four replicas, two proxies and a baseline run of 72 turns
# (a loaded CI machine has needed more than the suite's 300 s).
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model_path):
    """Three replicas behind Envoy and HAProxy, and one replica alone with cache room for every
    session (8 running + 8 idle cache streams), the baseline."""
    tmp = tmp_path_factory.mktemp("affinity")
    replicas = start_replicas(tmp, 3)
    # The lone replica computes alone (the others idle meanwhile): every core, unlike the replicas' one thread each. A
    # cache share does not depend on the thread count.
    alone = start_server(tmp, *REPLICA_FLAGS, "--prefix-cache-slots", "8", "--threads", "0")
    proxies = {}
    try:
        addresses = [r.address for r in replicas]
        proxies = {"envoy": Envoy(tmp, addresses), "haproxy": HAProxy(tmp, addresses)}
        yield replicas, alone, proxies
    finally:
        for proxy in proxies.values():
            proxy.stop()
        stop_replicas([*replicas, alone])


@pytest.fixture(scope="module")
def baseline(cluster) -> float:
    """The cache share of one replica alone with room for every session. One run: it holds still (0.781-0.795 over
    42 runs in 14 suites; it once moved by a fifth between runs, and the median of three was taken)."""
    _, alone, _ = cluster
    run = run_sessions(alone.address, "alone", [alone], SESSIONS, TURNS)
    REPORT.append("affinity: " + run.summary(1))
    assert not run.failed()
    return run.cache_share()


@pytest.mark.parametrize("proxy_name", ["envoy", "haproxy"])
def test_the_key_keeps_a_chat_on_the_replica_that_caches_it(cluster, baseline, proxy_name):
    replicas, _, proxies = cluster
    proxy = proxies[proxy_name]
    keyed = run_sessions(proxy.address, f"{proxy_name}-key", replicas, SESSIONS, TURNS)
    keyless = run_sessions(proxy.address, f"{proxy_name}-nokey", replicas, SESSIONS, TURNS, affinity=False)
    for run in (keyed, keyless):
        REPORT.append(f"affinity: {run.summary(3)}; / alone {run.cache_share() / baseline:.2f}")
    assert not keyed.failed() and not keyless.failed()
    assert keyed.cache_share() >= 0.9 * baseline
    assert keyed.cache_share() > keyless.cache_share(), "without the key, turns land where their history is not"
    assert keyed.spread(3) <= 1.5, keyed.served(3)
    assert keyless.spread(3) <= 1.5, keyless.served(3)


def home(turns) -> dict[int, int]:
    """Session -> the replica that served most of `turns`."""
    counts: dict[int, Counter] = {}
    for turn in turns:
        counts.setdefault(turn.session, Counter())[turn.replica] += 1
    return {session: counter.most_common(1)[0][0] for session, counter in counts.items()}


def placement(proxy, replicas, label: str, keys: int = 48) -> dict[str, int]:
    """Session id -> the replica a one-token call with it lands on, one call at a time (so the
    load bound never steps in)."""
    with grpc.insecure_channel(proxy.address) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        for key in range(keys):
            request = greedy("Hi", max_new_tokens=1)
            request.request_id = f"{label}-{key}"
            list(stub.GenerateStream(request, timeout=60, metadata=((AFFINITY_HEADER, f"session-{key}"),)))
    finished = [requests_finished(r) if r.process.poll() is None else set() for r in replicas]
    return {f"session-{key}": next(i for i, ids in enumerate(finished) if f"{label}-{key}" in ids) for key in range(keys)}


def test_a_replica_killed_mid_run_moves_its_sessions_and_only_those(cluster):
    """6 sessions through each proxy at once; after two turns each, kill -9 the third replica:
    only the streams it was serving fail, its sessions go on elsewhere. Then one call at a time:
    the keys it held moved, and (HAProxy) every other key is where it was, or (Envoy) most."""
    replicas, _, proxies = cluster
    victim, sessions = 2, SESSIONS // 2
    before = {name: placement(proxy, replicas, f"{name}-place") for name, proxy in proxies.items()}
    for name, keys in before.items():
        assert set(keys.values()) == {0, 1, 2}, f"{name} spreads the keys over all three: {keys}"
    done, killed, killed_at, lock = [0], threading.Event(), [0.0], threading.Lock()

    def after_turn(turn) -> None:
        with lock:
            done[0] += 1
            if not killed.is_set() and done[0] >= 2 * 2 * sessions:
                killed_at[0] = time.monotonic()
                os.kill(replicas[victim].process.pid, signal.SIGKILL)
                killed.set()

    runs: dict[str, Run] = {}

    def drive(name: str) -> None:
        runs[name] = run_sessions(proxies[name].address, f"{name}-kill", replicas, sessions, TURNS, after_turn=after_turn)

    threads = [threading.Thread(target=drive, args=(name,)) for name in proxies]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=900)
    assert killed.is_set() and replicas[victim].process.wait(timeout=10) == -signal.SIGKILL
    for name, run in runs.items():
        ok, failed = run.ok(), run.failed()
        homes = home(t for t in ok if t.turn < 2)
        on_victim = {s for s, r in homes.items() if r == victim}
        REPORT.append(f"affinity: {name}, kill -9 mid-run: {len(failed)} of {len(run.turns)} turns failed "
                      f"({sorted(Counter(t.outcome for t in failed).items())}); {len(on_victim)} sessions moved")
        # Only streams on the victim failed: no survivor logged the end of a failed turn (every
        # request end is logged with its id). A failed turn's session need not live on the victim:
        # bounded-load hashing (HAProxy's hash-balance-factor) sends a turn past a busy home.
        survivors_logs = [replica.log() for index, replica in enumerate(replicas) if index != victim]
        for turn in failed:
            assert not any(f"request {turn.request_id} " in log for log in survivors_logs), (turn, homes)
        # At most one turn of each session failed; the victim's sessions went on on survivors: every one
        # that sent a turn after the kill got an answer. (Sessions run at their own pace, so one may have
        # sent all its turns to the victim before the kill, or none after it.)
        assert max(Counter(t.session for t in failed).values(), default=0) <= 1, failed
        went_on = {t.session for t in ok if t.session in on_victim and t.sent_at > killed_at[0]}
        sent_after = {t.session for t in run.turns if t.session in on_victim and t.sent_at > killed_at[0]}
        assert went_on == sent_after, (sent_after - went_on, run.turns)
    # Once the health checks have taken the victim out: its keys moved, and only its keys.
    proxies["envoy"].wait_for(lambda hosts: not hosts[replicas[victim].address])
    proxies["haproxy"].wait_for(lambda states: states == {"replica1": True, "replica2": True, "replica3": False})
    for name, proxy in proxies.items():
        after = placement(proxy, replicas, f"{name}-moved")
        moved = {key for key in after if after[key] != before[name][key]}
        REPORT.append(f"affinity: {name}: {len(moved)} of {len(after)} keys moved after the kill, "
                      f"{sum(r == victim for r in before[name].values())} had been on the victim")
        on_victim = {key for key, replica in before[name].items() if replica == victim}
        assert victim not in after.values() and moved >= on_victim
        if name == "haproxy":
            # A fixed set of points per server: only the victim's keys move.
            assert moved == on_victim
        else:
            # Envoy's ring keeps its size (minimum_ring_size) whatever the number of hosts, so the
            # survivors get more points each and take about 1 in 7 of each other's keys as well
            # (a modulo hash would move half of them).
            assert len(moved - on_victim) <= (len(before[name]) - len(on_victim)) // 3, moved - on_victim
