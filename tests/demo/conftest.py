"""Fixtures for the demo tests: one `examples/grpo_demo.py --quick` run over gRPC, shared by
the test that checks that run and the test that compares an HTTP run with it (a demo run costs
a daemon, its workers and both modes' steps)."""

from __future__ import annotations

from pathlib import Path

import pytest

from examples.task.tokenizer import VOCAB_SIZE, save_tokenizer
from tests.demo.support import DemoRun, run_demo
from tests.engine.helpers import make_checkpoint


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory) -> Path:
    # A tiny random policy keeps the demo fast; its logic does not depend on its quality.
    # Peaked logits make its sampled answers repeat spans, so that the model-free drafter has
    # drafts from step 0 (a flat random policy gives it next to none: SD share ~0.01).
    model = make_checkpoint(
        tmp_path_factory.mktemp("demo-model") / "policy",
        vocab=VOCAB_SIZE, hidden=32, tie=False, seed=1, logit_scale=8.0,
    )  # fmt: skip
    save_tokenizer(model)
    return model


@pytest.fixture(scope="session")
def grpc_demo(tmp_path_factory, demo_model) -> DemoRun:
    """The demo's gRPC run (weights pushed in-band)."""
    return run_demo(demo_model, tmp_path_factory.mktemp("demo-grpc") / "work")
