"""Admission and placement: prompts wait FIFO, join the running batch at a step boundary when
all their samples fit, and each sample gets a cache slot (the prompt's KV forked into it)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Sequence

from tltd.contract.lengths import new_token_cap
from tltd.domain import FinishReason, Sample, SamplingParams
from tltd_workers.engine.datatypes import EngineConfig, SampleOutput
from tltd_workers.engine.gate import GateState
from tltd_workers.engine.history import HistoryDrafter
from tltd_workers.engine.kv_cache import KVCache
from tltd_workers.engine.ngram import NgramDrafter
from tltd_workers.engine.rows import Group, Seq
from tltd_workers.engine.sampling import row_key


class Admission:
    """The waiting prompts and their way into the running batch (`running[i]` in slot i).

    `ngram`: None when no n-gram arm is configured; `history`: None without a history arm.
    """

    def __init__(
        self,
        config: EngineConfig,
        vocab_size: int,
        running: list[Seq],
        cache: KVCache,
        ngram: NgramDrafter | None,
        history: HistoryDrafter | None,
        gate_state: GateState | None,
    ) -> None:
        self.config = config
        self.vocab_size = vocab_size
        self.running = running
        self.cache = cache
        self.ngram = ngram
        self.history = history
        self.gate_state = gate_state
        self.waiting: deque[Group] = deque()
        self._next_seed = config.seed
        self._groups_added = 0

    def add(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        prompt_index: int,
        return_hidden: bool,
        speculative: bool,
        sample_offset: int,
        past: Sequence[tuple[Hashable, Sequence[int]]],
        policy_version: int,
        resume: Sample | None = None,
        pause_after: int = 0,
        cache_key: str = "",
        share_key: str = "",
    ) -> None:
        """Check one prompt's request and queue it (Engine.add_request says what each means)."""
        prompt = [int(t) for t in prompt_ids]
        check_request(prompt, sampling, sample_offset, self.config, self.vocab_size)
        if resume is not None:
            check_resume(prompt, sampling, resume, self.config)
        wanted = set(range(sample_offset, sample_offset + sampling.n))
        if dup := wanted & self.live_samples(request_id, prompt_index):
            raise ValueError(
                f"request {request_id!r} prompt {prompt_index}: samples {sorted(dup)} are "
                "already queued"
            )
        # Unique per add: a sample that finished may run again (a retry) while its siblings,
        # added with it, still run under the old group.
        group_key = f"{request_id}\x00{prompt_index}\x00{sample_offset}\x00{self._groups_added}"
        self._groups_added += 1
        seed = sampling.seed
        if seed is None:
            seed, self._next_seed = self._next_seed, self._next_seed + 1_000_003
        group = Group(
            request_id,
            prompt_index,
            prompt,
            sampling,
            seed,
            return_hidden,
            speculative,
            policy_version,
            group_key,
            sample_offset=sample_offset,
            past=past,
            restore=resume,
            pause_after=max(0, pause_after),
            cache_key=cache_key,
            share_key=share_key,
        )
        self.waiting.append(group)

    def live_samples(self, request_id: str, prompt_index: int) -> set[int]:
        """Sample indices of this prompt that are waiting or running."""
        live = {
            s.index
            for s in self.running
            if s.group.request_id == request_id and s.group.prompt_index == prompt_index
        }
        for g in self.waiting:
            if g.request_id == request_id and g.prompt_index == prompt_index:
                live.update(range(g.sample_offset, g.sample_offset + g.sampling.n))
        return live

    def cancel(self, request_id: str) -> list[SampleOutput]:
        """Drop the request's waiting prompts; their samples' outputs (CANCELLED, no tokens)."""
        out: list[SampleOutput] = []
        for g in [g for g in self.waiting if g.request_id == request_id]:
            self.waiting.remove(g)
            for i in range(g.sampling.n):
                out.append(
                    SampleOutput(
                        request_id,
                        g.prompt_index,
                        g.sample_offset + i,
                        [],
                        [],
                        FinishReason.CANCELLED,
                        g.policy_version,
                        top_logprobs=[] if g.sampling.top_logprobs > 0 else None,
                    )
                )
        return out

    def schedule(self, waits: Callable[[str], bool] = lambda key: False) -> list[Group]:
        """FIFO admission of whole prompts (all n samples) while slots and the budget allow.
        A prompt whose share key an admitted one has stops it when `waits(key)`: the next
        step it reuses that one's prefill instead of computing it alongside."""
        free = self.config.max_batch - len(self.running)
        admitted: list[Group] = []
        width = 0
        sharing: set[str] = set()
        while self.waiting and self.waiting[0].sampling.n <= free:
            g = self.waiting[0]
            w = max(width, len(g.prompt))
            if admitted and w * (len(admitted) + 1) > self.config.max_prefill_tokens:
                break
            if g.share_key in sharing and waits(g.share_key):
                break
            if g.share_key:
                sharing.add(g.share_key)
            admitted.append(self.waiting.popleft())
            free -= g.sampling.n
            width = w
        return admitted

    def place(
        self,
        groups: list[Group],
        b0: int,
        lens: list[int],
        eagle: bool,
        drafter_cache: KVCache | None = None,
    ) -> tuple[list[Seq], list[int]]:
        """Give the prefilled prompts their n slots each; returns the new rows and their group.

        Leaders (sample 0 of each group) sit in the prefilled slots [b0, b0 + G); the other
        samples follow group by group, their KV copied from the leader (the target's, and the
        EAGLE drafter's prompt rows in `drafter_cache`). `eagle`: an EAGLE drafter is set (the
        new rows keep hidden states for it).
        """
        leaders: list[Seq] = []
        followers: list[Seq] = []
        nxt = b0 + len(groups)
        for i, g in enumerate(groups):
            self.cache.lens[b0 + i] = lens[i]
            self.cache.fork(b0 + i, nxt, nxt + g.sampling.n - 1)
            if drafter_cache is not None:
                drafter_cache.fork(b0 + i, nxt, nxt + g.sampling.n - 1)
            nxt += g.sampling.n - 1
            self._open(g)
            g.live = g.sampling.n
            rows = self._rows(g, eagle)
            leaders.append(rows[0])
            followers.extend(rows[1:])
        self.running.extend(leaders + followers)
        order = list(range(len(groups))) + [
            i for i, g in enumerate(groups) for _ in range(g.sampling.n - 1)
        ]
        return leaders + followers, order

    def _open(self, g: Group) -> None:
        """The prompt joins the drafters' corpora."""
        if self.ngram is not None:
            self.ngram.add_group(g.group_key, g.prompt)
        if self.history is not None:
            g.history_key = self.history.open(g.prompt, g.past)
            g.past = ()  # held by the drafter now (or dropped by its bound)
            if self.gate_state is not None and self.history.mean_length(g.history_key):
                self.gate_state.history_arrived()

    def _rows(self, g: Group, eagle: bool) -> list[Seq]:
        """The group's n samples, each registered with the drafters."""
        max_new = new_token_cap(g.sampling.max_new_tokens, len(g.prompt), self.config.max_seq_len)
        rows: list[Seq] = []
        for j in range(g.sampling.n):
            idx = g.sample_offset + j
            s = Seq(g, idx, row_key(g.seed, g.prompt_index, idx), max_new)
            s.eagle_ok = eagle
            if s.eagle_ok and s.history is None:
                s.history = []  # lets a later drafter version catch up on this sample
            if g.restore is not None:
                restore(s, g.restore)
            if g.pause_after and len(s.tokens) + g.pause_after < s.max_new:
                s.max_new, s.pauses = len(s.tokens) + g.pause_after, True
            if self.ngram is not None:
                self.ngram.add_sequence(g.group_key, s.sample_key)
                self.ngram.extend(g.group_key, s.sample_key, list(s.tokens))
            if self.history is not None:
                s.answer_id = self.history.start(g.history_key, (g.request_id, g.prompt_index, idx))
                self.history.extend(g.history_key, s.answer_id, list(s.tokens))
            rows.append(s)
        return rows


def restore(s: Seq, stored: Sample) -> None:
    """A resumed sample takes back what it had emitted: its tokens, their logprobs and
    per-token versions (a new span opens where this engine's version differs), its counters,
    and the provenance and top alternatives it was asked for. Its next token, drawn from the
    resume's prefill as a plain draw, counts as a plain step (a sample's first token is the
    only one in no step count)."""
    s.tokens = list(stored.token_ids)
    s.logprobs = list(stored.logprobs)
    spans = list(stored.policy_spans) or [(0, stored.policy_version)]
    if spans[-1][1] != s.group.policy_version:
        spans.append((len(s.tokens), s.group.policy_version))
    s.spans = spans
    st = stored.speculative
    s.draft_steps, s.accepted = st.draft_steps, st.accepted_tokens
    s.plain_steps = st.plain_steps + 1
    s.drafted, s.bonus, s.residual = st.drafted_tokens, st.bonus_tokens, st.residual_tokens
    s.drafter_version = stored.drafter_version
    if s.provenance is not None:
        s.provenance = list(stored.provenance or ())
    if s.top is not None:
        s.top = list(stored.top_logprobs or ())


def check_resume(
    prompt: list[int], sampling: SamplingParams, stored: Sample, cfg: EngineConfig
) -> None:
    """Raise ValueError for a sample that cannot be resumed as given: one sample, unfinished
    (no stop token, fewer tokens than max_new_tokens), whose tokens fit the sequence."""
    tokens = list(stored.token_ids)
    if sampling.n != 1:
        raise ValueError("a resumed sample is added alone (sampling.n = 1)")
    if len(stored.logprobs) != len(tokens):
        raise ValueError("a resumed sample needs one logprob per token")
    if len(tokens) >= sampling.max_new_tokens or set(tokens) & set(sampling.stop_token_ids):
        raise ValueError("a resumed sample must be unfinished (no stop token, < max_new_tokens)")
    if len(prompt) + len(tokens) >= cfg.max_seq_len:
        raise ValueError(f"prompt + resumed tokens >= max_seq_len {cfg.max_seq_len}")


def check_request(
    prompt: list[int], sampling: SamplingParams, sample_offset: int, cfg: EngineConfig, vocab: int
) -> None:
    """Raise ValueError for a request the engine cannot run as given."""
    if not prompt:
        raise ValueError("prompt_ids is empty")
    if min(prompt) < 0 or max(prompt) >= vocab:
        raise ValueError(f"prompt_ids must be in [0, {vocab})")
    if len(prompt) >= cfg.max_seq_len:
        raise ValueError(f"prompt of {len(prompt)} tokens >= max_seq_len {cfg.max_seq_len}")
    if not 1 <= sampling.n <= cfg.max_batch:
        raise ValueError(f"sampling.n must be in [1, max_batch={cfg.max_batch}]")
    if sampling.max_new_tokens < 1:
        raise ValueError("sampling.max_new_tokens must be >= 1")
    if not 0.0 < sampling.top_p <= 1.0 or sampling.top_k < 0 or sampling.temperature < 0:
        raise ValueError("need 0 < top_p <= 1, top_k >= 0, temperature >= 0")
    if sample_offset < 0:
        raise ValueError("sample_offset must be >= 0")
