"""A session across a daemon kill -9 (a real `tltd serve`, SQLite and PostgreSQL): the turns done
before it are intact, the turn running at the kill is finished by the restarted daemon when the
trainer retries it, and every turn ran once (lost 0, duplicated 0)."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from tests.api.support import sampling
from tests.rollout.support import ServeProcess, direct_outputs
from tests.rollout.test_bounded_crash import _sql
from tltd.domain import SamplingParams

PROMPT = [1, 2, 3, 4]
ENV = [[5, 6, 7], [8, 9], [10]]
SHORT = dict(temperature=0.0, max_new_tokens=12)
# Long enough that the turn is seen running on a loaded machine (~1 s alone on 2 cores).
LONG = dict(temperature=0.0, max_new_tokens=1900)
SEQ = dict(worker_max_seq_len="2048")  # the model's positions


def _expected(path, context: list[int], max_new_tokens: int) -> list[int]:
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens)
    return list(direct_outputs(path, [context], greedy, max_seq_len=2048)[(0, 0)])


def _wait_running(daemon: ServeProcess, db_url: str, turn: threading.Thread, errors) -> None:
    """Until turn 2's unit is leased (running); a turn that returned first, or a wait past
    the deadline, fails with what the store and the daemon's log show."""
    units = "SELECT request_id, state FROM work_units ORDER BY request_id"
    deadline = time.monotonic() + 60
    while ("session:s:2:0", "leased") not in (seen := _sql(db_url, units)):
        if not turn.is_alive() or time.monotonic() > deadline:
            log = daemon.log_file.read_text()[-4000:]
            pytest.fail(f"turn 2 not seen running: units {seen}, errors {errors}\n{log}")
        time.sleep(0.01)


def _first_daemon(tmp_path, migrated_db_url: str, ckpt):
    """Two turns done, the third running (long) when the daemon is killed: the session as
    read before the kill."""
    a = ServeProcess(tmp_path, migrated_db_url, "a", **SEQ)
    try:
        with a.client() as c:
            c.create_job(str(ckpt), job_id="job")
            c.open_session("job", PROMPT, session_id="s")
            c.turn("s", 0, sampling=sampling(**SHORT))
            c.turn("s", 1, ENV[0], sampling=sampling(**SHORT))
            before = c.get_session("s")
            errors: list[Exception] = []

            def third() -> None:
                try:
                    c.turn("s", 2, ENV[1], sampling=sampling(**LONG))
                except Exception as exc:  # noqa: BLE001 - the daemon dies under it
                    errors.append(exc)

            t = threading.Thread(target=third)
            t.start()
            _wait_running(a, migrated_db_url, t, errors)
            a.proc.send_signal(signal.SIGKILL)
            a.wait()
            t.join(30)
            assert not t.is_alive() and len(errors) == 1
    finally:
        a.kill()
    return before


@pytest.mark.slow
def test_a_session_survives_a_daemon_kill9_between_and_during_turns(
    migrated_db_url, tmp_path, ckpt
):
    before = _first_daemon(tmp_path, migrated_db_url, ckpt)
    b = ServeProcess(tmp_path, migrated_db_url, "b", **SEQ)
    try:
        with b.client() as c:
            after = c.get_session("s")
            # The retry attaches to turn 2's request, re-run by the restarted daemon.
            t2 = c.turn("s", 2, ENV[1], sampling=sampling(**LONG)).turn
            t3 = c.turn("s", 3, ENV[2], sampling=sampling(**SHORT)).turn
            closed = c.close_session("s")
            per_turn = [
                len(c.get_request(t.request_id, include_samples=True).samples) for t in closed.turns
            ]
    finally:
        b.kill()
    assert list(after.turns[:2]) == list(before.turns) and after.num_turns >= 2
    assert list(after.trajectory.token_ids)[: before.num_tokens] == list(
        before.trajectory.token_ids
    )
    assert per_turn == [1, 1, 1, 1]  # each turn ran once
    t0, t1 = before.turns
    assert [t.turn_index for t in closed.turns] == [0, 1, 2, 3]
    assert closed.turns[2] == t2 and closed.turns[3] == t3
    context = PROMPT + list(t0.token_ids) + ENV[0] + list(t1.token_ids) + ENV[1]
    assert list(t2.token_ids) == _expected(ckpt, context, LONG["max_new_tokens"])
    context += list(t2.token_ids) + ENV[2]
    assert list(t3.token_ids) == _expected(ckpt, context, SHORT["max_new_tokens"])
    context += list(t3.token_ids)
    assert list(closed.trajectory.token_ids) == context  # lost 0, duplicated 0
    long = LONG["max_new_tokens"]
    lengths = [(0, 4), (1, 12), (0, 3), (1, 12), (0, 2), (1, long), (0, 1), (1, 12)]
    assert list(closed.trajectory.loss_mask) == [m for m, n in lengths for _ in range(n)]
