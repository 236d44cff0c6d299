"""The serving benchmark's run-wide time budget, on a fake clock."""

from __future__ import annotations

import pytest

from bench.serving import MIN_LEVEL_S, TimeBudget


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_levels_share_what_is_left_and_early_finishes_leave_more() -> None:
    clock = Clock()
    budget = TimeBudget(1200, levels=6, cap_s=600, clock=clock)
    assert budget.next_level() == pytest.approx(200)  # 1200 s over 6 levels
    clock.t += 20  # that level took 20 s of its 200
    assert budget.next_level() == pytest.approx(1180 / 5)
    clock.t += 1180 / 5  # this one used all of its share
    assert budget.next_level() == pytest.approx((1180 - 1180 / 5) / 4)


def test_the_cap_and_the_floor_bound_every_level() -> None:
    clock = Clock()
    budget = TimeBudget(10_000, levels=2, cap_s=300, clock=clock)
    assert budget.next_level() == 300  # --time-limit still caps a generous budget
    clock.t += 9_990  # a slow start-up ate the budget
    assert budget.next_level() == MIN_LEVEL_S
    assert budget.levels_left == 0


def test_no_budget_means_the_cap_alone() -> None:
    clock = Clock()
    budget = TimeBudget(0, levels=3, cap_s=450, clock=clock)
    clock.t += 1e6
    assert [budget.next_level() for _ in range(3)] == [450, 450, 450]


def test_a_skipped_engine_gives_its_levels_share_to_the_rest() -> None:
    clock = Clock()
    budget = TimeBudget(900, levels=9, cap_s=600, clock=clock)
    budget.levels_left -= 3  # the first engine is missing: what `main` does
    assert budget.next_level() == pytest.approx(150)
