"""Prefix-affinity routing through the shipped Envoy and HAProxy configs, in front of three live
replicas: 12 chat sessions of 6 turns each, with the affinity key (x-tokenspout-affinity) and
without. With it, the share of prompt tokens served from cache comes within 0.9 of one replica
alone that has room for every session, and the busiest replica serves at most 1.5x the mean; a
replica killed mid-run fails only the streams it was serving, its sessions move to the others,
and the others' sessions stay where they were.
"""

from __future__ import annotations

import os
import signal
import threading
from collections import Counter

import pytest

from chat_sessions import Run, run_sessions
from conftest import REPORT
from proxies import REPLICA_FLAGS, Envoy, HAProxy, start_replicas, stop_replicas
from conftest import start_server

SESSIONS, TURNS = 12, 6


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model_path):
    """Three replicas behind Envoy and HAProxy, and one replica alone with cache room for every
    session (8 running + 8 idle cache streams), the baseline."""
    tmp = tmp_path_factory.mktemp("affinity")
    replicas = start_replicas(tmp, 3)
    alone = start_server(tmp, *REPLICA_FLAGS, "--prefix-cache-slots", "8")
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
def baseline(cluster) -> Run:
    _, alone, _ = cluster
    run = run_sessions(alone.address, "alone", [alone], SESSIONS, TURNS)
    REPORT.append("affinity: " + run.summary(1))
    assert not run.failed()
    return run


@pytest.mark.parametrize("proxy_name", ["envoy", "haproxy"])
def test_the_key_keeps_a_chat_on_the_replica_that_caches_it(cluster, baseline, proxy_name):
    replicas, _, proxies = cluster
    proxy = proxies[proxy_name]
    keyed = run_sessions(proxy.address, f"{proxy_name}-key", replicas, SESSIONS, TURNS)
    keyless = run_sessions(proxy.address, f"{proxy_name}-nokey", replicas, SESSIONS, TURNS, affinity=False)
    for run in (keyed, keyless):
        REPORT.append(f"affinity: {run.summary(3)}; / alone {run.cache_share() / baseline.cache_share():.2f}")
    assert not keyed.failed() and not keyless.failed()
    assert keyed.cache_share() >= 0.9 * baseline.cache_share()
    assert keyed.cache_share() > keyless.cache_share(), "without the key, turns land where their history is not"
    assert keyed.spread(3) <= 1.5, keyed.served(3)
    assert keyless.spread(3) <= 1.5, keyless.served(3)


def home(run: Run, turns) -> dict[int, int]:
    """Session -> the replica that served most of `turns`."""
    counts: dict[int, Counter] = {}
    for turn in turns:
        counts.setdefault(turn.session, Counter())[turn.replica] += 1
    return {session: counter.most_common(1)[0][0] for session, counter in counts.items()}


def test_a_replica_killed_mid_run_moves_its_sessions_and_only_those(cluster):
    """12 sessions through each proxy at once; after two turns each, kill -9 the third replica."""
    replicas, _, proxies = cluster
    victim = 2
    done, killed = Counter(), threading.Event()
    lock = threading.Lock()

    def after_turn(turn) -> None:
        with lock:
            done[turn.session, threading.current_thread().name] += 1
            if not killed.is_set() and sum(done.values()) >= 2 * 2 * SESSIONS:
                os.kill(replicas[victim].process.pid, signal.SIGKILL)
                killed.set()

    runs: dict[str, Run] = {}

    def drive(name: str) -> None:
        runs[name] = run_sessions(proxies[name].address, f"{name}-kill", replicas, SESSIONS, TURNS, after_turn=after_turn)

    threads = [threading.Thread(target=drive, args=(name,)) for name in proxies]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=900)
    assert killed.is_set() and replicas[victim].process.wait(timeout=10) == -signal.SIGKILL
    for name, run in runs.items():
        ok = sorted(run.ok(), key=lambda t: t.turn)
        # Which turns came before the kill: those the victim served, and as many of each session's
        # first turns as it finished before the failure or the victim's last turn.
        failed = run.failed()
        last_on_victim = {t.session: t.turn for t in ok if t.replica == victim}
        before = [t for t in ok if t.turn < 2]
        homes = home(run, before)
        on_victim = {s for s, r in homes.items() if r == victim}
        REPORT.append(f"affinity: {name}, kill -9 mid-run: {len(failed)} of {len(run.turns)} turns failed "
                      f"({sorted(Counter(t.outcome for t in failed).items())}); {len(on_victim)} sessions moved")
        # Only the streams on the victim failed: one turn at most per session of the victim's.
        assert {t.session for t in failed} <= on_victim, (failed, homes)
        assert len(failed) <= len(on_victim)
        # Its sessions went on elsewhere: every later turn succeeded, on a survivor.
        for session in on_victim:
            later = [t for t in ok if t.session == session and t.turn > last_on_victim.get(session, -1)]
            assert later and all(t.replica != victim for t in later), session
            assert len(later) + sum(t.session == session for t in failed) + last_on_victim.get(session, -1) + 1 == TURNS
        # The others' sessions stayed on their replicas (the load bound may spill the odd turn).
        after = [t for t in ok if t.turn >= 3 and homes.get(t.session, victim) != victim]
        stayed = sum(t.replica == homes[t.session] for t in after)
        REPORT.append(f"affinity: {name}, after the kill {stayed} of {len(after)} turns of the other sessions stayed")
        assert stayed >= 0.9 * len(after)
