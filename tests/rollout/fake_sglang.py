"""A fake SGLang engine behind the worker's engine port: the one fake of the sglang backend
(sglang cannot be installed or run on these machines).

It answers as `sglang.Engine` does through `workers.sglang.real_engine.SglangEngineAdapter`: output
dicts with `output_ids`, `meta_info.output_token_logprobs` [(logprob, id, None)],
`finish_reason` {"type": "stop"|"length"|"abort", ...}, `completion_tokens`, and with a
speculative algorithm `spec_verify_ct` (EAGLE also `spec_num_correct_drafts`). It refuses
what SGLang refuses: a model path without config.json, an EAGLE draft path that is not an
EAGLE checkpoint, sampling params that SGLang's `SamplingParams.verify` rejects.

Generation is deterministic: the next token is a function of the context (prompt + output so
far), so a sample carried over an engine restart continues exactly as it would have; every
poll advances each live generation by `tokens_per_poll` tokens.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from workers.sglang.adapter import WeightUpdate

VOCAB = 50
LOG_ENV = "TLTD_FAKE_SGLANG_LOG"  # a JSONL file the fake appends its calls to (process tests)


def next_token(context: list[int]) -> int:
    tail = context[-4:]
    return (sum((i + 1) * t for i, t in enumerate(tail)) * 7 + len(context)) % VOCAB


def token_logprob(context: list[int], token: int) -> float:
    return -0.05 - ((token + len(context)) % 9) / 4


def reference(prompt: list[int], max_new: int, stop: tuple[int, ...] = ()) -> list[int]:
    """What the fake generates for `prompt` from scratch."""
    out: list[int] = []
    while len(out) < max_new:
        out.append(next_token(prompt + out))
        if out[-1] in stop:
            break
    return out


@dataclass
class _Gen:
    input_ids: list[int]
    params: dict[str, Any]
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    aborted: bool = False


class FakeEngine:
    """`workers.sglang.adapter.SglangEngine`, answering as SGLang would (see the module)."""

    instances: ClassVar[list[FakeEngine]] = []  # every engine built, in order
    refuse_eagle: ClassVar[bool] = False  # an EAGLE engine fails to start (out of memory)
    in_place_draft: ClassVar[bool] = False  # the TLT fork's draft-weight update
    tokens_per_poll: ClassVar[int] = 3

    def __init__(self, args: dict[str, Any]) -> None:
        if not (Path(args["model_path"]) / "config.json").is_file():
            raise OSError(f"no config.json in {args['model_path']}")
        algo = args.get("speculative_algorithm")
        if algo == "EAGLE":
            draft = str(args["speculative_draft_model_path"])
            cfg = json.loads((Path(draft) / "config.json").read_text())
            if not cfg["architectures"][0].endswith("ForCausalLMEagle"):
                raise ValueError(f"{draft} is not an EAGLE checkpoint")
            if self.refuse_eagle:
                raise RuntimeError("CUDA out of memory (fake)")
        self.args = dict(args)
        self.submitted: list[tuple[str, list[int], dict[str, Any]]] = []
        self.aborted: list[str] = []
        self.updates: list[WeightUpdate] = []
        self.live: dict[str, _Gen] = {}
        self.closed = False
        FakeEngine.instances.append(self)
        self._log("start", args=args)

    def _log(self, event: str, **data: Any) -> None:
        path = os.environ.get(LOG_ENV)
        if path:
            with open(path, "a") as f:
                f.write(json.dumps({"event": event, **data}) + "\n")

    # -- the port -------------------------------------------------------------------------

    def submit(self, rid: str, input_ids, sampling_params: dict[str, Any]) -> None:
        assert not self.closed
        p = sampling_params
        if not (p["top_k"] == -1 or p["top_k"] >= 1) or not 0 < p["top_p"] <= 1:
            raise ValueError(f"bad sampling params {p}")
        assert p["n"] == 1 and p["max_new_tokens"] > 0
        self.submitted.append((rid, list(input_ids), dict(p)))
        self.live[rid] = _Gen(list(input_ids), dict(p))
        self._log("submit", rid=rid, input_ids=list(input_ids), params=p)

    def poll(self, timeout: float) -> list[tuple[str, dict[str, Any]]]:
        assert not self.closed
        time.sleep(min(timeout, 0.002))  # as SGLang's loop would wait a little
        done = []
        for rid, g in list(self.live.items()):
            if g.aborted:
                done.append((rid, self._output(rid, g, {"type": "abort", "message": "Abort"})))
                continue
            reason = None
            stop = set(g.params.get("stop_token_ids") or ())
            for _ in range(self.tokens_per_poll):
                ctx = g.input_ids + g.out
                tok = next_token(ctx)
                g.out.append(tok)
                g.logprobs.append(token_logprob(ctx, tok))
                if tok in stop:
                    reason = {"type": "stop", "matched": tok}
                    break
                if len(g.out) >= g.params["max_new_tokens"]:
                    reason = {"type": "length", "length": len(g.out)}
                    break
            if reason is not None:
                done.append((rid, self._output(rid, g, reason)))
        for rid, _ in done:
            del self.live[rid]
        return done

    def _output(self, rid: str, g: _Gen, reason: dict[str, Any]) -> dict[str, Any]:
        n = len(g.out)
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": reason,
            "prompt_tokens": len(g.input_ids),
            "completion_tokens": n,
            "output_token_logprobs": [
                (lp, t, None) for lp, t in zip(g.logprobs, g.out, strict=True)
            ],
        }
        algo = self.args.get("speculative_algorithm")
        if algo and n > 1:
            verify = (n - 1 + 1) // 2  # each verify pass gains 2 tokens (1 accepted + bonus)
            meta["spec_verify_ct"] = verify
            if algo == "EAGLE":  # NGRAM answers without it: the worker derives it
                meta["spec_num_correct_drafts"] = n - 1 - verify
        return {"output_ids": list(g.out), "meta_info": meta}

    def abort(self, rid: str) -> None:
        self.aborted.append(rid)
        self._log("abort", rid=rid)
        if rid in self.live:
            self.live[rid].aborted = True

    def update_weights(self, update: WeightUpdate) -> bool:
        if not (Path(update.path) / "config.json").is_file():
            raise RuntimeError(f"update_weights_from_disk({update.path}) failed: no checkpoint")
        self._log("update_weights", path=update.path, selector=update.selector)
        if update.selector == "draft" and not self.in_place_draft:
            return False
        self.updates.append(update)
        return True

    def shutdown(self) -> None:
        self.closed = True
        self.live.clear()
        self._log("shutdown")


def factory(args: dict[str, Any]) -> FakeEngine:
    """The `EngineFactory` the tests name on the worker's command line."""
    return FakeEngine(args)
