"""Structured logging: key=value lines by default, JSON lines with --log-json; extras are fields."""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import IO, Any

from tltd.errors import ConfigError

# Attributes every LogRecord has; anything else on a record came from `extra=` and is a field.
_RESERVED = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    out: dict[str, Any] = {
        "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
        "level": record.levelname.lower(),
        "logger": record.name,
        "msg": record.getMessage(),
    }
    out.update({k: v for k, v in vars(record).items() if k not in _RESERVED})
    return out


def _kv(value: Any) -> str:
    text = str(value)
    if not text or any(c in text for c in ' "=\n\t'):
        return json.dumps(text)
    return text


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = " ".join(f"{k}={_kv(v)}" for k, v in _fields(record).items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = _fields(record)
        if record.exc_info:
            fields["exc"] = self.formatException(record.exc_info)
        return json.dumps(fields, default=str)


def configure_logging(
    level: str = "INFO", json_lines: bool = False, stream: IO[str] | None = None
) -> None:
    """Replace the root handlers with one stderr handler in the chosen format."""
    if level.upper() not in logging.getLevelNamesMapping():
        raise ConfigError(f"unknown log level {level!r} (DEBUG, INFO, WARNING, ERROR)")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if json_lines else KeyValueFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # APScheduler logs every run, Alembic every plugin it loads, at INFO: noise, not news.
    for noisy in ("apscheduler", "alembic.runtime.plugins"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
