"""Output processing: what the engine does with a step's sampled tokens.

Sampling rows are laid out per scheduled sequence (one per completion: a sequence still to
fork into `n` completions samples its siblings' first tokens from the same logits row); the
tokens are appended to their requests, forks become sequences of their own, stop conditions
are checked, and requests end or fail one at a time. Nothing here touches the device.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

from ..core.scheduler import Scheduler
from ..core.sequence import Sequence, SeqStatus
from ..errors import describe
from ..outputs import RequestOutput
from ..sampling_params import RequestOutputKind
from .request import EngineRequest
from .sampler import Sampled, SampleResult, SampleRow

logger = logging.getLogger("hf_paged")
FINAL_ONLY = RequestOutputKind.FINAL_ONLY


@dataclass
class InFlight:
    """A step's sampled tokens the host has not seen yet (async scheduling): the next step
    is planned with them pending and reads them on the device."""

    items: list  # the step's scheduled items that sampled
    owners: list[tuple]  # as `sampling_rows` gives them
    sampled: Sampled
    rows: dict[int, int]  # seq_id -> its row of sampled.tokens, for sequences holding it
    forks: bool = False  # a token forks a request's n completions (it lands before planning)
    landed: bool = False


class OutputProcessor:
    """Applies sampled tokens, forks, stops and failures to the engine's requests."""

    def __init__(self, scheduler: Scheduler, requests: dict[str, EngineRequest],
                 eos_ids: set[int]):
        self.scheduler, self.requests, self.eos_ids = scheduler, requests, eos_ids
        self._seq_ids = itertools.count(1)
        self._suppressing: list[tuple] = []  # (row, seq, min_tokens) masking stop tokens
        self.generation_tokens = 0  # tokens sampled

    def new_seq_id(self) -> int:
        return next(self._seq_ids)

    # -- ending requests ----------------------------------------------------------------------
    def end(self, request: EngineRequest, reason: str) -> None:
        """Ends every unfinished completion of `request` with `reason`, freeing its blocks."""
        for seq in request.seqs:
            self.scheduler.finish(seq, reason)
        request.end(reason)

    def fail(self, request: EngineRequest, message: str, touched: dict) -> None:
        """Ends `request` alone with finish_reason "error" and `message`."""
        logger.warning("hf-paged: request %s failed: %s", request.request_id, message)
        self.end(request, "error")
        request.error = message
        touched[request.request_id] = request

    def fail_all(self, error: str, tokenizer, in_flight=None) -> list[RequestOutput]:
        """Ends every request with `error`; returns their outputs. The tokens of
        `in_flight` (async scheduling's last step) land first, as they would have without."""
        if in_flight is not None:
            try:
                self.land(in_flight, {})
            except Exception as err:  # noqa: BLE001 (landing them may be what failed)
                logger.warning("hf-paged: the last step's tokens did not land: %s",
                               describe(err))
        outputs = []
        for request in list(self.requests.values()):
            if not request.finished:  # (one its landed tokens just ended keeps its ending)
                self.end(request, "error")
                request.error = error
            request.metrics.finished_time = time.monotonic()
            outputs.append(request.output(tokenizer))
            del self.requests[request.request_id]
        return outputs

    # -- a step's tokens ----------------------------------------------------------------------
    def sampling_rows(self, items: list) -> tuple[list[SampleRow], list[tuple], list[int]]:
        """For the scheduled sequences that sample: (their rows' settings, the owner of each
        row as (request, seq, target, completion), the logits row each reads). A target of
        None is a sibling forked from `seq` by this token."""
        self._lift_suppression()
        made = [item.seq.sampling for item in items]  # (row, owner), made at a first sample
        if None not in made:  # (a sequence forks at its first sample only)
            return [m[0] for m in made], [m[1] for m in made], list(range(len(items)))
        rows, owners, index = [], [], []
        requests = self.requests
        for row_of_logits, (item, pair) in enumerate(zip(items, made)):
            seq = item.seq
            if pair is None:
                request = requests[seq.request_id]
                completion = 0 if len(request.seqs) == 1 else request.seqs.index(seq)
                row = self._sample_row(request, seq, completion)
                if row.suppress is not None:
                    self._suppressing.append((row, seq, request.params.min_tokens))
                pair = seq.sampling = (row, (request, seq, seq, completion))
            rows.append(pair[0])
            owners.append(pair[1])
            index.append(row_of_logits)
            if item.forks:
                request = pair[1][0]
                for k in range(1, item.forks + 1):  # siblings' first tokens, same logits
                    rows.append(self._sample_row(request, seq, k))
                    owners.append((request, seq, None, k))
                    index.append(row_of_logits)
        return rows, owners, index

    def _lift_suppression(self) -> None:
        """Stop tokens are masked until a completion has min_tokens; rows that reached it
        (or ended) leave the list."""
        if self._suppressing:
            kept = []
            for row, seq, min_tokens in self._suppressing:
                if len(seq.output) >= min_tokens:
                    row.lift_suppression()
                elif not seq.finished:
                    kept.append((row, seq, min_tokens))
            self._suppressing = kept

    @staticmethod
    def _sample_row(request: EngineRequest, seq: Sequence, completion: int) -> SampleRow:
        params = request.params
        suppress = None
        if len(seq.output) < params.min_tokens and request.stop_ids:
            suppress = sorted(request.stop_ids)
        return SampleRow(params, seq.prompt, seq.output, request.generators[completion],
                         suppress, request.matchers[completion] if request.matchers else None,
                         request.bad_words)

    def record(self, items: list, owners: list[tuple], result: SampleResult,
               errors: dict[int, str], touched: dict) -> None:
        """Appends each row's token to its completion (forking siblings off their parent),
        fails the requests of rows in `errors`, then checks the stops of the completions
        that grew."""
        if not errors and len(owners) == len(items):  # no failure, no fork: one pass
            self._record_each(owners, result, touched)
            return
        failed: dict[str, str] = {}
        for j, message in errors.items():
            failed.setdefault(owners[j][0].request_id, message)
        children: dict[int, list[Sequence]] = {}
        grew = []
        now = time.monotonic()
        for (request, seq, target, completion), token, lp, tlp in zip(
                owners, result.tokens, result.logprobs, result.token_logprobs):
            if failed and request.request_id in failed:
                continue
            if target is None:
                child = Sequence(self.new_seq_id(), seq.request_id, seq.prompt,
                                 seq.max_tokens, seq.priority, seq.arrival, seq.salt,
                                 adapter=seq.adapter)
                request.seqs.append(child)
                children.setdefault(id(seq), []).append(child)
                target = child
            request.append(target, completion, token, lp, tlp, now)
            touched[request.request_id] = request
            grew.append((request, target, completion))
        self.generation_tokens += len(grew)
        for request_id, message in failed.items():
            self.fail(self.requests[request_id], message, touched)
        if children:
            for item in items:
                if item.forks and id(item.seq) in children:
                    item.seq.forks = 0
                    self.scheduler.fork(item.seq, children[id(item.seq)])
        self.check_stops(grew, touched)

    def hold(self, items: list, owners: list[tuple], sampled: Sampled) -> InFlight:
        """Async scheduling: leaves a step's tokens on the device. A sequence continuing its
        own completion counts its token as pending, so the next step computes it, unless
        the token forks siblings (made when it lands) or is its last (max_tokens)."""
        forking = {id(item.seq) for item in items if item.forks}
        rows = {}
        for j, (_, seq, target, _) in enumerate(owners):
            if target is seq and id(seq) not in forking and len(seq.output) + 1 < seq.max_tokens:
                seq.pending = 1
                rows[seq.seq_id] = j
        return InFlight(items, owners, sampled, rows, forks=bool(forking))

    def land(self, in_flight: InFlight, touched: dict) -> None:
        """Waits for the tokens of `in_flight` and records them; a sequence that ended in
        the meantime (removed, or failed with the engine) drops its token. Once only."""
        if in_flight.landed:
            return
        in_flight.landed = True
        result, errors = in_flight.sampled.collect()
        items, owners = in_flight.items, in_flight.owners
        for j in in_flight.rows.values():
            owners[j][1].pending = 0
        finished = SeqStatus.FINISHED
        live = [j for j, owner in enumerate(owners) if owner[1].status is not finished]
        if len(live) < len(owners):
            owners = [owners[j] for j in live]
            result = SampleResult(*([values[j] for j in live] for values in (
                result.tokens, result.logprobs, result.token_logprobs)),
                [k for k, j in enumerate(live) if j in errors])
            errors = {k: errors[j] for k, j in enumerate(live) if j in errors}
            items = [item for item in items if item.seq.status is not finished]
        if owners:
            self.record(items, owners, result, errors, touched)

    def _record_each(self, owners: list[tuple], result: SampleResult, touched: dict) -> None:
        """`record` when every row continues its own completion: each token is appended
        and its stop checked in one pass."""
        now, eos_ids, finish = time.monotonic(), self.eos_ids, self.scheduler.finish
        for (request, seq, _, k), token, lp, tlp in zip(owners, result.tokens, result.logprobs,
                                                        result.token_logprobs):
            request.append(seq, k, token, lp, tlp, now)
            touched[request.request_id] = request
            # No text or grammar to follow, no stop token, room left: `stop` would find
            # nothing (most tokens).
            if (request.texts is None and request.matchers is None
                    and token not in request.stop_ids and len(seq.output) < seq.max_tokens):
                continue
            if request.unfinished:  # (0: ended by a sibling's failed stop check)
                try:  # _check_stop, inlined: a call per token
                    reason = request.stop(seq, k, eos_ids)
                except Exception as err:  # noqa: BLE001
                    self._stop_failed(request, err, touched)
                    continue
                if reason is not None:
                    finish(seq, reason)
        self.generation_tokens += len(owners)

    def check_stops(self, grew: list[tuple], touched: dict) -> None:
        """Stop checks of (request, sequence, completion) that got a token; a request whose
        check raises fails alone."""
        for request, seq, k in grew:
            if not (seq.finished or request.finished):
                self._check_stop(request, seq, k, touched)

    def _check_stop(self, request: EngineRequest, seq: Sequence, k: int, touched: dict) -> None:
        """Ends completion k (`seq`) if its newest token stops it; fails its request alone
        if the check raises."""
        try:
            reason = request.stop(seq, k, self.eos_ids)
        except Exception as err:  # noqa: BLE001 (e.g. its tokens do not decode)
            self._stop_failed(request, err, touched)
            return
        if reason is not None:
            self.scheduler.finish(seq, reason)

    def _stop_failed(self, request: EngineRequest, err: Exception, touched: dict) -> None:
        self.fail(request, f"its stop check failed: {describe(err)}", touched)

    def outputs(self, touched: dict, tokenizer, finished_only: bool = False) -> list[RequestOutput]:
        """The outputs of the requests a step changed (only the finished ones if
        `finished_only`: a caller waiting for whole completions needs no snapshot per token);
        finished requests leave the engine."""
        now = time.monotonic()
        outputs = []
        for request in touched.values():
            if request.finished:
                request.metrics.finished_time = now
                outputs.append(request.output(tokenizer))
                del self.requests[request.request_id]
            elif not finished_only and request.params.output_kind is not FINAL_ONLY:
                outputs.append(request.output(tokenizer))
        return outputs
