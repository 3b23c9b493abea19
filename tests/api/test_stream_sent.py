"""What one Generate stream sends (`_Sent`): each sample once in its final form; partial
samples held back until the request ends, then sent from memory (`release_held`)."""

from __future__ import annotations

from tltd.domain import FinishReason, Sample
from tltd.services.rollouts import _Sent


def _sample(s: int, partial: bool = False) -> Sample:
    reason = FinishReason.ABORTED if partial else FinishReason.STOP
    return Sample("r", 0, s, (5, 6), (-0.1, -0.2), reason, partial=partial)


def test_a_complete_sample_is_sent_once():
    sent = _Sent(return_partial=False)
    assert sent.admit(_sample(0), False)
    assert not sent.admit(_sample(0), False)
    assert (sent.complete, sent.seen) == (1, 1)


def test_a_partial_sample_is_held_until_the_end_then_sent():
    sent = _Sent(return_partial=False)
    assert not sent.admit(_sample(0, partial=True), False)
    assert (sent.complete, sent.seen) == (0, 1)
    released = sent.release_held()
    assert [s.sample_index for s in released] == [0] and released[0].partial
    assert sent.release_held() == [] and not sent.admit(_sample(0, partial=True), True)


def test_a_partial_sample_replaced_by_its_complete_one_is_not_released():
    sent = _Sent(return_partial=False)
    sent.admit(_sample(0, partial=True), False)
    assert sent.admit(_sample(0), False)
    assert sent.seen == 1 and sent.release_held() == []
    assert sent.complete == 1


def test_with_return_partial_the_held_partial_is_not_sent_twice():
    sent = _Sent(return_partial=True)
    assert sent.admit(_sample(0, partial=True), False)  # the tokens so far, at once
    assert not sent.admit(_sample(0, partial=True), False)
    assert sent.release_held() == []  # it turned out final: already sent
    assert (sent.complete, sent.seen) == (0, 1)
