"""The draft-model proposer of speculative decoding: a smaller model with the target's
tokenizer proposes k tokens greedily, over a paged KV pool of its own.

The draft keeps, per block-table row of the target, the K/V of the tokens it has seen.
Before each step it catches up on the tokens the target kept since (one packed forward over
all speculating sequences, the newest token included, whose logits give the first draft),
then runs k - 1 one-token forwards for the other drafts. Next time, its K/V is trusted up to
the first draft the target did not keep; the rest of its row is given back. A catch-up
forward keeps to the step's token budget, as the target's forwards do: a long prompt is
caught up on in chunks over several steps, and its sequence drafts once it has caught up.
"""

from __future__ import annotations

import logging

import torch

from ..core.kv_groups import GroupedTables
from ..core.sequence import Sequence
from ..errors import UnsupportedModelError
from .runner import Forward, ModelRunner

logger = logging.getLogger("hf_paged")


def load_draft(model, dtype: torch.dtype, device: torch.device):
    """The draft model: a model object, or a local folder loaded in the target's dtype on
    its device."""
    if isinstance(model, str):
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device)
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"speculative_config['model'] must be a model or a local folder; got "
                         f"{type(model).__name__}.")
    return model.eval()


class DraftProposer:
    def __init__(self, config, target: ModelRunner, budget: int):
        if target.tp_size > 1 or not target.pool.placement.is_single:
            raise ValueError("the draft_model method runs on one device; this model is split "
                             "(tensor parallelism or device_map). Use the ngram method.")
        model = load_draft(config.model, target.dtype, target.device)
        draft_len = getattr(model.config.get_text_config(decoder=True),
                            "max_position_embeddings", target.max_model_len)
        sized = ({"kv_cache_bytes": config.draft_kv_cache_bytes}
                 if config.draft_kv_cache_bytes is not None
                 else {"num_blocks": target.pool.blocks.num_blocks})
        self.runner = ModelRunner(model, block_size=target.block_size,
                                  max_num_seqs=target.max_num_seqs,
                                  max_model_len=min(draft_len, target.max_model_len),
                                  onednn_linear=target.onednn_linear, **sized)
        self.vocab = target.base.get_output_embeddings().weight.shape[0]
        self.draft_vocab = self.runner.base.get_input_embeddings().weight.shape[0]
        if self.draft_vocab < self.vocab // 2:
            raise UnsupportedModelError(
                f"the draft model's vocabulary ({self.draft_vocab}) is not the target's "
                f"({self.vocab}); a draft model must share the target's tokenizer.")
        self.tables = GroupedTables(self.runner.pool.blocks, self.runner.groups,
                                    target.max_num_seqs)
        self.budget = budget  # tokens per catch-up forward
        rows = target.max_num_seqs
        self.owner: list[int | None] = [None] * rows  # seq_id whose K/V a row holds
        self.base: list[int] = [0] * rows  # tokens known before its last drafts
        self.drafted: list[list[int]] = [[] for _ in range(rows)]  # drafts with K/V in it

    def propose(self, seqs: list[Sequence], ks: list[int],
                running: list[Sequence]) -> list[list[int]]:
        self.release(running)
        limit = self.runner.max_model_len
        chosen = self._fit([(s, k) for s, k in zip(seqs, ks) if s.num_tokens + k <= limit])
        if not chosen:
            return [[] for _ in seqs]
        f = Forward(None)  # catching up, through the newest token (its logits: draft 1)
        for seq, _, start, end in chosen:
            f.rows.append(seq.row)
            f.context.append(start)
            f.counts.append(end - start)
            f.ids += seq.tokens(start, end)
            f.positions += range(start, end)
            f.last.append(len(f.ids) - 1)
        caught_up = []  # (sequence, k, its first draft)
        for (seq, k, _, end), first in zip(chosen, self._greedy(f)):
            if end == seq.num_tokens:
                caught_up.append((seq, k, first))
            else:  # a chunk of its catch-up: no draft yet
                self.base[seq.row], self.drafted[seq.row] = end, []
        chosen, drafts = caught_up, [[first] for _, _, first in caught_up]
        for j in range(1, max((k for _, k, _ in chosen), default=0)):  # a token at a time
            going = [i for i, (_, k, _) in enumerate(chosen) if k > j]
            f = Forward(None)
            for i in going:
                seq = chosen[i][0]
                f.rows.append(seq.row)
                f.context.append(seq.num_tokens + j - 1)
                f.counts.append(1)
                f.ids.append(drafts[i][-1])
                f.positions.append(seq.num_tokens + j - 1)
                f.last.append(len(f.ids) - 1)
            for i, token in zip(going, self._greedy(f)):
                drafts[i].append(token)
        by_seq = {}
        for (seq, _, _), draft in zip(chosen, drafts):
            self.base[seq.row] = seq.num_tokens
            self.drafted[seq.row] = draft[:-1]  # the last draft was never fed back
            by_seq[seq.seq_id] = draft
        return [by_seq.get(seq.seq_id, []) for seq in seqs]

    def release(self, running: list[Sequence]) -> None:
        """Gives back the rows of sequences no longer running (ended, aborted, preempted),
        before a proposal and after each step, so that no finished sequence holds blocks."""
        live = {seq.row: seq.seq_id for seq in running}
        for row, owner in enumerate(self.owner):
            if owner is not None and live.get(row) != owner:
                self._free(row)

    def _valid(self, seq: Sequence) -> int:
        """Tokens of `seq` whose K/V the draft's row holds: those before its last drafts
        and the drafts the target kept (the row is trimmed to them)."""
        row = seq.row
        if self.owner[row] != seq.seq_id:
            self.owner[row], self.base[row], self.drafted[row] = seq.seq_id, 0, []
            return 0
        base, drafted = self.base[row], self.drafted[row]
        kept = seq.tokens(base, min(base + len(drafted), seq.num_tokens))
        n = 0
        while n < len(kept) and kept[n] == drafted[n]:
            n += 1
        valid = min(base + n, seq.num_tokens - 1, self.tables.lengths[row])
        self.tables.truncate_row(row, valid)
        return valid

    def _fit(self, pairs: list) -> list[tuple]:
        """(sequence, k, tokens its row holds, tokens it will hold after the catch-up) for
        those whose catch-up (whole, or the chunk the token budget leaves) and drafts fit in
        the draft's pool now; room is made for them."""
        counts = [0] * self.tables.num_rows
        chosen = []
        free, budget = self.runner.pool.blocks.num_free, self.budget
        narrow = self.draft_vocab < self.vocab  # (embeddings padded to another size)
        for seq, k in pairs:
            if budget == 0:
                break
            start = self._valid(seq)
            end = min(seq.num_tokens, start + budget)
            if narrow and max(seq.tokens(start, end)) >= self.draft_vocab:
                continue  # a token the draft cannot embed: this sequence goes undrafted
            counts[seq.row] = end - start + (k - 1 if end == seq.num_tokens else 0)
            if self.tables.blocks_needed(counts) > free:
                counts[seq.row] = 0  # (its row keeps what it holds)
                continue
            budget -= end - start
            chosen.append((seq, k, start, end))
        plan = self.tables.append(counts)
        assert not plan.copies  # rows never share blocks here: nothing to copy on write
        self.runner.device_table.apply(plan.entries)
        return chosen

    def _greedy(self, f: Forward) -> list[int]:
        logits = self.runner.forward(f)
        return logits[:, :self.vocab].argmax(-1).tolist()

    def _free(self, row: int) -> None:
        self.tables.free_row(row)
        self.owner[row], self.base[row], self.drafted[row] = None, 0, []
