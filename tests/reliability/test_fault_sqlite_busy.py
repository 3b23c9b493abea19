"""SQLite busy under concurrent writers: while trainers keep rollouts in flight, other
processes' connections write to the daemon's database file in short exclusive transactions
(as a backup or an operator's script would), and one holds the write lock longer than the
daemon's busy timeout. Nothing is lost: every request completes with all its samples; a
call that meets the long lock gets a status a client retries (UNAVAILABLE), never INTERNAL
(a Generate told INTERNAL was never stored and its trainer did not retry it); one that still
ends in an error must never have been stored, or be stored FAILED with a reason.
"""

from __future__ import annotations

import random
import sqlite3
import threading
import time
from collections import Counter

from tests.reliability.trainers import Trainer, account
from tltd.store.database import SQLITE_BUSY_TIMEOUT_MS
from tltd_clients.client import TltClient


def _writer(path: str, stop: threading.Event, hold: tuple[float, float], counts: Counter) -> None:
    """Short write transactions on a table of its own, back to back, each holding the lock."""
    conn = sqlite3.connect(path, timeout=60, isolation_level=None)
    conn.execute("CREATE TABLE IF NOT EXISTS reliability_noise (x INTEGER)")
    rng = random.Random(threading.get_ident())
    while not stop.is_set():
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO reliability_noise VALUES (?)", (rng.randrange(1 << 30),))
        time.sleep(rng.uniform(*hold))
        conn.execute("COMMIT")
        counts["transactions"] += 1
        time.sleep(rng.uniform(0.0, 0.05))
    conn.close()


def test_concurrent_writers_and_a_long_lock_lose_nothing(sqlite_serve, ckpt, size, figures):
    d = sqlite_serve
    seconds, writers = {"short": (6.0, 3), "long": (120.0, 6)}[size]
    job = f"busy-{size}"
    db = str(d.port_file.parent / "tltd.db")
    stop, counts = threading.Event(), Counter()
    with TltClient(d.target, timeout=120) as c:
        c.create_job(str(ckpt), job_id=job)
        trainer = Trainer(d.target, job, inflight=4, prompts=2, n=4, max_new_tokens=16).start()
        threads = [
            threading.Thread(target=_writer, args=(db, stop, (0.01, 0.2), counts), daemon=True)
            for _ in range(writers)
        ]
        for t in threads:
            t.start()
        time.sleep(seconds / 2)
        # One lock held past the busy timeout: the daemon's writes in that window fail.
        long_hold = SQLITE_BUSY_TIMEOUT_MS / 1000 + 2
        hog = sqlite3.connect(db, timeout=60, isolation_level=None)
        hog.execute("BEGIN IMMEDIATE")
        time.sleep(long_hold)
        hog.execute("COMMIT")
        hog.close()
        time.sleep(seconds / 2)
        stop.set()
        for t in threads:
            t.join(30)
        trainer.stop(timeout=300)
        accounting = account(c, trainer)
        c.cancel_job(job)
    figures.update(
        writers=writers,
        writer_transactions=counts["transactions"],
        long_lock_seconds=long_hold,
        **accounting.figures(),
    )
    assert counts["transactions"] > 10
    assert len(accounting.outcomes) >= 4
    accounting.check_nothing_lost()
