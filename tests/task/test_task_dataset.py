from __future__ import annotations

import pytest

from examples.task.dataset import build_dataset


def test_epochs_visit_every_training_prompt_once_each_in_a_new_order() -> None:
    ds = build_dataset(per_step=8, train_size=16, held_out_size=8)
    epoch0 = [p for s in (0, 1) for p, _ in ds.batch(s)]
    epoch1 = [p for s in (2, 3) for p, _ in ds.batch(s)]
    train = [p for p, _ in ds.train]
    assert sorted(map(id, epoch0)) == sorted(map(id, train))
    assert sorted(map(id, epoch1)) == sorted(map(id, train))
    assert epoch0 != epoch1  # reshuffled
    assert ds.epoch_of(2) == 1.0
    # Deterministic: a fresh build gives the same stream.
    again = build_dataset(per_step=8, train_size=16, held_out_size=8)
    assert [p for p, _ in again.batch(3)] == [p for p, _ in ds.batch(3)]


def test_a_batch_crossing_an_epoch_end_continues_in_the_next_order() -> None:
    ds = build_dataset(per_step=6, train_size=16, held_out_size=4)
    stream = [p for s in range(8) for p, _ in ds.batch(s)]  # 48 items = 3 epochs
    for e in range(3):
        chunk = stream[16 * e : 16 * (e + 1)]
        assert len({id(p) for p in chunk}) == 16


def test_held_out_is_disjoint_from_training_and_fixed() -> None:
    ds = build_dataset(per_step=16, train_size=32, held_out_size=32)
    keys = {(p.start, p.step, p.count) for p, _ in ds.train}
    assert len(ds.held_out) == 32
    assert not keys & {(p.start, p.step, p.count) for p, _ in ds.held_out}
    assert all(ids[0] == 1 for _, ids in ds.held_out)  # <bos> first


def test_per_step_larger_than_the_training_set_is_refused() -> None:
    with pytest.raises(ValueError, match="per_step"):
        build_dataset(per_step=40, train_size=32, held_out_size=4)


def test_validation_split_is_disjoint_from_training_and_held_out() -> None:
    ds = build_dataset(per_step=16, train_size=32, held_out_size=32, validation_size=32)
    train = {(p.start, p.step, p.count) for p, _ in ds.train}
    held = {(p.start, p.step, p.count) for p, _ in ds.held_out}
    val = [(p.start, p.step, p.count) for p, _ in ds.validation]
    assert len(val) == 32 and len(set(val)) == 32
    assert not set(val) & train and not set(val) & held
    # Adding the split leaves the held-out set as it was: results stay comparable.
    before = build_dataset(per_step=16, train_size=32, held_out_size=32, validation_size=0)
    assert [p for p, _ in before.held_out] == [p for p, _ in ds.held_out]
    assert before.validation == []
