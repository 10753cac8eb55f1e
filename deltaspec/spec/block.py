"""`BlockDrafter`: a DFlash-style block drafter proposes up to B - 1 tokens in one forward (DESIGN §5).

It reads the outputs of a few target layers (`target_layers`; the runner returns them beside the final
hidden states, from the same pass, so no extra target pass runs) for every committed row (`observe`), and
keeps per sequence the keys and values its layers project from them: the context, positions
`start..end-1`, append-only. To propose for a sequence whose context ends at n - 1 (the target's row n - 1
gave the last sampled token t_n), it runs the block [t_n, mask, ..., mask] at positions n..n+B-1 against
that context, batched over sequences; block position i predicts the token at n + i. Greedy requests take
the argmax at each position; sampled ones draw each position from its own processed distribution q_i with
a per-sequence seeded generator (the positions are drawn independently, which rejection sampling allows:
each token comes from the q it reports). The block's own keys and values are never stored, so rejected
drafts leave nothing to undo; a rollback (`on_commit` with a shorter context) cuts the context.

Features arrive as views of the pass's outputs; they are copied on arrival and projected at the next
`propose`, for all sequences in one batch. A sequence that resumed from a prefix checkpoint, whose prefix
the target did not recompute, starts its context at its first computed row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deltaspec.model.block_drafter import BlockDrafterModel
from deltaspec.model.hybrid import HybridModel
from deltaspec.spec.draft_model import as_drafts, pick_drafts
from deltaspec.spec.drafter import Draft, DraftRequest


@dataclass
class Context:
    """One sequence's context: per layer, keys and values of positions start..start+length-1 at rows 0..length-1
    of buffers that grow by doubling."""

    start: int
    length: int = 0
    keys: list[torch.Tensor] = field(default_factory=list)  # per layer [capacity, kv_heads, head_dim]
    values: list[torch.Tensor] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + self.length

    def append(self, layer_kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Add the next rows' keys and values (per layer, [n, kv_heads, head_dim] each)."""
        n = layer_kv[0][0].shape[0]
        if not self.keys or self.length + n > self.keys[0].shape[0]:
            capacity = max(2 * (self.length + n), 64)
            self.keys = self._grown(self.keys, [k for k, _ in layer_kv], capacity)
            self.values = self._grown(self.values, [v for _, v in layer_kv], capacity)
        for buffer, (k, _) in zip(self.keys, layer_kv):
            buffer[self.length : self.length + n] = k
        for buffer, (_, v) in zip(self.values, layer_kv):
            buffer[self.length : self.length + n] = v
        self.length += n

    def _grown(self, old: list[torch.Tensor], new: list[torch.Tensor], capacity: int) -> list[torch.Tensor]:
        """Buffers of `capacity` rows shaped like `new`'s rows, holding the first `length` rows of `old`."""
        buffers = [t.new_empty((capacity, *t.shape[1:])) for t in new]
        for buffer, kept in zip(buffers, old):
            buffer[: self.length] = kept[: self.length]
        return buffers

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[i][: self.length], self.values[i][: self.length]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


class BlockDrafter:
    name = "block"
    needs_hidden = True

    def __init__(self, net: BlockDrafterModel, target: HybridModel, device: torch.device, seed: int):
        self.net, self.target, self.device, self.seed = net, target, device, seed
        self.block_size = net.config.block_size
        self.target_layers = net.config.target_layer_ids  # observe() receives these layers' outputs side by side
        self.contexts: dict[str, Context] = {}
        self.pending: dict[str, list[tuple[int, torch.Tensor]]] = {}  # (first position, features [n, taps * H])
        self.generators: dict[str, torch.Generator] = {}

    def observe(self, seq_id: str, first_position: int, hidden: torch.Tensor) -> None:
        """The target layers' outputs [n, taps * H] of committed rows at positions first_position.."""
        self.pending.setdefault(seq_id, []).append((first_position, hidden.clone()))

    def _absorb(self) -> None:
        """Project every pending feature row into its sequence's context, in one batch."""
        work = []  # (context, features, first position)
        for seq_id, arrivals in self.pending.items():
            for first, features in arrivals:
                ctx = self.contexts.get(seq_id)
                if ctx is None or first < ctx.start or first > ctx.end:  # new, recomputed, or past a gap
                    ctx = self.contexts[seq_id] = Context(first)
                elif first < ctx.end:  # rows recomputed after a rollback
                    ctx.length = first - ctx.start
                work.append((ctx, features, first))
        self.pending.clear()
        if not work:
            return
        features = torch.cat([f for _, f, _ in work])  # [rows, taps * H]
        positions = torch.cat([torch.arange(p, p + f.shape[0], device=self.device) for _, f, p in work])
        with torch.inference_mode():
            layer_kv = self.net.context_keys_values(features, positions)  # per layer ([rows, kvh, d], [rows, kvh, d])
        lo = 0
        for ctx, f, _ in work:
            hi = lo + f.shape[0]
            ctx.append([(k[lo:hi], v[lo:hi]) for k, v in layer_kv])
            lo = hi

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        self._absorb()
        width = self.block_size
        live = []  # (request, context, anchor position, draft length)
        for req in requests:
            n, ctx = len(req.token_ids) - 1, self.contexts.get(req.seq_id)
            if req.max_tokens == 0 or ctx is None or ctx.end < n or ctx.length == 0:
                continue  # nothing to draft, or context rows it was not shown
            ctx.length = n - ctx.start  # rows past the anchor belong to a longer, rolled-back context
            live.append((req, ctx, n, min(req.max_tokens, width - 1)))
        drafts: dict[str, tuple[list[int], list[torch.Tensor]]] = {}
        if live:
            mask = self.net.config.mask_token_id
            ids = [t for req, *_ in live for t in [req.token_ids[-1]] + [mask] * (width - 1)]
            positions = [p for _, _, n, _ in live for p in range(n, n + width)]
            with torch.inference_mode():
                embeds = self.target.model.embed_tokens(torch.tensor(ids, device=self.device))  # [S * B, H]
                hidden = self.net(
                    embeds,
                    torch.tensor(positions, device=self.device),
                    [[ctx.layer(i) for _, ctx, _, _ in live] for i in range(self.net.config.num_layers)],
                    [torch.arange(ctx.start, ctx.end, device=self.device) for _, ctx, _, _ in live],
                )  # [S * B, H]
                rows = [s * width + i for s, (*_, k) in enumerate(live) for i in range(1, k + 1)]
                logits = self.target.compute_logits(hidden[torch.tensor(rows, device=self.device)])  # [rows, V]
            flat = [req for req, *_, k in live for _ in range(k)]
            # all positions at once, so not masked position by position: the Speculator cuts refused drafts
            tokens, probs = pick_drafts(flat, logits, self.generators, self.seed, self.device, follow_constraints=False)
            lo = 0
            for req, *_, k in live:
                drafts[req.seq_id] = (tokens[lo : lo + k], list(probs[lo : lo + k]))
                lo += k
        return as_drafts(requests, drafts)

    def on_commit(self, seq_id: str, accepted: int, num_tokens: int) -> None:
        """The context keeps only positions the target has computed (< num_tokens - 1)."""
        limit = num_tokens - 1
        ctx = self.contexts.get(seq_id)
        if ctx is not None and ctx.end > limit:
            if limit <= ctx.start:
                del self.contexts[seq_id]
            else:
                ctx.length = limit - ctx.start
        arrivals = self.pending.get(seq_id)
        if arrivals:
            self.pending[seq_id] = [(p, f[: limit - p]) for p, f in arrivals if p < limit]

    def on_finish(self, seq_id: str) -> None:
        self.contexts.pop(seq_id, None)
        self.pending.pop(seq_id, None)
        self.generators.pop(seq_id, None)

    def state_bytes(self) -> int:
        held = sum(ctx.nbytes() for ctx in self.contexts.values())
        return held + sum(f.numel() * f.element_size() for arrivals in self.pending.values() for _, f in arrivals)
