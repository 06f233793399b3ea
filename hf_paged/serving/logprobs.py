"""Log-probabilities in the OpenAI API's shapes: the completions API's `tokens`,
`token_logprobs`, `top_logprobs` and `text_offset` (prompt tokens too, with `echo`), and
chat's `content` entries. A token is named by its text, or `bytes:\\x..` when it is only
part of a character (`TokenPieces`)."""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass

from ..engine.detokenizer import TokenPieces
from ..outputs import CompletionOutput, RequestOutput

LOGPROB_FLOOR = -9999.0  # stands for -inf (JSON has no infinities), as vLLM sends it


def _lp(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def completion_logprobs(out: CompletionOutput, start: int, pieces: TokenPieces,
                        offset: int | TextOffsets) -> dict:
    """Completions-API logprobs of tokens [start:] of a completion. Each position's
    `top_logprobs` holds the chosen token under its own string, then the others; a token
    whose string another one already has is keyed `token_id:N` (nothing collapses).
    offset: where the tokens' text starts, or a stream's offsets so far."""
    return token_logprobs(out.token_ids[start:], out.logprobs[start:], pieces, offset,
                          context=out.token_ids[:start])


class TextOffsets:
    """`text_offset`s of tokens in turn: where each token's text starts. A token that is
    only part of a character (a `bytes:` piece) adds nothing until the token completing it
    adds the character; bytes that never make one are a replacement character each, as
    the text has them."""

    def __init__(self, start: int = 0):
        self.at = start
        self._bytes = codecs.getincrementaldecoder("utf-8")("replace")

    def next(self, token: int, piece: str, pieces: TokenPieces, shown: bool = True) -> int:
        """Where a token named `piece` starts; one the text leaves out (not `shown`) adds
        nothing, nor ends a character that bytes before it began."""
        if not shown:
            return self.at
        if piece.startswith("bytes:"):
            at = self.at
            self.at += len(self._bytes.decode(bytes(pieces.bytes(token))))
            return at
        self.at += len(self._bytes.decode(b"", final=True))  # (bytes left incomplete)
        at = self.at
        self.at += len(piece)
        return at


def token_logprobs(token_ids: list[int], entries: list, pieces: TokenPieces,
                   offset: int | TextOffsets, count: int | None = None,
                   context: Sequence[int] = ()) -> dict:
    """`completion_logprobs` of any tokens; an entry of None (a prompt's first token) has
    null `token_logprobs` and `top_logprobs`. count: the most likely tokens each position's
    `top_logprobs` holds beside the chosen one (default: all of the entry's). context: the
    ids before the first token (each is named by the text it adds to them)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    at = offset if isinstance(offset, TextOffsets) else TextOffsets(offset)
    ids, first = [*context, *token_ids], len(context)
    ranked = [[] if entry is None else [
        (t, lp) for t, lp in sorted(entry.items(), key=lambda kv: -kv[1])[:count] if t != token]
        for token, entry in zip(token_ids, entries)]
    named = pieces.after(ids, [(first + j, [token] + [t for t, _ in others])
                               for j, (token, others) in enumerate(zip(token_ids, ranked))])
    for j, (token, entry, others, names) in enumerate(zip(token_ids, entries, ranked, named)):
        names = [text for text, _ in names]
        piece = names[0]
        tokens.append(piece)
        offsets.append(at.next(token, piece, pieces, pieces.shown(first + j, token)))
        if entry is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(_lp(entry[token]))
        top = {piece: _lp(entry[token])}
        for (t, lp), key in zip(others, names[1:]):
            top[f"token_id:{t}" if key in top else key] = _lp(lp)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


@dataclass(frozen=True)
class Echo:
    """A prompt as `echo` returns it: its text, and the tokens (position, token) that text
    leaves out (a text prompt's special tokens its tokenizer added; none where the text is
    its ids decoded, special tokens and all)."""
    text: str
    left_out: frozenset[tuple[int, int]] = frozenset()


def completion_pieces(pieces: TokenPieces, out: CompletionOutput, skip_special_tokens: bool,
                      keep_stop: bool = False) -> TokenPieces:
    """`pieces` read as a completion's text holds its tokens: special ones left out with
    `skip_special_tokens`, and the stop token or EOS that ended it, whose text the text
    never holds (unless `keep_stop`: include_stop_str_in_output)."""
    ended = out.finish_reason == "stop" and not isinstance(out.stop_reason, str) \
        and not keep_stop and out.token_ids
    last = len(out.token_ids) - 1
    return pieces.reading(skip_special_tokens,
                          frozenset({(last, out.token_ids[last])}) if ended else ())


def echo_of(tokenizer, prompt: str | list[int], ids: list[int]) -> Echo:
    """A prompt as `echo` returns it: as given (without the special tokens its tokenizer
    added), or its token ids `ids` decoded."""
    if isinstance(prompt, str):
        encoded = tokenizer(prompt, return_special_tokens_mask=True)
        return Echo(prompt, frozenset((i, t) for i, (t, bit) in enumerate(zip(
            encoded["input_ids"], encoded["special_tokens_mask"])) if bit))
    return Echo("" if tokenizer is None else tokenizer.decode(ids))


def echoed(result: RequestOutput, echo: Echo, pieces: TokenPieces,
           logprobs: int | None) -> tuple[str, dict | None]:
    """The prompt's text, and (if asked: the request's `logprobs`) its tokens' logprobs,
    with that many of the most likely beside each (the engine may keep more, for the
    request's own `prompt_logprobs`)."""
    if logprobs is None:
        return echo.text, None
    entries = result.prompt_logprobs or [None] * len(result.prompt_token_ids)
    pieces = pieces.reading(skip_special_tokens=False, left_out=echo.left_out)
    return echo.text, token_logprobs(result.prompt_token_ids, entries, pieces, 0, logprobs)


def ranked_prompt_logprobs(result: RequestOutput, count: int, pieces: TokenPieces) -> list:
    """vLLM's `prompt_logprobs`: per prompt token, None for the first, else {token id (a
    string): {"logprob", "rank", "decoded_token"}} of the `count` most likely tokens at its
    position and of the prompt's own token (whose rank is null when it is not among them:
    the engine keeps the top ones only). A token is named by its own text, as vLLM names
    it there."""
    entries = result.prompt_logprobs or [None] * len(result.prompt_token_ids)
    out = []
    for token, entry in zip(result.prompt_token_ids, entries):
        if entry is None:
            out.append(None)
            continue
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:count]
        ranked = {t: rank for rank, (t, _) in enumerate(top, 1)}
        out.append({str(t): {"logprob": _lp(entry[t]), "rank": ranked.get(t),
                             "decoded_token": pieces.text(t)}
                    for t in [*ranked, *([] if token in ranked else [token])]})
    return out


def scored_only(out: CompletionOutput) -> CompletionOutput:
    """A completion of `max_tokens=0`: the token the engine sampled is dropped."""
    return CompletionOutput(out.index, finish_reason="length",
                            logprobs=None if out.logprobs is None else [])


def joined_logprobs(first: dict | None, second: dict | None) -> dict | None:
    """Two logprobs objects back to back (the second's text offsets already count the
    first's text)."""
    if first is None or second is None:
        return first or second
    return {key: first[key] + second[key] for key in first}


def chat_logprobs(out: CompletionOutput, start: int, pieces: TokenPieces, top: int) -> dict:
    """Chat-API logprobs of tokens [start:] of a completion; `bytes` are each token's own
    (of the text it adds to the tokens before it, as `TokenPieces.after` names it)."""
    content = []
    tokens, entries = out.token_ids[start:], out.logprobs[start:]
    ranked = [sorted(entry.items(), key=lambda kv: -kv[1])[:top] for entry in entries]
    names = pieces.after(out.token_ids, [(start + k, [token] + [t for t, _ in best])
                                         for k, (token, best) in enumerate(zip(tokens, ranked))])
    for token, entry, best, ((text, raw), *named) in zip(tokens, entries, ranked, names):
        content.append({
            "token": text, "logprob": _lp(entry[token]), "bytes": list(raw),
            "top_logprobs": [{"token": name, "logprob": _lp(lp), "bytes": list(b)}
                             for (_, lp), (name, b) in zip(best, named)]})
    return {"content": content}
