"""The thread count the engine picks when `threads` is 0: whichever decodes faster, as the load changes
(pure logic: the decode times are the test's)."""

from __future__ import annotations

from backend.llamacpp.speculation.threads import FIRST_INTERVAL, FIRST_PROBE, PROBE_STEPS, ThreadTuner


def run(tuner: ThreadTuner, per_row: dict[int, float], steps: int, shape: tuple[int, int, int] = (1, 3, 3)) -> list[int]:
    """Feeds decodes of `shape` (passes, rows, rows with logits: a decoding step of 3 rows by default)
    taking per_row[threads] a row of work; the counts used, step by step."""
    used = []
    for _ in range(steps):
        used.append(tuner.threads)
        tuner.record(*shape, tuner.current_costs.work(*shape) * per_row[tuner.threads])
    return used


def test_it_starts_safe_and_moves_to_every_core_as_soon_as_that_is_faster():
    tuner = ThreadTuner(cores=2)
    assert tuner.candidates == [2, 1] and tuner.threads == 1
    used = run(tuner, {1: 0.010, 2: 0.006}, FIRST_PROBE + PROBE_STEPS + 50)
    assert used[:FIRST_PROBE] == [1] * FIRST_PROBE and used[FIRST_PROBE:] == [2] * (PROBE_STEPS + 50)
    assert tuner.incumbent == 2


def test_prompt_chunks_alone_find_the_faster_count():
    """A server that has only computed prompts yet (one token answers, long prompts) runs them on every core."""
    tuner = ThreadTuner(cores=2)
    used = run(tuner, {1: 0.010, 2: 0.005}, FIRST_PROBE + 2 * PROBE_STEPS, shape=(1, 64, 1))
    assert tuner.incumbent == 2 and used[FIRST_PROBE:] == [2] * 2 * PROBE_STEPS


def test_a_probe_on_a_loaded_machine_costs_one_slow_step_and_backs_off():
    tuner = ThreadTuner(cores=2)
    used = run(tuner, {1: 0.010, 2: 0.300}, 4 * FIRST_INTERVAL)
    # Probes after the first decode, 200 more and 400 more, each cut at its first step.
    assert [i for i, threads in enumerate(used) if threads == 2] == [FIRST_PROBE, FIRST_PROBE + 1 + FIRST_INTERVAL,
                                                                     FIRST_PROBE + 2 + 3 * FIRST_INTERVAL]
    assert tuner.incumbent == 1


def test_it_comes_back_when_the_load_changes():
    tuner = ThreadTuner(cores=2)
    run(tuner, {1: 0.010, 2: 0.006}, 2 * PROBE_STEPS)
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
