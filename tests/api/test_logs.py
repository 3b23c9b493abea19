"""Structured log lines: key=value by default, JSON with --log-json, extras as fields."""

from __future__ import annotations

import io
import json
import logging

import pytest

from tltd.errors import ConfigError
from tltd.logs import configure_logging


@pytest.fixture
def restore_root_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_key_value_lines(restore_root_logging):
    buf = io.StringIO()
    configure_logging("INFO", json_lines=False, stream=buf)
    log = logging.getLogger("tltd.test")
    log.info("tltd serving", extra={"address": "127.0.0.1:5", "devices": 2})
    log.debug("hidden")
    line = buf.getvalue().strip()
    assert 'msg="tltd serving"' in line and "address=127.0.0.1:5" in line and "devices=2" in line
    assert "level=info" in line and "logger=tltd.test" in line and "hidden" not in line


def test_json_lines_with_traceback(restore_root_logging):
    buf = io.StringIO()
    configure_logging("debug", json_lines=True, stream=buf)
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("tltd.test").exception("failed", extra={"method": "/x/Y"})
    record = json.loads(buf.getvalue())
    assert record["msg"] == "failed" and record["method"] == "/x/Y" and record["level"] == "error"
    assert "ValueError: boom" in record["exc"]


def test_unknown_level_is_a_config_error(restore_root_logging):
    with pytest.raises(ConfigError, match="log level"):
        configure_logging("LOUD")
