"""The thread count the engine picks when `threads` is 0: whichever decodes faster, as the load changes
(pure logic: the decode times are the test's)."""

from __future__ import annotations

from backend.llamacpp.speculation.threads import FIRST_INTERVAL, PROBE_STEPS, ThreadTuner


def run(tuner: ThreadTuner, per_row: dict[int, float], steps: int) -> list[int]:
    """Feeds decode steps of 1 pass and 3 rows taking per_row[threads] a row; the counts used, step by step."""
    used = []
    for _ in range(steps):
        used.append(tuner.threads)
        tuner.record(1, 3, 3, 4 * per_row[tuner.threads])
    return used


def test_it_starts_safe_and_moves_to_every_core_where_that_is_faster():
    tuner = ThreadTuner(cores=2)
    assert tuner.candidates == [2, 1] and tuner.threads == 1
    used = run(tuner, {1: 0.010, 2: 0.006}, FIRST_INTERVAL + PROBE_STEPS + 50)
    assert used[:FIRST_INTERVAL] == [1] * FIRST_INTERVAL and used[-1] == 2 and tuner.incumbent == 2


def test_a_probe_on_a_loaded_machine_costs_one_slow_step_and_backs_off():
    tuner = ThreadTuner(cores=2)
    used = run(tuner, {1: 0.010, 2: 0.300}, 4 * FIRST_INTERVAL)
    assert used.count(2) == 2  # probes after 200 steps and 400 more, each cut at its first step
    assert tuner.incumbent == 1


def test_it_comes_back_when_the_load_changes():
    tuner = ThreadTuner(cores=2)
    run(tuner, {1: 0.010, 2: 0.006}, FIRST_INTERVAL + PROBE_STEPS)
    assert tuner.incumbent == 2
    used = run(tuner, {1: 0.010, 2: 0.200}, 3 * PROBE_STEPS)  # another process takes a core
    assert tuner.incumbent == 1 and used.count(2) <= PROBE_STEPS  # tried at once, not after 200 slow steps


def test_a_fixed_count_is_kept_and_each_count_has_its_own_costs():
    tuner = ThreadTuner(fixed=3, cores=8)
    assert run(tuner, {3: 0.01}, 500) == [3] * 500
    two = ThreadTuner(cores=2)
    run(two, {1: 0.010, 2: 0.006}, FIRST_INTERVAL + PROBE_STEPS)
    assert two.costs[1].known and two.costs[2].known and two.current_costs is two.costs[2]


def test_a_machine_slow_for_both_counts_is_not_probed_over_and_over():
    tuner = ThreadTuner(cores=2)
    run(tuner, {1: 0.010, 2: 0.030}, FIRST_INTERVAL)
    used = run(tuner, {1: 0.100, 2: 0.900}, 10 * FIRST_INTERVAL)  # everything slowed down
    assert tuner.incumbent == 1 and used.count(2) <= 3
