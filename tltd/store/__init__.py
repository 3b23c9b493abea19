"""Persistence: the Store, repositories over one SQL database (SQLite or PostgreSQL), and its
Alembic migrations."""

from __future__ import annotations

from tltd.store.rollout_requests import JobPaused
from tltd.store.store import Store

__all__ = ["JobPaused", "Store"]
