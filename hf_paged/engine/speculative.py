"""Speculative decoding in the engine's own step.

Before a step is scheduled, a proposer gives each running decode up to k tokens it guesses
will follow its newest one (`Sequence.draft`): a prompt lookup (`NgramProposer`) or a small
model with the same tokenizer (draft.py). The scheduler computes them with the newest token,
as 1 + k tokens of that sequence in the step's packed forward (their slots reserved like any
tokens'), and the logits at all 1 + k positions come back. Position j is then sampled with
the request's own settings, as if drafts 1..j were already its output (penalties, min_tokens
and structured-output masks included), and with the random draws it would have had without
speculation: a seeded request's generator draws one row per position, and is rewound to
just after the last position kept. Drafts are accepted while they equal those tokens; the
first token that differs, or the one after the last draft, is kept as well. The rest are
dropped: their slots are given back (`Scheduler.accept`), so nothing stale is attended or
cached.

Why this keeps the target distribution exactly: both proposers propose deterministically,
a point-mass draft q = delta(d). Leviathan et al.'s rule accepts d with probability
min(1, p(d) / q(d)) = p(d) and otherwise draws from norm(max(p - q, 0)), which is p
without d. Drawing x from p and accepting d iff x == d does just that: P(accept) = p(d), and
x given x != d is p without d. So every token is the token the request would have drawn
without speculation from the same random numbers; greedy is the case where x is the argmax.

When speculation stops paying it stands down:
- per sequence: an exponential average of its acceptance rate (weight 0.3 per
  verification) below `min_acceptance` pauses its proposals for 4 steps, then 8, 16, ... up
  to 128 while it keeps failing (a verification that accepts a draft resets the pause). A
  new sequence starts from the engine's recent acceptance (an average over all
  verifications, weight 0.1): while drafts fail everywhere, it starts paused, for as long
  as the latest sequence to fail was;
- engine-wide: while more than `disable_by_batch_size` sequences run, nothing is proposed
  (a step that large is compute-bound: verifying k more tokens each costs more than it saves).

Drafts are guesses, so no request fails for want of one: where a proposal raises (a draft
model's forward failing on some sequence's tokens), the sequences it fails on alone are
found by halves and decode without speculation from then on; the others draft as before.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..core.sequence import Sequence, SeqStatus
from .sampler import SampleResult, SampleRow

logger = logging.getLogger("hf_paged")
METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` keys (as a dict or this class).

    method:                  "ngram" (prompt lookup) or "draft_model"
    num_speculative_tokens:  k, tokens proposed per step and sequence
    prompt_lookup_min/max:   ngram: the shortest / longest suffix matched (2 / 4)
    model:                   draft_model: a model object or a local folder (same tokenizer)
    disable_by_batch_size:   propose nothing while more sequences than this run (32)
    min_acceptance:          a sequence's acceptance average below which it pauses (0.25)
    draft_kv_cache_bytes:    draft_model: its KV pool (default: the target pool's blocks)
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: object = None
    disable_by_batch_size: int = 32
    min_acceptance: float = 0.25
    draft_kv_cache_bytes: int | None = None

    @classmethod
    def of(cls, value) -> "SpeculativeConfig | None":
        """Checks a user's config (None, a dict or a SpeculativeConfig)."""
        if value is None or isinstance(value, cls):
            config = value
        elif isinstance(value, dict):
            unknown = sorted(set(value) - set(cls.__dataclass_fields__))
            if unknown:
                raise ValueError(f"speculative_config: unknown key(s) {unknown}; allowed: "
                                 f"{sorted(cls.__dataclass_fields__)}.")
            missing = [k for k in ("method", "num_speculative_tokens") if k not in value]
            if missing:
                raise ValueError(f"speculative_config needs {missing}.")
            config = cls(**value)
        else:
            raise ValueError(f"speculative_config must be a dict; got {value!r}.")
        if config is None:
            return None
        if config.method not in METHODS:
            raise ValueError(f"speculative_config['method'] must be one of {METHODS}; got "
                             f"{config.method!r}.")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                     "disable_by_batch_size", "draft_kv_cache_bytes"):
            value = getattr(config, name)
            if name == "draft_kv_cache_bytes" and value is None:  # (the target's block count)
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config[{name!r}] must be a positive integer; "
                                 f"got {value!r}.")
        if config.prompt_lookup_min > config.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min "
                             f"({config.prompt_lookup_min}) exceeds prompt_lookup_max "
                             f"({config.prompt_lookup_max}).")
        if isinstance(config.min_acceptance, bool) or not isinstance(
                config.min_acceptance, (int, float)) or not 0 <= config.min_acceptance <= 1:
            raise ValueError(f"speculative_config['min_acceptance'] must be in [0, 1]; got "
                             f"{config.min_acceptance!r}.")
        if (config.method == "draft_model") != (config.model is not None):
            raise ValueError("speculative_config: 'model' is the draft_model method's, and "
                             "that method needs it.")
        return config


class NgramProposer:
    """Prompt lookup: the longest suffix of a sequence's tokens (prompt_lookup_max down to
    prompt_lookup_min) seen earlier in them proposes the tokens that followed it there (the
    latest such place). Each sequence keeps the positions of each token, grown as it grows,
    and looks at the last 64 places its newest token was seen."""

    CANDIDATES = 64

    def __init__(self, config: SpeculativeConfig):
        self.low, self.high = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, seqs: list[Sequence], ks: list[int], running=None) -> list[list[int]]:
        return [self._one(seq, k) for seq, k in zip(seqs, ks)]

    def release(self, running: list[Sequence]) -> None:
        """(Its state lives on the sequences: nothing to give back.)"""

    def _one(self, seq: Sequence, k: int) -> list[int]:
        state = seq.speculation
        prompt, output = seq.prompt, seq.output
        p = len(prompt)

        def token(i: int) -> int:
            return prompt[i] if i < p else output[i - p]

        end = p + len(output) - 1  # the newest token: its earlier places are looked up
        seen = state.seen
        for i in range(state.indexed, end):
            seen.setdefault(token(i), []).append(i)
        state.indexed = max(state.indexed, end)
        places = seen.get(token(end))
        if not places:
            return []
        best, where, high = 0, -1, self.high
        for i in reversed(places[-self.CANDIDATES:]):
            n = 1
            while n < high and i - n >= 0 and token(i - n) == token(end - n):
                n += 1
            if n > best:
                best, where = n, i
                if n == high:
                    break
        if best < self.low:
            return []
        return seq.tokens(where + 1, min(where + 1 + k, end + 1))


class _Track:
    """A sequence's speculation state (opaque to the scheduler: `Sequence.speculation`)."""

    __slots__ = ("average", "pause", "backoff", "seen", "indexed", "failed")

    def __init__(self, average: float = 1.0, pause: int = 0, backoff: int = 4):
        self.average, self.pause, self.backoff = average, pause, backoff  # the turn-down rule's
        self.failed = False  # its proposal raised: it speculates no more
        self.seen: dict[int, list[int]] = {}  # ngram: token -> its positions
        self.indexed = 0  # tokens entered in `seen`


@dataclass
class Verification:
    """A step's sampling rows with each speculating sequence's rows spread out: row r reads
    logits row `offsets[r]` of its item (0 .. len(draft)); `spans` give each sampling
    owner's rows, in order."""

    rows: list[SampleRow]
    owners: list[tuple]
    index: list[int]
    offsets: list[int]
    spans: list[tuple[int, int]]  # (first row, rows) per owner of sampling_rows


class Speculator:
    """Proposes drafts before a step and applies the verified tokens after it."""

    def __init__(self, config: SpeculativeConfig, proposer):
        self.config, self.proposer = config, proposer
        self.k = config.num_speculative_tokens
        self.proposed = self.accepted = self.verifications = 0
        self.recent, self.recent_backoff = 1.0, 4  # over all sequences: new ones start here

    @classmethod
    def build(cls, value, runner, budget: int) -> "Speculator | None":
        """The engine's speculator for a user's `speculative_config` (None: none); `budget`:
        the step's token budget, which a draft model's forwards keep to as well."""
        config = SpeculativeConfig.of(value)
        if config is None:
            return None
        if config.method == "ngram":
            return cls(config, NgramProposer(config))
        from .draft import DraftProposer
        return cls(config, DraftProposer(config, runner, budget))

    def counters(self) -> dict[str, int]:
        return {"spec_proposed_tokens": self.proposed, "spec_accepted_tokens": self.accepted,
                "spec_verifications": self.verifications}

    def propose(self, running: list[Sequence]) -> None:
        """Sets the drafts of the running decodes that speculate this step."""
        off = len(running) > self.config.disable_by_batch_size  # the engine-wide rule
        seqs, ks = [], []
        for seq in running:
            if seq.draft:  # last step's, if it was not scheduled then
                seq.draft.clear()
            if off:
                continue
            state = seq.speculation
            if state is None:
                failing = self.recent < self.config.min_acceptance
                state = seq.speculation = _Track(
                    self.recent, self.recent_backoff if failing else 0,
                    self.recent_backoff if failing else 4)
            if state.failed:
                continue
            if state.pause:
                state.pause -= 1
                continue
            # (a bonus token past max_tokens is dropped: the completion ends before it)
            k = min(self.k, seq.max_tokens - len(seq.output))
            # A decode: one sampled token, the newest, is all it has to compute (and it has
            # sampled before: a sibling just forked has no sampling row yet).
            if (k > 0 and seq.sampling is not None and not seq.pending and not seq.forks
                    and seq.status is SeqStatus.RUNNING
                    and seq.num_computed == seq.num_tokens - 1):
                seqs.append(seq)
                ks.append(k)
        if not seqs:
            return
        for seq, draft in zip(seqs, self._drafts(seqs, ks, running)):
            grammar = seq.sampling[0].grammar
            if grammar is not None and draft:  # only drafts its constraint allows
                draft = draft[:grammar.allows(draft)]
            seq.draft[:] = draft

    def _drafts(self, seqs: list[Sequence], ks: list[int], running) -> list[list[int]]:
        """The proposer's drafts for `seqs`; where it raises, proposed again by halves, and a
        sequence it fails on alone is marked to speculate no more."""
        try:
            return self.proposer.propose(seqs, ks, running)
        except Exception as err:  # noqa: BLE001 (whatever the draft model raises)
            if len(seqs) == 1:
                seqs[0].speculation.failed = True
                logger.warning("hf-paged: proposing drafts for sequence %s failed (%s: %s); it "
                               "decodes without speculation.", seqs[0].seq_id,
                               type(err).__name__, err)
                return [[]]
            half = len(seqs) // 2
            return (self._drafts(seqs[:half], ks[:half], running)
                    + self._drafts(seqs[half:], ks[half:], running))

    def expand(self, items: list, rows: list[SampleRow], owners: list[tuple],
               index: list[int]) -> Verification:
        """Spreads the sampling rows of speculating items over their positions."""
        out = Verification([], [], [], [], [])
        for row, owner, i in zip(rows, owners, index):
            draft = items[i].draft
            out.spans.append((len(out.rows), 1 + len(draft)))
            if not draft:
                out.rows.append(row)
                out.owners.append(owner)
                out.index.append(i)
                out.offsets.append(0)
                continue
            request, seq = owner[0], owner[1]
            params = row.params
            states = [] if row.generator is not None and not row.greedy else None
            for j in range(len(draft) + 1):
                before = len(seq.output) + j
                suppress = sorted(request.stop_ids) if before < params.min_tokens else None
                grammar = None if row.grammar is None else row.grammar.ahead(draft[:j])
                ahead = SampleRow(params, row.prompt, seq.output + list(draft[:j]),
                                  row.generator, suppress, grammar, row.bad_words)
                ahead.states = states
                out.rows.append(ahead)
                out.owners.append(owner)
                out.index.append(i)
                out.offsets.append(j)
        return out

    def record(self, v: Verification, items: list, result: SampleResult,
               errors: dict[int, str], output, scheduler, touched: dict) -> None:
        """Appends each owner's kept tokens (round by round: a stop ends a completion
        where it lands), then gives back the slots of the drafts it did not keep."""
        kept: list[tuple[int, int]] = []  # (first row, tokens kept) per owner
        accepted_of: dict[int, int] = {}
        tokens = result.tokens
        for first, count in v.spans:
            draft = items[v.index[first]].draft
            n = 0  # drafts accepted: while they equal the tokens drawn before them
            while n < count - 1 and first + n not in errors and tokens[first + n] == draft[n]:
                n += 1
            kept.append((first, n + 1))
            if draft:
                seq = v.owners[first][1]
                accepted_of[id(seq)] = n
                self._update(seq, len(draft), n)
                states = v.rows[first].states
                if states is not None and n < len(draft):  # draws past the kept tokens: undone
                    v.rows[first].generator.set_state(states[n])
        for step in range(max(n for _, n in kept)):  # round `step`: each owner's token `step`
            part = [(first + step, owner_i) for owner_i, (first, n) in enumerate(kept)
                    if n > step and (step == 0 or not v.owners[first][1].finished)]
            if not part:
                break
            rows = [r for r, _ in part]
            round_result = SampleResult([tokens[r] for r in rows],
                                        [result.logprobs[r] for r in rows],
                                        [result.token_logprobs[r] for r in rows], [])
            round_errors = {j: errors[r] for j, r in enumerate(rows) if r in errors}
            round_result.failed = sorted(round_errors)
            round_items = items if step == 0 else [items[v.index[r]] for r in rows]
            output.record(round_items, [v.owners[r] for r in rows], round_result,
                          round_errors, touched)
        for item in items:
            if item.draft:
                scheduler.accept(item.seq, accepted_of.get(id(item.seq), 0))
                item.seq.draft.clear()

    def _update(self, seq: Sequence, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        self.verifications += 1
        state, rate = seq.speculation, accepted / proposed
        self.recent = 0.9 * self.recent + 0.1 * rate
        state.average = 0.7 * state.average + 0.3 * rate
        if accepted:
            state.backoff = 4
        if state.average < self.config.min_acceptance:
            state.pause, state.backoff = state.backoff, min(2 * state.backoff, 128)
            state.average = self.config.min_acceptance  # probed afresh after the pause
        self.recent_backoff = state.backoff
