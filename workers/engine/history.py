"""History drafter: per prompt, a suffix index over its earlier samples and its live siblings.

RL revisits every prompt once per epoch, and the answers to one prompt repeat long spans
across epochs and across the n samples of one request. This drafter keeps, per prompt (keyed
by its token ids), the continuation counts of every context of a few lengths over all the
answers it has seen: the samples loaded from the store when the prompt was admitted (earlier
epochs, earlier requests, other nodes), the samples this engine finished, and the siblings
still decoding. A context of length L is the suffix of (prompt + answer) ending before a
token; `counts[L][context] = {next token: occurrences}`. This is the information of a suffix
tree cut at the depths in `MATCH_LENGTHS` (SuffixDecoding, Oliaro et al. 2024, keeps a
depth-limited suffix tree over earlier outputs and expands it by frequency): each proposed
token costs one dictionary look-up of the longest matching context, no forward pass.

A proposal walks greedily: at each position the longest context that has been seen before
picks its most frequent continuation (ties: the most recently seen one, so newer samples,
of newer policy versions, win), and the walk stops where the product of the chosen
continuations' empirical frequencies falls below `min_support`, at MAX_SPEC_FACTOR times the
length of the first match, or at k. A long, frequent
match gives a long draft; a rare or contested one a short draft or none. Drafts are
deterministic (q is one-hot), so the accept rule keeps the output exactly the target's,
whatever the history holds (samples of older policy versions included).

Memory is bounded per engine (one engine serves one job on one worker): at most
`max_tokens` answer tokens over all prompts, least-recently used prompts dropped first
(prompts with live samples are never dropped), and per prompt the oldest answers dropped
past `max_prompt_tokens`. Each answer token adds at most len(MATCH_LENGTHS) counter entries.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

# Context lengths indexed, longest first on look-up. Tokens are characters in the project's
# task: 4 reaches back within a line, 32 across a line and a half (which step of the
# computation this is).
MATCH_LENGTHS = (32, 16, 8, 4)
DEFAULT_MAX_TOKENS = 1 << 18  # answer tokens held per engine (<= 4 counter entries each)
DEFAULT_MAX_PROMPT_TOKENS = 1 << 16  # answer tokens held per prompt
DEFAULT_MIN_SUPPORT = 0.25  # stop drafting where the walk's empirical probability is below
# A draft is at most this many times as long as the context it was matched on: a match of a
# few tokens says less about what follows than one of a whole line (SuffixDecoding's rule).
MAX_SPEC_FACTOR = 2
# Contexts are keyed by a polynomial rolling hash over the prompt's tail and the answer (one
# prefix hash per token), so counting a token costs O(1) per context length rather than
# hashing a tuple of up to 32 tokens; a collision only spoils a draft.
_MOD = (1 << 61) - 1
_BASE = 1_000_003
_POW = [1]
for _ in range(max(MATCH_LENGTHS)):
    _POW.append(_POW[-1] * _BASE % _MOD)


def _push(prefix: array, token: int) -> None:
    """Extend prefix hashes by one token."""
    prefix.append((prefix[-1] * _BASE + token + 1) % _MOD)


def _window(prefix: array, end: int, m: int) -> int:
    """Hash of the m tokens before position `end` (prefix[end] covers the first `end`)."""
    return (prefix[end] - prefix[end - m] * _POW[m]) % _MOD


@dataclass
class _Prompt:
    """One prompt's answers and the continuation counts over them."""

    head: tuple[int, ...]  # the prompt's last max(MATCH_LENGTHS) tokens: every answer's context
    answers: OrderedDict[int, list[int]] = field(default_factory=OrderedDict)  # oldest first
    # answer id -> prefix hashes of head + answer (len(head) + len(answer) + 1 entries)
    # (8-byte integers: a list of Python ints would double the drafter's memory per token)
    prefixes: dict[int, array] = field(default_factory=dict)
    head_prefix: array = field(default_factory=lambda: array("q"))
    tokens: int = 0  # answer tokens held
    done: int = 0  # finished answers held ...
    done_tokens: int = 0  # ... and their tokens: the prompt's mean answer length
    live: set[int] = field(default_factory=set)  # answers still decoding: never dropped
    seen: set[Hashable] = field(default_factory=set)  # sample ids added (store loads skip them)
    # context length -> hash(context) -> {next token: occurrences}, in order of last count.
    # A hash, not the tuple, keeps an entry small; a collision only spoils a draft.
    counts: dict[int, dict[int, dict[int, int]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.counts = {m: {} for m in MATCH_LENGTHS}
        self.head_prefix = array("q", [0])
        for t in self.head:
            _push(self.head_prefix, t)


class HistoryDrafter:
    """Per-prompt history of answers; proposes the best-supported continuation (module doc)."""

    def __init__(
        self,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
        min_support: float = DEFAULT_MIN_SUPPORT,
    ) -> None:
        if max_prompt_tokens < 1 or max_tokens < max_prompt_tokens:
            raise ValueError("need 1 <= max_prompt_tokens <= max_tokens")
        if not 0.0 <= min_support <= 1.0:
            raise ValueError(f"min_support must be in [0, 1], got {min_support}")
        self.max_tokens = max_tokens
        self.max_prompt_tokens = max_prompt_tokens
        self.min_support = min_support
        self._prompts: OrderedDict[tuple[int, ...], _Prompt] = OrderedDict()  # LRU last
        self._tokens = 0
        self._next_id = 0

    # -- lifecycle -----------------------------------------------------------------------

    def open(
        self, prompt: Sequence[int], past: Iterable[tuple[Hashable, Sequence[int]]] = ()
    ) -> tuple[int, ...]:
        """Use a prompt (most recently used now) and add the `past` answers (sample id, tokens;
        oldest first, e.g. read from the store) it has not seen yet. Returns its key."""
        key = tuple(int(t) for t in prompt)
        p = self._prompts.get(key)
        if p is None:
            p = self._prompts[key] = _Prompt(key[-max(MATCH_LENGTHS) :])
        self._prompts.move_to_end(key)
        for sample_id, answer in past:
            if sample_id not in p.seen:
                self.add_answer(key, answer, sample_id)
        return key

    def start(self, key: tuple[int, ...], sample_id: Hashable = None) -> int:
        """A sample of the prompt starts decoding: returns its answer id (empty answer).
        `sample_id` names it, so that the same sample read back from the store is not added
        twice."""
        p = self._prompts[key]
        if sample_id is not None:
            p.seen.add(sample_id)
        answer_id = self._next_id
        self._next_id += 1
        p.answers[answer_id] = []
        p.prefixes[answer_id] = array("q", p.head_prefix)
        p.live.add(answer_id)
        return answer_id

    def extend(self, key: tuple[int, ...], answer_id: int, tokens: Sequence[int]) -> None:
        """Tokens a live sample emitted: counted as continuations of the contexts before them."""
        p = self._prompts.get(key)
        if p is None or answer_id not in p.answers:
            return  # its oldest answers were dropped for room: nothing to extend
        answer, prefix = p.answers[answer_id], p.prefixes[answer_id]
        for t in tokens:
            self._count(p, prefix, len(prefix) - 1, int(t), +1)
            answer.append(int(t))
            _push(prefix, int(t))
        p.tokens += len(tokens)
        self._tokens += len(tokens)
        self._trim(p)

    def finish(self, key: tuple[int, ...], answer_id: int) -> None:
        """A live sample ended: its answer stays in the history."""
        p = self._prompts.get(key)
        if p is not None and answer_id in p.live:
            p.live.discard(answer_id)
            if answer_id in p.answers:
                p.done += 1
                p.done_tokens += len(p.answers[answer_id])
            self._trim(p)
        self._evict()

    def add_answer(
        self, key: tuple[int, ...], answer: Sequence[int], sample_id: Hashable = None
    ) -> None:
        """Add a finished answer (e.g. from the store) to the prompt's history."""
        answer_id = self.start(key, sample_id)
        self.extend(key, answer_id, answer)
        self.finish(key, answer_id)

    def __len__(self) -> int:
        return len(self._prompts)

    @property
    def tokens(self) -> int:
        """Answer tokens held over all prompts."""
        return self._tokens

    def answers(self, key: tuple[int, ...]) -> int:
        """Answers held for a prompt (0 for an unknown one)."""
        p = self._prompts.get(key)
        return len(p.answers) if p is not None else 0

    def mean_length(self, key: tuple[int, ...]) -> float | None:
        """Mean length of the prompt's finished answers held (None: none): its samples'
        predicted length."""
        p = self._prompts.get(key)
        return p.done_tokens / p.done if p is not None and p.done else None

    # -- proposing -----------------------------------------------------------------------

    def propose(self, key: tuple[int, ...], answer_id: int, k: int) -> list[int]:
        """Up to k tokens continuing the sample's context, by the greedy walk (module doc)."""
        p = self._prompts.get(key)
        if p is None or k <= 0:
            return []
        answer = p.answers.get(answer_id)
        if answer is None:
            return []
        # The walk extends a copy of the prefix hashes' tail with its own proposals.
        hs = p.prefixes[answer_id][-(MATCH_LENGTHS[0] + 1) :]
        out: list[int] = []
        support = 1.0
        while len(out) < k:
            m, nxt = _continuations(p, hs)
            if nxt is None:
                break
            if not out:
                k = min(k, MAX_SPEC_FACTOR * m)
            # max over the newest first: ties go to the most recently counted token.
            token, count = max(reversed(nxt.items()), key=lambda kv: kv[1])
            support *= count / sum(nxt.values())
            if support < self.min_support:
                break
            out.append(token)
            _push(hs, token)
        return out

    # -- internals -----------------------------------------------------------------------

    def _count(self, p: _Prompt, prefix: array, end: int, token: int, delta: int) -> None:
        """Add `delta` occurrences of `token` after each indexed context ending at position
        `end` of head + answer (contexts reach back into the prompt's tail)."""
        last, counts = prefix[end], p.counts
        for m in MATCH_LENGTHS:
            if end < m:
                continue  # a prompt shorter than the context: not indexed at this length
            ctx = (last - prefix[end - m] * _POW[m]) % _MOD  # _window, inlined: per token
            table = counts[m]
            nxt = table.get(ctx)
            if nxt is None:
                if delta < 0:
                    continue
                nxt = table[ctx] = {}
            # Re-inserted at the end: dict order is recency, the tie-break of `propose`.
            c = nxt.pop(token, 0) + delta
            if c > 0:
                nxt[token] = c
            elif not nxt:
                del table[ctx]

    def _drop_oldest(self, p: _Prompt) -> bool:
        """Drop the prompt's oldest finished answer; False if every answer is live."""
        answer_id = next((a for a in p.answers if a not in p.live), None)
        if answer_id is None:
            return False
        answer = p.answers.pop(answer_id)
        full = p.prefixes.pop(answer_id)
        p.done -= 1
        p.done_tokens -= len(answer)
        for j, t in enumerate(answer):
            self._count(p, full, len(p.head) + j, t, -1)
        p.tokens -= len(answer)
        self._tokens -= len(answer)
        return True

    def _trim(self, p: _Prompt) -> None:
        """Keep the prompt within max_prompt_tokens, oldest finished answers first (live
        answers stay: a long-tail sample's own text is its best source of drafts)."""
        while p.tokens > self.max_prompt_tokens and self._drop_oldest(p):
            pass

    def _evict(self) -> None:
        """Keep the engine within max_tokens: least-recently used prompts without live
        samples go first."""
        for key in list(self._prompts):
            if self._tokens <= self.max_tokens:
                return
            p = self._prompts[key]
            if not p.live:
                del self._prompts[key]
                self._tokens -= p.tokens


def _continuations(p: _Prompt, hs: array) -> tuple[int, dict[int, int] | None]:
    """The length and continuation counts of the longest indexed context ending where the
    prefix hashes `hs` end (hs holds at least the last max(MATCH_LENGTHS) + 1 of them, or all
    when the text is shorter), if any."""
    end = len(hs) - 1
    for m in MATCH_LENGTHS:
        if end >= m:
            nxt = p.counts[m].get(_window(hs, end, m))
            if nxt:
                return m, nxt
    return 0, None
