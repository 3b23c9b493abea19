"""The supervisor's ticker ends when it is cancelled, also when the cancel comes as a kick
fires (a stop kicks and cancels in one go). On Python 3.11 `asyncio.wait_for` returned the
kick and swallowed that cancel: the ticker ran one more tick after the workers had stopped,
and a daemon's stop could wait on it for ever."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.api.support import make_settings
from tltd.store import Store
from tltd.supervisor import Supervisor


def test_a_cancel_that_comes_with_a_kick_ends_the_ticker(sqlite_store: Store, tmp_path: Path):
    sup = Supervisor(sqlite_store, make_settings(tmp_path, scheduler_tick_seconds=30.0))
    ticks = []

    async def tick():
        ticks.append(1)

    sup.tick = tick  # type: ignore[method-assign]

    async def scenario() -> str:
        sup._kick = asyncio.Event()
        ticker = asyncio.create_task(sup._ticker())
        await asyncio.sleep(0.05)  # waiting for a kick
        sup.kick()
        ticker.cancel()
        done, _ = await asyncio.wait({ticker}, timeout=5)
        if not done:
            ticker.cancel()
            return "still ticking"
        return "cancelled" if ticker.cancelled() else "ended"

    assert asyncio.run(scenario()) == "cancelled"
    assert ticks == []
