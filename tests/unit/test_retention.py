"""Retention policy: when to save and what to delete, driven by a fake clock."""

from __future__ import annotations

import pytest

from megatron.checkpointing.commit import (
    CommittedCheckpoint,
    KeepRule,
    RetentionPolicy,
    step_save_iterations,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def saves(policy: RetentionPolicy, steps: range) -> list[int]:
    return [s for s in steps if policy.decide(s).save]


def test_linear_schedule_and_extra_iters() -> None:
    assert step_save_iterations(10, "linear", [3, 999], train_iters=35) == {3, 10, 20, 30}
    policy = RetentionPolicy(train_iters=35, checkpoint_factor=10, extra_save_iters=[3], save_at_end=False)
    assert saves(policy, range(1, 36)) == [3, 10, 20, 30]


def test_log_schedule_saves_at_powers() -> None:
    assert sorted(step_save_iterations(2, "log", None, train_iters=40)) == [2, 4, 8, 16, 32]
    assert sorted(step_save_iterations(10, "log", [5], train_iters=1000)) == [5, 10, 100, 1000]
    with pytest.raises(ValueError):
        step_save_iterations(1, "log", None, train_iters=10)


def test_end_of_training_is_saved() -> None:
    policy = RetentionPolicy(train_iters=7, checkpoint_factor=5)
    assert saves(policy, range(1, 8)) == [5, 7]
    assert policy.decide(7).reason == "end of training"


def test_time_based_saves_follow_the_fake_clock() -> None:
    clock = FakeClock()
    policy = RetentionPolicy(train_iters=100, save_interval_s=900, save_at_end=False, clock=clock)
    clock.now += 899
    assert not policy.decide(1).save
    clock.now += 1
    decision = policy.decide(2)
    assert decision.save and decision.kind == "temporary"
    # until the save commits the trigger stays armed (a failed broadcast must not lose it)
    assert policy.decide(2).save
    policy.on_committed()
    clock.now += 10
    assert not policy.decide(3).save
    clock.now += 890
    assert policy.decide(4).save


def test_keep_rules_make_permanent_checkpoints() -> None:
    policy = RetentionPolicy(
        train_iters=30000,
        keep=[KeepRule(every=1000, until=10000), KeepRule(every=5000)],
        save_at_end=False,
    )
    permanent = saves(policy, range(1, 30001))
    assert permanent == [*range(1000, 10001, 1000), 15000, 20000, 25000, 30000]
    assert all(policy.decide(s).kind == "permanent" for s in permanent)
    assert not policy.decide(11000).save


def test_the_longest_lived_kind_wins() -> None:
    clock = FakeClock()
    policy = RetentionPolicy(
        train_iters=100, checkpoint_factor=10, keep=[KeepRule(every=20)], save_interval_s=1, clock=clock
    )
    clock.now += 5
    assert policy.decide(20).kind == "permanent"
    assert policy.decide(10).kind == "step"
    assert policy.decide(11).kind == "temporary"


def test_keep_last_n_prunes_oldest_step_checkpoints_only() -> None:
    policy = RetentionPolicy(train_iters=100, checkpoint_factor=10, keep_last_n_checkpoints=2, keep=[KeepRule(every=50)])
    committed = [CommittedCheckpoint(s, "step") for s in (10, 20, 30, 40)] + [CommittedCheckpoint(50, "permanent")]
    assert policy.to_delete(committed) == [10, 20]


def test_previous_temporary_deleted_only_after_a_newer_commit() -> None:
    policy = RetentionPolicy(train_iters=100, save_interval_s=60)
    only = [CommittedCheckpoint(7, "temporary")]
    assert policy.to_delete(only) == []  # the newest is what a crash resumes from
    assert policy.to_delete(only + [CommittedCheckpoint(9, "temporary")]) == [7]
    assert policy.to_delete(only + [CommittedCheckpoint(10, "step")]) == [7]


def test_newest_is_never_deleted_even_beyond_keep_last_n() -> None:
    policy = RetentionPolicy(train_iters=100, keep_last_n_checkpoints=1)
    committed = [CommittedCheckpoint(10, "step"), CommittedCheckpoint(12, "temporary")]
    assert policy.to_delete(committed) == []
    committed.append(CommittedCheckpoint(20, "step"))
    assert policy.to_delete(committed) == [10, 12]


def test_steps_matching_a_keep_rule_survive_whatever_their_recorded_kind() -> None:
    policy = RetentionPolicy(train_iters=100, keep_last_n_checkpoints=1, keep=[KeepRule(every=10, until=20)])
    committed = [CommittedCheckpoint(s, "step") for s in (10, 20, 30, 40)]
    assert policy.to_delete(committed) == [30]


def test_invalid_settings_are_rejected() -> None:
    with pytest.raises(ValueError):
        KeepRule(every=0)
    with pytest.raises(ValueError):
        RetentionPolicy(train_iters=10, keep_last_n_checkpoints=0)
    with pytest.raises(ValueError):
        RetentionPolicy(train_iters=10, save_interval_s=0)


def test_a_rewound_run_keeps_its_own_newest_checkpoints(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """After a rewind (``iteration: 5`` in a directory holding steps up to 10), the old trajectory's later
    checkpoints do not count against ``keep_last_n_checkpoints``: the rewound run's newest stay, and so do they
    (until the new trajectory replaces them step by step)."""
    import time

    from megatron.checkpointing import commit
    from megatron.checkpointing.manager import CheckpointManager
    from megatron.checkpointing.preemption import PreemptionWatcher

    for step in (6, 7, 8, 9, 10):
        tag = tmp_path / commit.tag_for(step)
        tag.mkdir()
        commit.write_commit_marker(tag, commit.CommitInfo(step=step, kind="step", time=time.time()))
    manager = CheckpointManager(save=str(tmp_path), load=str(tmp_path), args_dict={}, preemption=PreemptionWatcher(),
                                policy=RetentionPolicy(train_iters=20, checkpoint_factor=1, keep_last_n_checkpoints=2))
    manager._apply_retention(8)  # the rewound run has just saved step 8
    assert commit.list_checkpoints(tmp_path).steps == [7, 8, 9, 10]
