"""Python client library for tltd and the `tltctl` operator command."""

from clients.client import TltClient
from clients.endpoints import Backoff
from clients.errors import AllEndpointsUnavailableError, TltClientError
from clients.rollout import (
    AsyncRolloutClient,
    JobInfo,
    RolloutClient,
    RolloutSample,
    SamplingParams,
    by_prompt,
)

__all__ = [
    "AllEndpointsUnavailableError",
    "AsyncRolloutClient",
    "Backoff",
    "JobInfo",
    "RolloutClient",
    "RolloutSample",
    "SamplingParams",
    "TltClient",
    "TltClientError",
    "by_prompt",
]
