"""The fair-sharing policy as pure logic (backend.common.fairness, backend.common.door, service.callers), on plain
stand-ins for the engine's sequences; the engines and the server are proven on the real model in
tests/backend/test_fair_scheduling.py and tests/service/test_fair_sharing.py."""

from __future__ import annotations

import collections
import dataclasses
import itertools
from dataclasses import dataclass, field

import grpc
import pytest

from backend.common.door import Door
from backend.common.fairness import FairnessPolicy, ServiceCounters
from backend.common.ledger import MAX_TRACKED_CALLERS, CallerTallies, Ledger
from backend.config import EngineConfig
from backend.events import ErrorEvent, ErrorKind
from backend.llamacpp.scheduler import Scheduler
from backend.llamacpp.sequence import Turn
from backend.types import GenerationRequest, Scheduling
from service.caller_weights import parse_weights
from service.callers import Callers
from service.config import load_config
from service.errors import ServiceError
from service.telemetry import OTHER_CALLERS, CallerLabels


@dataclass
class Item:
    """What the policy reads of a sequence: its request, its tokens, whether its caller reads."""

    request: GenerationRequest
    tokens: list[int] = field(default_factory=lambda: [1, 2, 3])
    gives_way: bool = False


@dataclass
class QueuedItem(Item):
    """An item the llama.cpp scheduler can queue: it knows it by its request id."""

    turn: Turn = field(default_factory=Turn)

    @property
    def id(self) -> str:
        return self.request.request_id

    @classmethod
    def of(cls, caller: str, name: str) -> QueuedItem:
        return cls(GenerationRequest(name, (1,), scheduling=Scheduling(caller, 1.0, 0)))


def item(caller: str, priority: int = 0, weight: float = 1.0, tokens: int = 3, name: str = "") -> Item:
    scheduling = Scheduling(caller, weight, priority)
    return Item(GenerationRequest(name or caller, (1,), scheduling=scheduling), list(range(tokens)))


def policy(**settings) -> FairnessPolicy:
    return FairnessPolicy(EngineConfig.of(**({"max_batch_size": 4, "time_slice_steps": 4} | settings)))


LONG_RUN = lambda _: 100  # noqa: E731 - every running sequence has run its time slice


def victim(fair: FairnessPolicy, candidate: Item, running: list[Item], steps=LONG_RUN) -> Item | None:
    """Who gives its slot to `candidate`, each running item having run `steps(item)` steps and costing all
    its tokens to bring back (as if its cells were not kept)."""
    return fair.victim(candidate, running, steps, lambda item: len(item.tokens))


# -- service counters -------------------------------------------------------------------


def test_a_caller_that_arrives_starts_at_the_floor_of_those_it_competes_with_and_banks_no_credit():
    counters = ServiceCounters()
    counters.charge("a", 500, 1.0)
    counters.charge("b", 300, 1.0)
    counters.lift("new", {"a", "b"})
    assert counters["new"] == 300  # not 0: it would otherwise be served alone for 300 tokens
    counters.charge("c", 900, 1.0)
    counters.lift("c", {"a", "b"})
    assert counters["c"] == 900  # a caller served more than the floor keeps what it had


def test_weights_divide_the_charge_and_idle_callers_below_the_floor_are_forgotten():
    counters = ServiceCounters()
    counters.charge("heavy", 100, 2.0)
    counters.charge("light", 100, 1.0)
    assert counters["heavy"] == 50 and counters["light"] == 100
    counters.forget_idle({"light"})
    assert len(counters) == 1  # heavy holds nothing and would be lifted to 100 anyway
    counters.forget_idle(set())
    assert len(counters) == 0


def test_the_arrival_lift_looks_at_waiting_callers_first_then_running_ones():
    fair = policy()
    a_running, b_waiting = item("a"), item("b")
    fair.charge(a_running, 50)
    fair.charge(b_waiting, 20)
    fair.arrived(item("c"), [b_waiting], [a_running], {"a", "b"})
    assert fair.counters["c"] == 20
    fair.arrived(item("d"), [], [a_running], {"a"})
    assert fair.counters["d"] == 50


def test_the_llamacpp_scheduler_forgets_a_callers_counter_only_when_its_last_sequence_leaves():
    scheduler = Scheduler(4, 512, 60.0, 1024, policy(max_queued_requests=8), lambda seq: 0)
    a1, a2, b1 = (QueuedItem.of(caller, name) for caller, name in (("a", "a1"), ("a", "a2"), ("b", "b1")))
    for seq in (a1, a2, b1):
        assert scheduler.add(seq) == []
    scheduler.policy.charge(a1, 100)
    scheduler.policy.charge(b1, 50)
    scheduler.remove(a1)
    assert scheduler.policy.counters["a"] == 100  # a2 still holds a place
    scheduler.remove(b1)
    assert len(scheduler.policy.counters) == 1  # b left below the floor of those still holding
    scheduler.remove(a2)
    assert len(scheduler.policy.counters) == 0
    back = QueuedItem.of("a", "a3")
    scheduler.add(back)
    scheduler.policy.charge(back, 10)
    scheduler.add(QueuedItem.of("c", "c1"))
    assert scheduler.policy.counters["c"] == 10  # a newcomer starts at the floor of the one holding


def test_a_pass_asks_once_for_candidates_alike_and_goes_on_to_the_next_caller():
    fair = policy(max_batch_size=2)
    a_running, b_running = item("a"), item("b")
    a1, a2, c1 = item("a", name="a1"), item("a", name="a2"), item("c", name="c1")
    asked = []

    def victim_for(candidate):
        asked.append(candidate.request.request_id)
        return b_running if candidate is c1 else None

    assert fair.place([a1, a2, c1], [a_running, b_running], 2, victim_for) == (c1, b_running)
    assert asked == ["a1", "c1"]  # a2 is a1's like: skipped once a1 found no place
    assert fair.place([a1, c1], [a_running], 2, victim_for) == (a1, None)  # a free place asks no one
    assert asked == ["a1", "c1"]


# -- admission order --------------------------------------------------------------------


def test_priority_first_then_the_least_served_caller_then_arrival_order():
    fair = policy()
    fair.charge(item("a"), 100)
    a1, a2, b1, b2 = item("a", name="a1"), item("a", name="a2"), item("b", name="b1"), item("b", name="b2")
    assert fair.next([a1, a2, b1, b2], []) is b1  # b is served least
    urgent = item("a", priority=5, name="a3")
    assert fair.next([a1, b1, urgent], []) is urgent
    fair.charge(b1, 200)
    assert fair.next([a1, a2, b1, b2], []) is a1  # within a caller, its own order


def test_fifo_is_arrival_order_whoever_the_caller():
    fifo = policy(scheduling="fifo")
    fifo.charge(item("a"), 100)
    first, urgent = item("a"), item("b", priority=5)
    assert fifo.next([first, urgent], []) is first
    assert victim(fifo, urgent, [item("a")]) is None
    assert fifo.to_shed([first], [first] * 10) is None


def test_a_caller_at_its_running_limit_waits_unless_one_of_its_own_is_paused():
    fair = policy(max_running_per_caller=2)
    running = [item("a"), item("a")]
    a3, b1 = item("a", name="a3"), item("b")
    assert fair.next([a3], running) is None
    assert fair.next([a3, b1], running) is b1
    running[0].gives_way = True  # its caller is not reading
    assert fair.next([a3], running) is a3 and fair.at_limit(a3, running)


# -- preemption -------------------------------------------------------------------------


def test_a_newcomer_takes_a_slot_from_the_caller_holding_them_all_after_its_time_slice():
    fair = policy()
    running = [item("a", tokens=n, name=f"a{n}") for n in (40, 10, 30, 20)]
    newcomer = item("b")
    assert victim(fair, newcomer, running, steps=(lambda _: 3)) is None  # not a time slice yet
    assert victim(fair, newcomer, running).request.request_id == "a10"  # the cheapest to bring back
    assert victim(fair, item("a", name="a-new"), running) is None  # a caller never preempts itself


def test_a_swap_must_make_shares_more_even_or_the_caller_be_a_time_slice_ahead():
    fair = policy()
    running = [item("a", name="a1"), item("a", name="a2"), item("b", name="b1"), item("b", name="b2")]
    assert victim(fair, item("b", name="b3"), running) is None  # 2 and 2: 1 and 3 would be worse
    fair.charge(running[0], 3)
    assert victim(fair, item("b", name="b3"), running) is None  # ahead, but not by a time slice
    three_one = [item("a", name="a1"), item("a", name="a2"), item("a", name="a3"), item("b", name="b1")]
    assert victim(fair, item("b", name="b2"), three_one).request.scheduling.caller == "a"  # 3-1 -> 2-2
    three_two = [*three_one, item("b", name="b2")]
    assert victim(fair, item("b", name="b3"), three_two) is None  # 3-2 -> 2-3 needs a time slice ahead
    fair.charge(three_two[0], 100)
    assert victim(fair, item("b", name="b3"), three_two).request.scheduling.caller == "a"


def test_time_slicing_takes_only_sequences_cheap_to_bring_back_unless_the_caller_holds_no_slot():
    fair = policy()
    running = [item("a", name=f"a{i}") for i in range(3)] + [item("b", name="b1")]

    def lost(_):  # no free slot could keep its cells: all of it would be computed again
        return 100

    assert fair.victim(item("b", name="b2"), running, LONG_RUN, lost) is None
    assert fair.victim(item("c"), running, LONG_RUN, lost) is not None  # c has nothing: it gets a slot anyway
    assert fair.victim(item("b", name="b2"), running, LONG_RUN, lambda _: 2) is not None


def test_weights_set_the_share_of_slots():
    fair = policy()
    running = [item("a", weight=3.0, name=f"a{i}") for i in range(3)] + [item("b", name="b1")]
    assert victim(fair, item("b", name="b2"), running) is None  # a holds 3 of 4 at weight 3: its share
    running = [item("a", name=f"a{i}") for i in range(3)] + [item("b", name="b1")]
    assert victim(fair, item("b", weight=3.0, name="b2"), running).request.scheduling.caller == "a"


def test_a_more_urgent_request_preempts_at_once_and_sheddable_ones_go_first():
    fair = policy()
    running = [item("a", name="a0"), item("b", priority=-1, name="b-low"), item("a", name="a1"), item("a", name="a2")]
    assert victim(fair, item("a", name="a3"), running, steps=(lambda _: 0)).request.request_id == "b-low"
    zero = [item("a", name=f"a{i}") for i in range(4)]
    urgent = item("a", priority=5, name="urgent")
    assert victim(fair, urgent, zero, steps=(lambda _: 0)) is not None  # even in place of its own caller's
    assert victim(fair, item("b", priority=-1), zero) is None  # sheddable never preempts priority 0


# -- shedding ---------------------------------------------------------------------------


def test_the_newest_waiting_request_of_the_caller_holding_most_is_shed_sheddable_first():
    fair = policy()
    a_old, a_new, b = item("a", name="a-old"), item("a", name="a-new"), item("b")
    held = [item("a")] * 6 + [a_old, a_new, b]
    assert fair.to_shed([a_old, a_new, b], held) is a_new
    low = item("a", priority=-1, name="low")
    assert fair.to_shed([a_old, low, a_new, b], held + [low]) is low
    assert fair.to_shed([b], [b] * 3).request.request_id == "b"  # the newcomer itself, when it is the flood


# -- tallies ----------------------------------------------------------------------------


def test_caller_tallies_stay_bounded_and_count_live_figures():
    tallies = CallerTallies()
    for n in range(MAX_TRACKED_CALLERS + 10):
        tallies.of(item(f"c{n}")).generated_tokens_total += n
    busy = item("busy")
    snapshot = tallies.snapshot([busy], [item("busy")], [])
    assert len(snapshot) <= MAX_TRACKED_CALLERS + 1
    assert (snapshot[0].caller, snapshot[0].running, snapshot[0].queued) == ("busy", 1, 1)
    assert "c0" not in {t.caller for t in snapshot}  # the idle caller served least went first


def test_the_ledger_counts_each_thing_once_and_words_the_refusals():
    ledger, a, b = Ledger(), item("a", weight=2.0), item("b")
    ledger.started(a, 10)
    ledger.cached(6)
    ledger.generated(a, 3)
    ledger.checked(5, 2)
    ledger.preempted(a)
    ledger.recomputed(4)
    shed = ledger.shed(b)
    b.request = dataclasses.replace(b.request, scheduling=Scheduling("b", queue_timeout_s=0.25))
    timed_out = ledger.timed_out(b)
    stats = ledger.snapshot([], [b], [a], steps=7)
    assert (stats.steps, stats.started_total, stats.prompt_tokens_total, stats.cached_prompt_tokens_total) == (7, 1, 10, 6)
    assert (stats.draft_tokens_total, stats.accepted_draft_tokens_total) == (5, 2)
    assert (stats.preempted_total, stats.recomputed_tokens_total) == (1, 4)
    callers = {tally.caller: tally for tally in stats.callers}
    assert (callers["a"].prompt_tokens_total, callers["a"].generated_tokens_total) == (10, 3)
    assert (callers["a"].preempted_total, callers["a"].preempted, callers["a"].weight) == (1, 1, 2.0)
    assert (callers["b"].shed_total, callers["b"].queue_timeouts_total, callers["b"].queued) == (1, 1, 1)
    assert shed.kind is ErrorKind.SHED and shed.message.startswith("the server is full")
    assert timed_out == ErrorEvent("not started within its queue_timeout_ms (250 ms)", ErrorKind.QUEUE_TIMEOUT)


def test_metric_labels_are_bounded_and_stable():
    labels = CallerLabels(2)
    assert [labels(c) for c in ("a", "b", "c", "a", "d")] == ["a", "b", OTHER_CALLERS, "a", OTHER_CALLERS]


# -- admission at the door (backend.common.door) ----------------------------------------------------


REQUEST_IDS = itertools.count()


def enter(door: Door, key: str, priority: int = 0, weight: float = 1.0) -> str:
    """A request of `key` let in (its id), or the test fails."""
    request_id = f"r{next(REQUEST_IDS)}"
    assert door.enter(request_id, key, weight, priority) is None
    return request_id


def refusal(door: Door, key: str, priority: int = 0) -> ErrorKind:
    refused = door.enter("refused", key, 1.0, priority)
    assert refused is not None
    return refused.kind


def test_a_caller_past_its_own_limit_is_refused_while_others_come_in():
    door = Door(capacity=10, per_caller_limit=3, fair=True)
    for _ in range(3):
        enter(door, "a")
    assert refusal(door, "a") is ErrorKind.CALLER_OVER_LIMIT
    enter(door, "b")
    assert door.refused == collections.Counter({"a": 1}) and door.refusals() == (1, (("a", 1),))


def test_on_a_full_server_a_caller_under_its_share_comes_in_and_the_flood_does_not():
    door = Door(capacity=4, per_caller_limit=10, fair=True)
    places = [enter(door, "a") for _ in range(4)]
    assert refusal(door, "a") is ErrorKind.OVERLOADED  # alone, a holds its whole share
    enter(door, "b")  # under its share: the engine sheds one of a's
    assert refusal(door, "b", priority=-1) is ErrorKind.OVERLOADED  # sheddable: refused first
    door.leave(places[0])
    door.leave(places[0])  # a second leave of the same request gives nothing back
    door.leave("never-let-in")
    assert door.total == 4
    fifo = Door(capacity=1, per_caller_limit=1, fair=False)
    enter(fifo, "a")
    assert refusal(fifo, "b") is ErrorKind.OVERLOADED


def test_on_a_full_server_a_more_urgent_request_comes_in_over_share():
    door = Door(capacity=2, per_caller_limit=9, fair=True)
    enter(door, "a")
    enter(door, "a")
    enter(door, "a", priority=3)  # the engine sheds (or preempts) one of its priority-0 requests
    enter(door, "a", priority=3)
    assert refusal(door, "a", priority=3) is ErrorKind.OVERLOADED  # no less urgent one left to give way


def reason(call) -> str:
    with pytest.raises(ServiceError) as caught:
        call()
    return caught.value.reason


# -- who a request is for (service.callers) ------------------------------------------------------


def test_the_fairness_header_counts_only_when_configured():
    header = "x-gateway-inference-fairness-id"
    metadata = [(header, "tenant-7")]
    assert Callers().key("proxy", metadata) == "proxy"
    trusting = Callers(fairness_header=header)
    assert trusting.key("proxy", metadata) == "tenant-7" and trusting.key("proxy", []) == "proxy"
    with pytest.raises(ServiceError) as caught:
        trusting.key("proxy", [(header, "line\nbreak")])
    assert caught.value.code is grpc.StatusCode.INVALID_ARGUMENT


def test_priority_above_zero_for_the_named_callers_only():
    Callers().check_priority("anyone", 9)
    only_ops = Callers(priority_callers=("ops",))
    only_ops.check_priority("ops", 9)
    only_ops.check_priority("batch", -5)
    assert reason(lambda: only_ops.check_priority("batch", 1)) == "PRIORITY_NOT_ALLOWED"
    assert reason(lambda: Callers(priority_callers=()).check_priority("ops", 1)) == "PRIORITY_NOT_ALLOWED"


def test_weights_and_priority_callers_as_settings(tmp_path):
    config = load_config({"caller_weights": "team-a=2, batch=0.5"}, environ={})
    assert dict(config.caller_weights) == {"team-a": 2.0, "batch": 0.5}
    toml = tmp_path / "c.toml"
    # A certificate subject holds commas and "=": a TOML list keeps it whole.
    toml.write_text('caller_weights = ["team-a=2", "CN=svc,O=x=0.5"]\npriority_callers = ["ops"]\n')
    config = load_config({}, environ={}, config_file=str(toml))
    assert dict(config.caller_weights) == {"team-a": 2.0, "CN=svc,O=x": 0.5} and config.priority_callers == ("ops",)
    assert load_config({"priority_callers": ""}, environ={}).priority_callers == ()
    assert load_config({}, environ={}).priority_callers == ("*",)
    for bad in ("team-a", "team-a=0", "=2", "a=inf"):
        with pytest.raises(ValueError, match="caller_weights"):
            parse_weights([bad], "caller_weights")


def test_a_preempted_sequences_cells_are_given_up_after_every_ordinary_prefix():
    from backend.llamacpp.prefix_cache import PrefixIndex

    index = PrefixIndex()
    index.put(0, [1] * 20, "finished-long-ago", 20, 0)
    index.put(1, [2] * 50, "preempted", 20, 0, returning=True)
    index.put(2, [3] * 20, "finished-just-now", 20, 0)
    assert index.victim([0, 1, 2]) == 0
    assert index.victim([1, 2]) == 2  # a newer ordinary prefix goes before cells their owner comes back for
    assert index.victim([0, 2], keep_newer_than=1) == 0
    index.put(3, [4] * 10, "preempted-later", 10, 0, returning=True)
    assert index.victim([1, 3]) == 3 and index.returning == 2  # of two owners', the one with less to recompute
    assert index.victim([1], keep_newer_than=3) is None  # a short entry never pushes out a long one
    index.settle("preempted")  # it came back (or ended)
    assert index.victim([1, 2]) == 1
