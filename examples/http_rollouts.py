"""The GRPO demo's rollouts over the HTTP door, for trainers that already speak HTTP: samples
come from the official `openai` client (POST /v1/completions, vLLM's token-id extensions) and
new weights go to the SGLang-compatible /update_weights_from_disk. Same seeds, same samples,
same `RolloutSample`s as the gRPC client returns, so the trainer code does not change.

    python examples/grpo_demo.py --quick --http
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import openai

from tltd.domain import FinishReason
from tltd_clients import RolloutSample

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}


class HttpRollouts:
    """Stands in for `RolloutClient` where the demo rolls out and pushes weights; everything
    else (creating the job, watching devices) stays on the gRPC client passed as `raw_client`."""

    def __init__(self, base_url: str, job_id: str, raw_client, token: str = "unused") -> None:
        self.job_id = job_id
        self._grpc = raw_client
        self.raw = raw_client.raw  # job cancel and device listing stay on gRPC
        self.oai = openai.OpenAI(base_url=f"{base_url}/v1", api_key=token, max_retries=0)
        self.http = httpx.Client(base_url=base_url, timeout=600,
                                 headers={"Authorization": f"Bearer {token}"})  # fmt: skip

    def stream(
        self,
        prompts: Sequence[Sequence[int]],
        n: int = 1,
        *,
        temperature: float = 1.0,
        max_new_tokens: int = 256,
        stop_token_ids: Sequence[int] = (),
        seed: int | None = None,
    ) -> Iterator[RolloutSample]:
        """Samples as they finish: one server-sent event per sample."""
        chunks = self.oai.completions.create(
            model=self.job_id,
            prompt=[list(p) for p in prompts],
            n=n,
            max_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed,
            logprobs=0,
            stream=True,
            # ignore_eos: stop exactly where the gRPC call would (stop_token_ids only)
            extra_body={"return_token_ids": True, "stop_token_ids": list(stop_token_ids),
                        "ignore_eos": True},
        )  # fmt: skip
        for chunk in chunks:
            for choice in chunk.choices:
                yield _sample(chunk.id, choice, n)

    def generate(self, prompts, n: int = 1, **kw) -> list[RolloutSample]:
        return sorted(self.stream(prompts, n, **kw), key=lambda s: (s.prompt_index, s.sample_index))

    def update_policy(self, checkpoint_dir: str | Path, *, note: str = "") -> int:
        """SGLang's /update_weights_from_disk on the job's URL; returns the new version."""
        r = self.http.post(
            f"/jobs/{self.job_id}/update_weights_from_disk",
            json={"model_path": str(Path(checkpoint_dir).resolve()), "weight_version": note},
        )
        r.raise_for_status()
        return int(r.json()["weight_version"])

    def close(self) -> None:
        self.oai.close()
        self.http.close()
        self._grpc.close()


def _sample(request_id: str, choice, n: int) -> RolloutSample:
    extra = choice.model_extra or {}
    stats = extra.get("tltd", {})
    return RolloutSample(
        request_id=request_id,
        prompt_index=choice.index // n,
        sample_index=choice.index % n,
        token_ids=list(extra["token_ids"]),
        logprobs=list(choice.logprobs.token_logprobs),
        finish_reason=_FINISH.get(choice.finish_reason, FinishReason.ABORTED),
        policy_version=stats.get("policy_version", 0),
        drafter_version=stats.get("drafter_version", 0),
        draft_steps=stats.get("draft_steps", 0),
        plain_steps=stats.get("plain_steps", 0),
        accepted_tokens=stats.get("accepted_tokens", 0),
        drafted_tokens=stats.get("drafted_tokens", 0),
        partial=stats.get("partial", False),
    )
