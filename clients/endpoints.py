"""Several daemons behind one client: targets, round-robin, failover with backoff, and the
samples a re-attached stream must not deliver twice."""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from tltd.domain import FinishReason
from tltd_clients.errors import AllEndpointsUnavailableError, TltClientError

log = logging.getLogger("tltd_clients.failover")

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
KEEPALIVE = 30.0  # seconds between pings on an open connection
KEEPALIVE_TIMEOUT = 10.0  # a ping unanswered this long closes the connection (UNAVAILABLE)
# Targets gRPC resolves itself (dns:///host:port, ipv4:a:1,b:2, unix:...): one channel whose
# round_robin policy spreads calls over every address and skips the ones that are down.
_RESOLVER_SCHEMES = ("dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:", "xds:")
_ROUND_ROBIN = json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})
# Codes after which the same call is retried on the next endpoint: the daemon is down,
# unreachable or draining (a retry with the same request id re-attaches, nothing runs twice).
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE})


def is_resolver_target(target: str) -> bool:
    return target.startswith(_RESOLVER_SCHEMES)


def split_targets(target: str | Sequence[str]) -> list[str]:
    """The endpoints a client was given: a list, "host:port,host:port", or one target. A
    resolver target (dns:///..., ipv4:a,b) is one endpoint: gRPC balances inside it."""
    if isinstance(target, str):
        parts = [target] if is_resolver_target(target) else target.split(",")
    else:
        parts = list(target)
    targets = [t.strip() for t in parts if t.strip()]
    if not targets:
        raise ValueError(
            "no endpoint given: pass 'host:port', a list of them or 'dns:///host:port'"
        )
    return targets


def channel_options(target: str, keepalive: float | None = KEEPALIVE) -> list[tuple[str, object]]:
    """Channel options: message sizes; keepalive pings every `keepalive` seconds (None: off)
    so that a stream from a node that vanished without closing its connection (power loss,
    a partition, a frozen process) fails after `keepalive` + KEEPALIVE_TIMEOUT seconds
    instead of hanging; round_robin for resolver targets."""
    options: list[tuple[str, object]] = [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ]
    if keepalive is not None:
        options += [
            ("grpc.keepalive_time_ms", int(keepalive * 1000)),
            ("grpc.keepalive_timeout_ms", int(min(keepalive, KEEPALIVE_TIMEOUT) * 1000)),
            # Keep pinging, at this pace, through a long stream that sends nothing for minutes
            # (gRPC's defaults stop after 2 pings, or space them a minute apart; the daemon
            # allows pings every second: tltd.api.server), and give up on an unanswered ping
            # after the keepalive timeout (gRPC's own ping timeout, a minute, otherwise wins:
            # a frozen node was noticed after 62 s instead of 4).
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.http2.min_time_between_pings_ms", int(keepalive * 1000)),
            ("grpc.http2.ping_timeout_ms", int(min(keepalive, KEEPALIVE_TIMEOUT) * 1000)),
        ]
    if is_resolver_target(target):
        options.append(("grpc.service_config", _ROUND_ROBIN))
    return options


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff between failover attempts, with jitter so that many trainers
    that lost the same node do not all arrive on the next one in step."""

    initial: float = 0.2
    maximum: float = 5.0
    multiplier: float = 2.0
    jitter: float = 0.2  # +- this fraction

    def delay(self, attempt: int) -> float:
        """Seconds to wait before retry number `attempt` (1, 2, ...)."""
        base = min(self.maximum, self.initial * self.multiplier ** max(0, attempt - 1))
        return base * (1 + random.uniform(-self.jitter, self.jitter))


class Rotation:
    """Round-robin over endpoints: each new call starts on the next one, passing over an
    endpoint that failed less than `cooldown` seconds ago (unless every one did)."""

    def __init__(self, count: int, cooldown: float = 5.0) -> None:
        self.count = count
        self.cooldown = cooldown
        self._next = 0
        self._failed_at: dict[int, float] = {}

    def start(self, now: float) -> int:
        index = self._first_up(self._next, now)
        self._next = (index + 1) % self.count
        return index

    def after(self, index: int, now: float) -> int:
        """The endpoint to retry on after `index` failed (recorded as failed now)."""
        self._failed_at[index] = now
        return self._first_up((index + 1) % self.count, now)

    def _first_up(self, index: int, now: float) -> int:
        for step in range(self.count):
            candidate = (index + step) % self.count
            failed = self._failed_at.get(candidate)
            if failed is None or now - failed >= self.cooldown:
                return candidate
        return index  # every endpoint failed lately: try them in turn all the same


@dataclass
class Failover:
    """One call's retries: which endpoint is next, how long to wait, and when to give up.

    `retries` bounds the retries in a row without progress: a stream that delivered new
    samples since its last failure starts counting again (each restart needs progress)."""

    retries: int
    backoff: Backoff
    what: str  # e.g. "Generate request req-1", for the log and the final error
    attempt: int = 0
    errors: dict[str, str] = field(default_factory=dict)

    def progress(self) -> None:
        self.attempt = 0

    def next_delay(self, target: str, err: TltClientError, received: int = 0) -> float:
        """Record a retryable failure on `target`; the wait before the next attempt, or
        AllEndpointsUnavailableError when the retries are spent."""
        self.errors[target] = err.message
        self.attempt += 1
        if self.attempt > self.retries:
            tried = "; ".join(f"{t}: {m}" for t, m in self.errors.items())
            raise AllEndpointsUnavailableError(
                f"{self.what}: every endpoint is unavailable after {self.retries} retries ({tried})"
            )
        delay = self.backoff.delay(self.attempt)
        log.warning(
            "%s failed on %s (%s); retrying in %.1fs (retry %d of %d, %d samples received)",
            self.what,
            target,
            err.message,
            delay,
            self.attempt,
            self.retries,
            received,
        )
        return delay


class Delivered:
    """The samples a caller already has, by (request id, prompt index, sample index): a
    stream re-attached on another endpoint (or re-run there from scratch) delivers each sample
    once (a bounded call's carried samples are other requests').

    A partial sample left by a drain (ABORTED: the tokens so far of a sample a drained node
    handed to another node, streamed to a call with `return_partial`) does not end its
    sample: the complete one that replaces it is delivered too."""

    def __init__(self) -> None:
        self._final: set[tuple[str, int, int]] = set()
        self._aborted: set[tuple[str, int, int]] = set()

    def admit(self, sample) -> bool:
        """True when `sample` is new to the caller (and records it)."""
        key = (sample.request_id, sample.prompt_index, sample.sample_index)
        if key in self._final:
            return False
        if sample.finish_reason == FinishReason.ABORTED:
            if key in self._aborted:
                return False
            self._aborted.add(key)
            return True
        self._final.add(key)
        return True

    def __len__(self) -> int:
        return len(self._final | self._aborted)
