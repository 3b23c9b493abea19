"""Row <-> domain conversions: every field of a domain object survives its row, with no field
left at a non-default value (so a field the converter drops shows up as a difference)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from tltd import domain as d
from tltd.store import convert
from tltd.store.tables import JobRow

NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)

JOB = d.Job(
    "job-1",
    "/models/m",
    name="n",
    backend=d.Backend.SGLANG,
    priority=3,
    weight=2.5,
    speculative=d.SpeculativeConfig(d.SpeculativeMode.OFF, 7, (3, 5), "eagle", False, "/init"),
    status=d.JobStatus.CANCELLED,
    status_reason="why",
    policy_version=4,
    drafter_version=9,
    created_at=NOW,
    updated_at=NOW,
    policy_switch=d.PolicySwitch.NEXT_STEP,
)


def _sample(token_ids: tuple[int, ...]) -> d.Sample:
    top = d.TopLogprobs((1, 2), (-0.1, float("-inf")))
    return d.Sample(
        "req-1",
        1,
        2,
        token_ids,
        (-0.5, -1.5),
        d.FinishReason.LENGTH,
        policy_version=3,
        drafter_version=4,
        speculative=d.SpeculativeStats(1, 2, 3, 4.5, 5, 6, 7),
        partial=True,
        error="err",
        provenance=(d.TokenProvenance(d.TokenSource.ACCEPTED, "eagle", 3),) * 2,
        policy_spans=((0, 3),),
        top_logprobs=(top, top),
        prompt_logprobs=d.PromptLogprobs((-1.0,), (2,), (top,)),
    )


def test_a_job_survives_its_row():
    row = convert.job_to_row(JOB)
    row.created_at = row.updated_at = NOW  # the store sets them
    assert convert.job_from_row(row, drafter_version=9) == JOB


def test_a_job_updates_its_existing_row():
    row = JobRow(job_id=JOB.job_id)
    assert convert.job_to_row(JOB, row) is row
    assert (row.spec_mode, row.spec_draft_lengths, row.backend) == ("off", [3, 5], "sglang")


@pytest.mark.parametrize("seed", [None, 0, 2**63, 2**64 - 1])
def test_a_request_survives_its_row(seed):
    sampling = d.SamplingParams(3, 0.5, 0.9, 4, 17, (7, 8), seed, d.LogprobMode.RAW, True, 3, 2)
    req = d.RolloutRequest(
        "req-1",
        "job-1",
        ((1, 2), (3,)),
        sampling,
        speculative=d.SpeculativeMode.OFF,
        status=d.RequestStatus.RUNNING,
        status_reason="x",
        samples_done=2,
        created_at=NOW,
        updated_at=NOW,
        policy_version=3,
    )
    row = convert.request_to_row(req)
    row.created_at = row.updated_at = NOW
    assert convert.request_from_row(row) == req


@pytest.mark.parametrize("token_ids", [(1, 2), (1, 2**40)], ids=["packed", "json"])
def test_a_sample_survives_its_row(token_ids):
    sample = _sample(token_ids)
    row = convert.sample_to_row(sample)
    assert row.spec_residual_tokens == 7 and row.num_tokens == 2
    assert convert.sample_from_row(row) == sample


def test_a_drafter_version_survives_its_row_but_its_pin_and_activity_do_not():
    dv = d.DrafterVersion(
        "job-1", 0, 2, "/p", 10, 0.5, 2.5, d.DrafterStatus.PROMOTED, True, True, NOW, "n1", True
    )
    row = convert.drafter_to_row(dv, version=8)
    row.created_at = NOW
    assert row.pinned is False  # pinning goes through store.drafters.pin only
    back = convert.drafter_from_row(row, active_version=8)
    assert back == d.DrafterVersion(**{**vars(dv), "version": 8, "pinned": False})
    assert convert.drafter_from_row(row, active_version=7).active is False


def test_a_field_with_no_column_fails_loudly():
    class Row:  # a row lacking the `note` column
        job_id, version, source, path, created_at = "j", 1, "push", "/p", NOW

    with pytest.raises(AttributeError, match="note"):
        convert.policy_version_from_row(Row())  # type: ignore[arg-type]
