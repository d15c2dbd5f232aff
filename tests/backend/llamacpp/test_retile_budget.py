"""RetileBudget: when finished answers are computed again (backend.llamacpp.retile)."""

from __future__ import annotations

from backend.llamacpp.retile import RetileBudget


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_idle_engine_always_may():
    budget = RetileBudget(share=0.1, clock=Clock())
    assert all(budget.allows(busy=False) for _ in range(3))


def test_a_busy_engine_spends_at_most_its_share_of_the_time_since_it_became_busy():
    clock = Clock()
    budget = RetileBudget(share=0.1, clock=clock)
    assert not budget.allows(busy=True)  # nothing earned yet
    clock.now += 1.0
    assert budget.allows(busy=True)  # 0 s of 0.1 s
    budget.spent(0.25)
    clock.now += 1.0
    assert not budget.allows(busy=True)  # 0.25 s of 0.2 s
    clock.now += 1.0
    assert budget.allows(busy=True)  # 0.25 s of 0.3 s


def test_going_idle_starts_the_account_again():
    clock = Clock()
    budget = RetileBudget(share=0.1, clock=clock)
    budget.allows(busy=True)
    clock.now += 1.0
    budget.spent(5.0)
    assert not budget.allows(busy=True)
    assert budget.allows(busy=False)
    budget.spent(3.0)  # idle time is not counted against a busy period
    assert not budget.allows(busy=True)  # a new busy period: nothing earned yet
    clock.now += 0.5
    assert budget.allows(busy=True)


def test_share_zero_never_while_busy():
    clock = Clock()
    budget = RetileBudget(share=0.0, clock=clock)
    budget.allows(busy=True)
    clock.now += 60
    assert not budget.allows(busy=True)
