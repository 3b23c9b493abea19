"""Model-free drafter: an incremental n-gram index over a prompt and its sibling samples."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

# An occurrence is packed into one int (doc index, continuation position) to keep the index
# small: it holds up to (max_match - min_match + 1) entries per generated token.
_POS_BITS = 32
_POS_MASK = (1 << _POS_BITS) - 1


@dataclass
class _Group:
    """One prompt and the samples drawn from it; doc 0 is the prompt itself."""

    docs: list[list[int]]  # doc 0: prompt; doc i > 0: prompt + the tokens sample i emitted
    alive: list[bool]  # a sample whose tokens were purged is skipped on lookup
    seq_doc: dict[str, int] = field(default_factory=dict)  # live samples only
    # hash(tuple of m tokens) -> packed (doc, position right after those m tokens), the most
    # recently indexed occurrence. Only n-grams that already have a continuation are indexed,
    # so a sample's current suffix never matches itself with nothing to propose.
    index: dict[int, int] = field(default_factory=dict)


class NgramDrafter:
    """Proposes draft tokens by copying what followed the longest matching suffix elsewhere.

    The corpus of a group is its prompt, every sample's own history and its siblings'
    outputs: n samples of one prompt share long spans (restated facts, formulas, answer
    formats), so a span one sibling produced is a good guess for another. The index is
    updated on `extend`, so `propose` costs at most (max_match - min_match + 1) dict lookups.
    """

    def __init__(self, max_match: int = 8, min_match: int = 2) -> None:
        if min_match < 1 or max_match < min_match:
            raise ValueError(f"need 1 <= min_match <= max_match, got {min_match}, {max_match}")
        self.max_match = max_match
        self.min_match = min_match
        self._groups: dict[str, _Group] = {}

    # -- lifecycle -----------------------------------------------------------------------

    def add_group(self, group_id: str, prompt_ids: Sequence[int]) -> None:
        """Register a prompt; re-adding the same prompt is a no-op, a different one an error."""
        prompt = [int(t) for t in prompt_ids]
        existing = self._groups.get(group_id)
        if existing is not None:
            if existing.docs[0] != prompt:
                raise ValueError(f"group {group_id!r} already exists with a different prompt")
            return
        group = _Group(docs=[prompt], alive=[True])
        self._groups[group_id] = group
        for end in range(1, len(prompt)):
            self._index_position(group, 0, end)

    def add_sequence(self, group_id: str, seq_id: str) -> None:
        """Register a sample of the group's prompt (it starts with no emitted tokens)."""
        group = self._group(group_id)
        if seq_id in group.seq_doc:
            raise ValueError(f"sequence {seq_id!r} already exists in group {group_id!r}")
        group.seq_doc[seq_id] = len(group.docs)
        group.docs.append(list(group.docs[0]))
        group.alive.append(True)

    def extend(self, group_id: str, seq_id: str, new_tokens: Sequence[int]) -> None:
        """Append tokens the sample emitted and index the n-grams they complete."""
        group = self._group(group_id)
        doc_id = self._doc(group, group_id, seq_id)
        doc = group.docs[doc_id]
        for token in new_tokens:
            doc.append(int(token))
            # The n-grams ending just before the new token now have a continuation (n-grams
            # wholly inside the prompt were indexed once, under doc 0).
            self._index_position(group, doc_id, len(doc) - 1)

    def remove_sequence(self, group_id: str, seq_id: str, keep_tokens: bool = True) -> None:
        """Forget a sample as a proposer.

        By default its emitted tokens stay in the group's corpus: a finished sibling is the
        best source of drafts for the long-tail siblings still decoding. `keep_tokens=False`
        (e.g. an aborted sample) also drops them from future proposals.
        """
        group = self._group(group_id)
        doc_id = self._doc(group, group_id, seq_id)
        del group.seq_doc[seq_id]
        if not keep_tokens:
            group.alive[doc_id] = False
            group.docs[doc_id] = []

    def remove_group(self, group_id: str) -> None:
        """Drop a prompt, its samples and its index."""
        self._groups.pop(group_id, None)

    def has_group(self, group_id: str) -> bool:
        return group_id in self._groups

    def has_sequence(self, group_id: str, seq_id: str) -> bool:
        group = self._groups.get(group_id)
        return group is not None and seq_id in group.seq_doc

    def __len__(self) -> int:
        return len(self._groups)

    # -- proposing -----------------------------------------------------------------------

    def propose(self, group_id: str, seq_id: str, k: int) -> list[int]:
        """Up to k tokens that followed the longest suffix of this sample's context elsewhere.

        The longest match (capped at max_match) wins; among occurrences of that n-gram the
        most recently indexed one. When that source ends before k tokens (a sibling's
        newest tokens), matching resumes from the extended context. Returns [] when no
        suffix of >= min_match tokens matches.
        """
        if k <= 0:
            return []
        group = self._group(group_id)
        doc_id = self._doc(group, group_id, seq_id)
        ctx = group.docs[doc_id]
        n = len(ctx)
        out: list[int] = []
        while len(out) < k:
            tail = (ctx[max(0, n - self.max_match) :] + out)[-self.max_match :]
            hit = self._match(group, tail)
            if hit is None:
                break
            src_id, pos = hit
            start = len(out)
            if src_id == doc_id:
                # The sample's own history, continued by this very proposal: an overlapping
                # copy (as in LZ77) proposes a repeating pattern for its full length.
                while len(out) < k:
                    j = pos + len(out) - start
                    out.append(ctx[j] if j < n else out[j - n])
            else:
                # Indexed n-grams always have a continuation, so every round adds a token.
                out.extend(group.docs[src_id][pos : pos + k - start])
        return out

    def _match(self, group: _Group, tail: list[int]) -> tuple[int, int] | None:
        """(doc, continuation position) of the longest indexed suffix of tail, if any."""
        t = len(tail)
        for m in range(min(self.max_match, t), self.min_match - 1, -1):
            suffix = tail[t - m :]
            packed = group.index.get(hash(tuple(suffix)))
            if packed is None:
                continue
            src_id, pos = packed >> _POS_BITS, packed & _POS_MASK
            # Guards against a hash collision and against purged samples.
            if group.alive[src_id] and group.docs[src_id][pos - m : pos] == suffix:
                return src_id, pos
        return None

    # -- internals -----------------------------------------------------------------------

    def _group(self, group_id: str) -> _Group:
        group = self._groups.get(group_id)
        if group is None:
            raise KeyError(f"unknown n-gram group {group_id!r}")
        return group

    @staticmethod
    def _doc(group: _Group, group_id: str, seq_id: str) -> int:
        doc_id = group.seq_doc.get(seq_id)
        if doc_id is None:
            raise KeyError(f"unknown sequence {seq_id!r} in n-gram group {group_id!r}")
        return doc_id

    def _index_position(self, group: _Group, doc_id: int, cont: int) -> None:
        """Index every n-gram of doc ending right before position `cont` (its continuation)."""
        doc = group.docs[doc_id]
        packed = (doc_id << _POS_BITS) | cont
        for m in range(self.min_match, min(self.max_match, cont) + 1):
            group.index[hash(tuple(doc[cont - m : cont]))] = packed
