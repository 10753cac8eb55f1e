"""`MTPDrafter`: the checkpoint's own MTP head drafts, chained k steps (DESIGN §1, §5).

MTP row i reads the target's final hidden state h_i and the token t_{i+1} at position i; its own
attention layer keeps a KV cache in the target's pages (one extra KV layer, same block table). The
engine hands the drafter the hidden states of every committed row (`observe`). To propose for a
sequence whose last committed position is n-1 (the target's row n-1 produced the last sampled token
t_n), the drafter first runs the MTP rows it has not run yet, up to (t_n, h_{n-1}); the last one
gives draft 1. Draft j+1 comes from the row (draft j, MTP hidden of draft j) at position n-1+j: the
head is chained on its own output. Those chained rows are never committed: their KV entries sit
past the committed length and are overwritten by the next catch-up, so rollback costs nothing. A
sequence that ran no rows since its last proposal (the pass had no room for it) drafts again from the
MTP hidden state of its last committed row, which the drafter keeps.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deltaspec.cache.manager import CacheManager
from deltaspec.errors import DeltaspecError
from deltaspec.execution.sequence import Sequence
from deltaspec.model.forward_batch import ForwardBatch
from deltaspec.model.hybrid import HybridModel
from deltaspec.ops.layout import SeqLayout
from deltaspec.spec.draft_model import as_drafts, pick_drafts
from deltaspec.spec.drafter import Draft, DraftRequest


class MTPDrafter:
    name = "mtp"
    needs_hidden = True

    def __init__(
        self,
        model: HybridModel,
        cache: CacheManager,
        lookup: Callable[[str], Sequence],
        device: torch.device,
        seed: int,
    ):
        if model.mtp is None:
            raise DeltaspecError(
                "The checkpoint has no MTP head (mtp.* tensors); use speculative='ngram' or 'draft' instead."
            )
        self.model, self.cache, self.lookup, self.device, self.seed = model, cache, lookup, device, seed
        self.hidden: dict[str, dict[int, torch.Tensor]] = {}  # committed target hidden states by position
        self.done: dict[str, int] = {}  # MTP rows run (and committed) per sequence: positions 0..done-1
        self.heads: dict[str, torch.Tensor] = {}  # [1, H] MTP hidden of each sequence's last committed row
        self.generators: dict[str, torch.Generator] = {}

    def observe(self, seq_id: str, first_position: int, hidden: torch.Tensor) -> None:
        """The target's final hidden states [n, H] of committed rows at positions first_position.."""
        if seq_id not in self.done or first_position < self.done[seq_id]:
            # a new, recomputed or resumed sequence: its MTP rows start here (a sequence resumed from a prefix
            # checkpoint finds the MTP cache of the prefix in the pages it shares with the checkpoint)
            self.hidden[seq_id], self.done[seq_id] = {}, first_position
        rows = self.hidden.setdefault(seq_id, {})
        for j in range(hidden.shape[0]):
            rows[first_position + j] = hidden[j]

    def _run(self, rows: list[tuple[Sequence, list[int], list[int], torch.Tensor]]) -> torch.Tensor:
        """MTP rows (seq, tokens, positions, hidden [n, H]) for several sequences -> MTP hidden of each
        sequence's last row [len(rows), H]."""
        bs = self.cache.block_size
        token_ids, positions, slots, hidden, tables, lens, ctx = [], [], [], [], [], [], []
        for seq, toks, pos, h in rows:
            token_ids += toks
            positions += pos
            slots += seq.cache.kv_slots(pos, bs)
            hidden.append(h)
            tables.append(seq.cache.blocks)
            lens.append(len(toks))
            ctx.append(pos[-1] + 1)

        def tensor(values):
            return torch.tensor(values, dtype=torch.long, device=self.device)

        layout = SeqLayout.build(lens, ctx, [0] * len(rows), self.device, block_tables=tables)
        batch = ForwardBatch(tensor(token_ids), tensor(positions), tensor(slots), layout)
        with torch.inference_mode():
            out = self.model.mtp_forward(batch, torch.cat(hidden), self.cache.caches)
        return out[batch.last_row_indices]

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        live = [r for r in requests if r.max_tokens > 0]
        drafts: dict[str, tuple[list[int], list[torch.Tensor]]] = {r.seq_id: ([], []) for r in live}
        catch_up, starts = [], []  # starts: (request, sequence, position of its last MTP row, that row's hidden)
        for req in live:
            seq, n = self.lookup(req.seq_id), len(req.token_ids) - 1
            start, seen = self.done.get(req.seq_id, 0), self.hidden.get(req.seq_id, {})
            positions = list(range(start, n))
            unseen = any(p not in seen for p in positions)
            if (
                unseen
                or (not positions and req.seq_id not in self.heads)
                or not self.cache.reserve(seq.cache, n + req.max_tokens + 1)
            ):
                drafts.pop(req.seq_id)  # hidden states it was never shown (after a reset), or no pages: no draft
            elif positions:
                tokens = [req.token_ids[p + 1] for p in positions]
                catch_up.append((req, seq, tokens, positions, torch.stack([seen[p] for p in positions])))
                self.done[req.seq_id], self.hidden[req.seq_id] = n, {}
            else:  # it ran no rows since its last proposal: draft again from the same row
                starts.append((req, seq, n - 1, self.heads[req.seq_id]))
        if catch_up:
            heads = self._run([(seq, tokens, pos, h) for _, seq, tokens, pos, h in catch_up])
            for j, (req, seq, _, pos, _) in enumerate(catch_up):
                self.heads[req.seq_id] = heads[j : j + 1]
                starts.append((req, seq, pos[-1], self.heads[req.seq_id]))
        active = [(req, seq, last) for req, seq, last, _ in starts]
        mtp_hidden = torch.cat([head for *_, head in starts]) if starts else None
        while active:
            reqs = [req for req, _, _ in active]
            tokens, probs = pick_drafts(
                reqs,
                self.model.compute_logits(mtp_hidden),
                self.generators,
                self.seed,
                self.device,
                follow_constraints=True,
            )
            for j, req in enumerate(reqs):
                drafts[req.seq_id][0].append(tokens[j])
                drafts[req.seq_id][1].append(probs[j])
            keep = [j for j, req in enumerate(reqs) if len(drafts[req.seq_id][0]) < req.max_tokens]
            active = [(active[j][0], active[j][1], active[j][2] + 1) for j in keep]
            if active:
                mtp_hidden = self._run(
                    [(seq, [tokens[j]], [last], mtp_hidden[j : j + 1]) for j, (_, seq, last) in zip(keep, active)]
                )
        return as_drafts(requests, drafts)

    def on_commit(self, seq_id: str, accepted: int, num_tokens: int) -> None:
        """Nothing to undo: chained rows sit past the committed length and are overwritten."""

    def on_finish(self, seq_id: str) -> None:
        self.hidden.pop(seq_id, None)
        self.done.pop(seq_id, None)
        self.heads.pop(seq_id, None)
        self.generators.pop(seq_id, None)

    def state_bytes(self) -> int:
        held = [h for rows in self.hidden.values() for h in rows.values()] + list(self.heads.values())
        return sum(h.numel() * h.element_size() for h in held)
