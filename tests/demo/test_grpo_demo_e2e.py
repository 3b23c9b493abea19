"""`examples/grpo_demo.py --quick` end to end: a real `tltd serve`, real rollout workers,
GRPO updates pushed in-band with PushPolicy, both modes, held-out scores, the table, a clean
SIGTERM shutdown."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_quick_demo_runs_both_modes_and_shuts_down_cleanly(grpc_demo):
    out, work = grpc_demo.out, grpc_demo.work
    rows = [line.split() for line in out.splitlines() if line.startswith(("tlt ", "off "))]
    # Each mode's rows printed live, then again in the summary table.
    steps = [["tlt", "0"], ["tlt", "1"], ["off", "0"], ["off", "1"]]
    assert [r[:2] for r in rows] == steps + steps
    for row in rows:
        assert float(row[3]) > 0 and float(row[4]) > 0  # rollout and update seconds
        assert float(row[5]) == pytest.approx(float(row[3]) + float(row[4]), abs=0.02)
        assert int(row[8]) > 0  # tokens
        # Counted from the end: the columns before SD share (length statistics) may change.
        # Step 1's samples come from the policy pushed after step 0 (version 1).
        assert row[-5] == row[1]
        # The measurements' wall time, outside the step: on 2 tiny prompts of a quiet machine
        # the shadow and the sampling law can both take under 5 ms (printed 0.00).
        assert float(row[-3]) >= 0, row
        # The shadow scores the version in service at the step's start: the offline drafter
        # (version 1) or none, never a version promoted during the step.
        if row[0] == "tlt":
            assert row[-8] == "same" if row[-9] == "1" else row[-9] == "0", row
        sd_share = float(row[-11])
        assert 0.0 <= sd_share <= 1.0 if row[0] == "tlt" else sd_share == 0.0, row
    # TLT verified drafts (0.12 measured); with speculative decoding off, none. Per step it may
    # be 0: the measured gate times its costs at worker start, and on a loaded machine it can
    # find plain decoding faster for a 2-prompt step.
    assert max(float(r[-11]) for r in rows if r[0] == "tlt") > 0.0, rows
    assert [r[2] for r in rows[:2]] == ["0.0", "1.0"]  # epochs: the 2 prompts twice
    assert "end-to-end step speedup" in out and "projection, not a measurement" in out
    assert "one run per mode, TLT first" in out
    assert "standard errors over the 2 prompts' mean differences" in out
    for label in ("initial policy", "tlt final policy", "off final policy"):
        assert f"held out ({label})" in out
    assert "tltd exited with status 0 after SIGTERM" in out
    # The asynchronous TLT run: its rows, its comparison with SD off beside the bound, its
    # off-policy tokens reported (step 1 trained on tokens of version 0: staleness 1).
    cells = [line.split("|") for line in out.splitlines() if line.startswith("  ")]
    async_rows = [c for c in cells if len(c) == 8 and c[0].strip().isdigit()]
    assert [int(r[0]) for r in async_rows] == [0, 1], async_rows
    assert int(async_rows[1][5].split("/")[1]) >= 1  # max staleness of step 1's tokens
    assert "asynchronous TLT:" in out and "(measured); bound" in out
    assert "off-policy tokens, not hidden" in out
    assert "held out (async final policy)" in out
    assert (work / "final-async" / "model.safetensors").exists()
    # The weights went in-band: no checkpoint directory per step, the final ones saved.
    for mode in ("tlt", "off"):
        assert not (work / f"ckpt-{mode}").exists()
        assert (work / f"final-{mode}" / "model.safetensors").exists()
