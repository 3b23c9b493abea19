"""Python client library for tltd and the `tltctl` operator command."""

from tltd_clients.client import TltClient
from tltd_clients.endpoints import Backoff
from tltd_clients.errors import AllEndpointsUnavailableError, TltClientError
from tltd_clients.rollout import (
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
