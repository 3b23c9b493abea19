"""Python client library for tltd and the `tltctl` operator command."""

from clients.client import TltClient
from clients.errors import TltClientError
from clients.rollout import (
    AsyncRolloutClient,
    JobInfo,
    RolloutClient,
    RolloutSample,
    SamplingParams,
    by_prompt,
)

__all__ = [
    "AsyncRolloutClient",
    "JobInfo",
    "RolloutClient",
    "RolloutSample",
    "SamplingParams",
    "TltClient",
    "TltClientError",
    "by_prompt",
]
