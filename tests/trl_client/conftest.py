"""TRL's own VLLMClient against a real daemon (`make test-trl`): the client runs in its own
cached environment (scripts/trl_client_env.sh; trl with the CPU torch), whose python the make
target passes as TLTD_TRL_PYTHON. The normal suite does not collect these tests; where they
are collected, a missing environment is an error, never a skip."""

from __future__ import annotations

import os

from tests.http_api.conftest import http_daemon, text_model  # noqa: F401 - the fixtures

if not os.environ.get("TLTD_TRL_PYTHON"):
    collect_ignore_glob = ["test_*.py"]
