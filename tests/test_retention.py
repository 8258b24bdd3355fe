"""Retention rules as pure functions: keep_last, keep_every, keep_every_seconds, keep_best,
their combination, and the newest step always kept; the order in which a restore tries the
steps of a run that rolled back."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

import safepoint as sp
from safepoint._retention import Policy, StepRecord, keep_reasons, restore_order


def records(steps: list[int], **metrics: list[float | None]) -> list[StepRecord]:
    return [
        StepRecord(step, 1000.0 + 10 * step,
                   {name: values[i] for name, values in metrics.items()
                    if values[i] is not None})
        for i, step in enumerate(steps)
    ]


def test_keep_last_keeps_the_newest_n() -> None:
    kept = keep_reasons(records([1, 2, 3, 4, 5]), Policy(keep_last=2))
    assert kept == {4: ["last"], 5: ["latest", "last"]}


def test_newest_is_kept_even_with_keep_last_zero() -> None:
    assert keep_reasons(records([3, 9, 5]), Policy(keep_last=0)) == {9: ["latest"]}


def test_keep_last_none_keeps_everything() -> None:
    assert sorted(keep_reasons(records([1, 2, 3]), Policy(keep_last=None))) == [1, 2, 3]


def test_keep_every_keeps_multiples_forever() -> None:
    kept = keep_reasons(records(list(range(1, 12))), Policy(keep_last=1, keep_every=5))
    assert sorted(kept) == [5, 10, 11]
    assert kept[5] == ["every"]


def test_keep_every_seconds_keeps_one_per_window() -> None:
    # Commits 10 s apart: one kept per 25 s, anchored on the first step.
    kept = keep_reasons(records(list(range(10))), Policy(keep_last=1, keep_every_seconds=25))
    assert sorted(kept) == [0, 3, 6, 9]
    assert kept[3] == ["time"]


def test_keep_every_seconds_is_stable_as_steps_are_deleted() -> None:
    everything = records(list(range(20)))
    policy = Policy(keep_last=2, keep_every_seconds=35)
    first = keep_reasons(everything[:10], policy)
    survivors = [r for r in everything if r.step in first or r.step >= 10]
    later = keep_reasons(survivors, policy)
    assert {s for s, why in first.items() if "time" in why} <= set(later)


@pytest.mark.parametrize(("mode", "best"), [("min", [2, 4]), ("max", [1, 5])])
def test_keep_best_by_mode(mode: str, best: list[int]) -> None:
    recs = records([1, 2, 3, 4, 5, 6], loss=[9.0, 0.5, 3.0, 0.7, 8.0, None])
    kept = keep_reasons(recs, Policy(keep_last=1, keep_best=2, best_metric="loss",
                                     best_mode=mode))
    assert sorted(s for s, why in kept.items() if "best" in why) == best
    assert 6 in kept  # latest, though it has no loss


def test_steps_without_a_finite_metric_are_never_best() -> None:
    recs = records([1, 2, 3, 4], loss=[None, math.nan, 5.0, None])
    kept = keep_reasons(recs, Policy(keep_last=0, keep_best=3, best_metric="loss"))
    assert kept == {3: ["best"], 4: ["latest"]}


def test_rules_combine() -> None:
    recs = records(list(range(1, 21)), acc=[float(i % 7) for i in range(20)])
    kept = keep_reasons(recs, Policy(keep_last=2, keep_every=10, keep_best=1,
                                     best_metric="acc", best_mode="max"))
    assert sorted(kept) == [10, 14, 19, 20]
    assert kept[20] == ["latest", "last", "every"]


def test_empty_series() -> None:
    assert keep_reasons([], Policy()) == {}


@pytest.mark.parametrize("kwargs", [
    {"keep_last": -1}, {"keep_every": 0}, {"keep_best": 2}, {"best_mode": "median"},
    {"keep_every_seconds": 0}, {"keep_last": 1.5},
])
def test_bad_policies_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(sp.SafepointError):
        Policy(**kwargs)  # type: ignore[arg-type]


def test_the_step_committed_last_is_kept_below_the_newest() -> None:
    """A run rolled back to step 100 (a loss spike at 110) saves step 105: it is kept as
    `latest` beside 110, whatever keep_last says, so a save never deletes its own step."""
    rolled_back = [*records([50, 100, 110]), StepRecord(105, 5000.0, {})]
    kept = keep_reasons(rolled_back, Policy(keep_last=1, keep_every=50))
    assert kept == {50: ["every"], 100: ["every"], 105: ["latest"], 110: ["latest", "last"]}


def test_restore_tries_the_newest_step_first_without_a_rollback() -> None:
    saved = {r.step: r.saved for r in records([10, 20, 30])}
    assert restore_order([30, 10, 20], saved) == ([30, 20, 10], [])
    # A step whose manifest cannot be read has no commit time: tried in step order (and
    # skipped by the fallback when it fails).
    assert restore_order([10, 20, 30, 40], saved) == ([40, 30, 20, 10], [])
    assert restore_order([5, 7], {}) == ([7, 5], [])


def test_restore_after_a_rollback_starts_at_the_step_committed_last() -> None:
    """Rolled back to 100 after a loss spike at 110, the run saved 105: a restart resumes
    from 105 and falls back below it, never into the abandoned 110 and 120."""
    saved = {50: 1.0, 100: 2.0, 110: 3.0, 120: 4.0, 105: 5.0}
    assert restore_order(list(saved), saved) == ([105, 100, 50], [120, 110])
    # Commit times equal to the millisecond: the higher step counts as the later one.
    assert restore_order([1, 2], {1: 7.0, 2: 7.0}) == ([2, 1], [])
    # An unreadable step above the abandoned branch is passed over with it.
    assert restore_order([100, 105, 110, 130], {100: 1.0, 110: 2.0, 105: 3.0}) == (
        [105, 100], [130, 110])


def test_an_int_metric_beyond_any_float_is_never_best() -> None:
    """A recorded int metric beyond float range (a token count of 10**400) counts as no
    finite value: math.isfinite raised OverflowError, and retention failed after every
    later commit, so nothing was deleted again."""
    records = [StepRecord(1, 1.0, {"m": 10**400}), StepRecord(2, 2.0, {"m": 3})]
    kept = keep_reasons(records, Policy(keep_last=1, keep_best=1, best_metric="m"))
    assert kept == {2: ["latest", "last", "best"]}


def test_retention_keeps_the_step_a_restore_resumes_from_on_a_commit_time_tie() -> None:
    """Two steps committed in the same millisecond after a rollback: restore() resumes from
    the higher one, and retention keeps it (it kept the lower one, deleting the step just
    committed)."""
    records = [StepRecord(100, 1.0), StepRecord(110, 2.0), StepRecord(101, 3.0),
               StepRecord(102, 3.0)]
    order, _ = restore_order([r.step for r in records], {r.step: r.saved for r in records})
    assert order[0] == 102
    assert 102 in keep_reasons(records, Policy(keep_last=1, keep_every=100))


def test_keep_every_seconds_keeps_its_steps_after_a_rollback() -> None:
    """A step kept by keep_every_seconds stays kept when the run rolls back and commits a
    step numbered below it: the rule walks steps in commit order (in step order, the
    rolled-back step took the kept one's place)."""
    policy = Policy(keep_last=1, keep_every_seconds=10)
    before = [StepRecord(100, 0.0), StepRecord(110, 10.0), StepRecord(120, 11.0)]
    assert "time" in keep_reasons(before, policy)[110]
    assert "time" in keep_reasons([*before, StepRecord(105, 20.0)], policy)[110]


@pytest.mark.parametrize(
    "seconds", ["3600", True, math.inf, math.nan, 0, -1, pytest.param(10**400, id="10**400")])
def test_keep_every_seconds_must_be_a_positive_finite_number(seconds: object) -> None:
    with pytest.raises(sp.SafepointError, match=r"keep_every_seconds=.*pass a positive number"):
        Policy(keep_every_seconds=seconds)  # type: ignore[arg-type]


def test_fallback_after_rollback_never_resumes_from_abandoned_branch() -> None:
    """Steps 100 and 110 (a loss spike) saved; the run restored 100 and saved 105, then 111.
    Only steps numbered above the step saved last were passed over, so once the new branch
    went past the old one nothing was: a damaged 111 fell back to the abandoned 110. A step
    is abandoned whenever a step numbered below it was saved after it."""
    saved = {100: 1.0, 110: 2.0, 105: 3.0, 111: 4.0}
    assert restore_order(list(saved), saved) == ([111, 105, 100], [110])
    # Two rollbacks: 120 then 108 abandoned, each by a lower step saved after it.
    saved = {100: 1.0, 110: 2.0, 105: 3.0, 120: 4.0, 108: 5.0, 130: 6.0}
    assert restore_order(list(saved), saved) == ([130, 108, 105, 100], [120, 110])
    # A step with no time (unreadable manifest) stays where its number puts it.
    saved = {100: 1.0, 110: 2.0, 105: 3.0, 111: 4.0}
    assert restore_order([100, 105, 107, 110, 111], saved) == ([111, 107, 105, 100], [110])


@pytest.mark.parametrize("metric", [["val_loss"], 5, ""])
def test_best_metric_that_is_not_a_name_is_refused_not_breaking_retention(
    tmp_path: Path, metric: object,
) -> None:
    """best_metric=["val_loss"] (a config list) was accepted: every retention then failed
    with a raw TypeError (unhashable list), only logged, so no step was ever deleted, and
    kept() raised it; best_metric=5 silently kept nothing as best. Refused when the policy
    (or the manager) is made, naming best_metric."""
    with pytest.raises(sp.SafepointError, match=r"best_metric=.*pass the name"):
        Policy(keep_best=1, best_metric=metric)  # type: ignore[arg-type]
    with pytest.raises(sp.SafepointError, match="best_metric="):
        sp.CheckpointManager(str(tmp_path / "run"), keep_best=1,
                             best_metric=metric)  # type: ignore[arg-type]
    assert not (tmp_path / "run").exists()


def test_numpy_counts_and_seconds_become_python_numbers() -> None:
    """NumPy numbers pass as counts and seconds and are stored as Python ones: the policy
    goes into every manifest as JSON."""
    policy = Policy(keep_last=np.int64(2), keep_every=np.int32(5), keep_best=np.uint8(1),
                    best_metric="loss", keep_every_seconds=np.float32(600.0))
    fields = dataclasses.asdict(policy)
    assert json.loads(json.dumps(fields)) == fields
    assert (policy.keep_last, policy.keep_every, policy.keep_best) == (2, 5, 1)
    assert type(policy.keep_last) is int and type(policy.keep_every_seconds) is float
    assert Policy(keep_every_seconds=np.int64(3600)).keep_every_seconds == 3600
    with pytest.raises(sp.SafepointError, match="keep_last"):
        Policy(keep_last=np.float64(2.0))  # type: ignore[arg-type]


def test_restore_falls_back_along_the_recorded_parents() -> None:
    """Steps 100 and 110 saved; the run restored 100 and saved 105; it then restored 110
    (`step=`) and saved 120. From 120 a restore falls back to 110, the step 120 continued
    from, then 100: not to 105, the branch saved after 110."""
    saved = {100: 1.0, 110: 2.0, 105: 3.0, 120: 4.0}
    parents = {110: 100, 105: 100, 120: 110}
    assert restore_order(list(saved), saved, parents) == ([120, 110, 100], [105])
    # Without parents (steps saved before they were recorded), save order decides.
    assert restore_order(list(saved), saved) == ([120, 105, 100], [110])


def test_a_missing_or_later_parent_falls_back_by_save_order_below_it() -> None:
    """A parent that retention deleted (or a save that failed) leaves the steps saved
    before, numbered below it; a parent saved after its child (a step saved anew since)
    holds another branch's state and is not followed."""
    saved = {50: 1.0, 100: 2.0, 90: 3.0, 120: 4.0}
    # 120 continued from 110, gone: below 110, the step saved last is 90 (100 was abandoned).
    assert restore_order(list(saved), saved, {120: 110}) == ([120, 90, 50], [100])
    # 100 was saved again after 120 was saved from its first save: 120's parent is stale.
    saved = {50: 1.0, 120: 3.0, 100: 4.0}
    assert restore_order([50, 100, 120], saved, {120: 100, 100: 50}) == ([100, 50], [120])
    later = {50: 1.0, 120: 2.0, 100: 3.0, 130: 4.0}
    assert restore_order(list(later), later, {130: 120, 120: 100}) == ([130, 120, 50], [100])


def test_a_parent_whose_manifest_is_unreadable_is_tried_in_its_place() -> None:
    """120 continued from 110, whose manifest cannot be read: 110 is tried next (a restore
    reports it and falls back), then, its own parent unknown, the step saved last before
    120 below 110."""
    saved = {100: 1.0, 105: 3.0, 120: 4.0}
    assert restore_order([100, 105, 110, 120], saved, {120: 110, 105: 100}) == (
        [120, 110, 105, 100], [])



def test_a_parent_numbered_above_its_step_is_not_followed() -> None:
    """105 records 110 as its parent: the run rolled back without the manager (an `sp.load`
    of 100). Its fallback is by save order below 105, never the abandoned 110."""
    saved = {100: 1.0, 110: 2.0, 105: 3.0}
    assert restore_order(list(saved), saved, {110: 100, 105: 110}) == ([105, 100], [110])
