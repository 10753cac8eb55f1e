"""`BlockDrafter`: a DFlash-style block drafter proposes up to B - 1 tokens in one forward (DESIGN §5).

It reads the outputs of a few target layers (`target_layers`; the runner returns them beside the final hidden
states, from the same pass, so no extra target pass runs) for every committed row (`observe`), and keeps per
sequence the keys and values its layers project from them: the context, positions `start..end-1`, append-only
(a sliding-window layer keeps only its window). To propose for a sequence whose context ends at n - 1 (the
target's row n - 1 gave the last sampled token t_n), it runs the block [t_n, mask, ..., mask] at positions
n..n+B-1 against that context, batched over sequences; block position i predicts the token at n + i. Greedy
requests take the argmax at each position; sampled ones draw each position from its own processed distribution
q_i with a per-sequence seeded generator (the positions are drawn independently, which rejection sampling
allows: each token comes from the q it reports). A request under a structured-output constraint picks its
positions one after another, each masked by the constraint stepped past the drafts before it (as the draft
model and MTP do), so its drafts are never cut for breaking the constraint. The block's own keys and values
are never stored, so rejected drafts leave nothing to undo; a rollback (`on_commit` with a shorter context)
cuts the context.

Features arrive as views of the pass's outputs; they are copied on arrival and projected at the next `propose`
(or once more than `PENDING_ROWS` are waiting), for all waiting sequences in one batch. A sequence that resumed
from a prefix checkpoint, whose prefix the target did not recompute, starts its context at its first computed row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deltaspec.model.block_drafter import BlockDrafterModel
from deltaspec.model.hybrid import HybridModel
from deltaspec.spec.draft_model import as_drafts, pick_drafts
from deltaspec.spec.drafter import Draft, DraftRequest

PENDING_ROWS = 1024  # feature rows held before they are projected into the contexts


@dataclass
class LayerContext:
    """One draft layer's context keys and values: positions `first`.. at rows 0.. of a buffer that grows by
    doubling. A sliding-window layer (`window`) keeps only what its queries can still see: when it would hold more
    than twice its window, it drops all but the last `window` positions (its buffer stays at 2 x window rows)."""

    window: int | None
    first: int = 0
    rows: int = 0
    keys: torch.Tensor | None = None  # [capacity, kv_heads, head_dim]
    values: torch.Tensor | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Add the keys and values [n, kv_heads, head_dim] of the next n positions."""
        if self.window is not None and self.rows + k.shape[0] > 2 * self.window:
            excess = self.rows + k.shape[0] - self.window  # the oldest positions, old rows first
            old = min(excess, self.rows)
            if old:
                self.keys[: self.rows - old] = self.keys[old : self.rows].clone()
                self.values[: self.rows - old] = self.values[old : self.rows].clone()
            self.first, self.rows = self.first + excess, self.rows - old
            k, v = k[excess - old :], v[excess - old :]
        n = k.shape[0]
        if self.keys is None or self.rows + n > self.keys.shape[0]:
            capacity = max(2 * (self.rows + n), 64) if self.window is None else 2 * self.window
            self.keys, self.values = self._grown(self.keys, k, capacity), self._grown(self.values, v, capacity)
        self.keys[self.rows : self.rows + n] = k
        self.values[self.rows : self.rows + n] = v
        self.rows += n

    def _grown(self, old: torch.Tensor | None, like: torch.Tensor, capacity: int) -> torch.Tensor:
        """A buffer of `capacity` rows shaped like `like`'s rows, holding the first `rows` rows of `old`."""
        buffer = like.new_empty((capacity, *like.shape[1:]))
        if old is not None:
            buffer[: self.rows] = old[: self.rows]
        return buffer

    def truncate(self, end: int) -> None:
        """Forget positions from `end` on."""
        self.rows = min(self.rows, max(end - self.first, 0))

    def nbytes(self) -> int:
        return 0 if self.keys is None else 2 * self.keys.numel() * self.keys.element_size()


@dataclass
class Context:
    """One sequence's context: positions start..end-1 observed, and per draft layer their keys and values (a
    sliding-window layer only its window's)."""

    start: int
    layers: list[LayerContext]
    end: int = field(init=False)

    def __post_init__(self) -> None:
        self.end = self.start
        for layer in self.layers:
            layer.first = self.start

    def append(self, layer_kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Add the next rows' keys and values (per layer, [n, kv_heads, head_dim] each)."""
        for layer, (k, v) in zip(self.layers, layer_kv):
            layer.append(k, v)
        self.end += layer_kv[0][0].shape[0]

    def truncate(self, end: int) -> None:
        self.end = min(self.end, end)
        for layer in self.layers:
            layer.truncate(end)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer i's keys and values [rows, kv_heads, head_dim] and their positions [rows]."""
        held = self.layers[i]
        positions = torch.arange(held.first, held.first + held.rows, device=held.keys.device)
        return held.keys[: held.rows], held.values[: held.rows], positions

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)


class BlockDrafter:
    name = "block"
    needs_hidden = True

    def __init__(self, net: BlockDrafterModel, target: HybridModel, device: torch.device, seed: int):
        self.net, self.target, self.device, self.seed = net, target, device, seed
        self.block_size = net.config.block_size
        self.target_layers = net.config.target_layer_ids  # observe() receives these layers' outputs side by side
        self.windows = net.config.sliding_window  # per draft layer: how far back its queries see (None: all)
        self.contexts: dict[str, Context] = {}
        self.pending: dict[str, list[tuple[int, torch.Tensor]]] = {}  # (first position, features [n, taps * H])
        self.generators: dict[str, torch.Generator] = {}

    def observe(self, seq_id: str, first_position: int, hidden: torch.Tensor) -> None:
        """The target layers' outputs [n, taps * H] of committed rows at positions first_position.. (projected at
        the next proposal, or at once when the pending rows pass `PENDING_ROWS`: prompt chunks arrive before a
        sequence first drafts, and a long prompt's features would otherwise pile up)."""
        self.pending.setdefault(seq_id, []).append((first_position, hidden.clone()))
        if sum(f.shape[0] for arrivals in self.pending.values() for _, f in arrivals) > PENDING_ROWS:
            self._absorb()

    def _absorb(self) -> None:
        """Project every pending feature row into its sequence's context, in one batch."""
        work = []  # (context, features, first position)
        for seq_id, arrivals in self.pending.items():
            first, features = arrivals[0]
            for later, rows in arrivals[1:]:  # one run of rows per sequence; a later arrival wins where they overlap
                if first <= later <= first + features.shape[0]:
                    features = torch.cat((features[: later - first], rows))
                else:
                    first, features = later, rows
            ctx = self.contexts.get(seq_id)
            if ctx is None or first < ctx.start or first > ctx.end:  # new, recomputed, or past a gap
                ctx = self.contexts[seq_id] = Context(first, [LayerContext(w) for w in self.windows])
            elif first < ctx.end:  # rows recomputed after a rollback
                ctx.truncate(first)
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
            if req.max_tokens == 0 or ctx is None or ctx.end < n or ctx.end == ctx.start:
                continue  # nothing to draft, or context rows it was not shown
            ctx.truncate(n)  # rows past the anchor belong to a longer, rolled-back context
            live.append((req, ctx, n, min(req.max_tokens, width - 1)))
        drafts: dict[str, tuple[list[int], list[torch.Tensor]]] = {}
        if live:
            mask = self.net.config.mask_token_id
            ids = [t for req, *_ in live for t in [req.token_ids[-1]] + [mask] * (width - 1)]
            positions = [p for _, _, n, _ in live for p in range(n, n + width)]
            with torch.inference_mode():
                embeds = self.target.model.embed_tokens(torch.tensor(ids, device=self.device))  # [S * B, H]
                layers = [[ctx.layer(i) for _, ctx, _, _ in live] for i in range(self.net.config.num_layers)]
                hidden = self.net(
                    embeds,
                    torch.tensor(positions, device=self.device),
                    [[(k, v) for k, v, _ in layer] for layer in layers],
                    [[p for _, _, p in layer] for layer in layers],
                )  # [S * B, H]
                rows = [s * width + i for s, (*_, k) in enumerate(live) for i in range(1, k + 1)]
                logits = self.target.compute_logits(hidden[torch.tensor(rows, device=self.device)])  # [rows, V]
            spans, first = [], 0  # (request, its first logits row, draft length)
            for req, *_, k in live:
                spans.append((req, first, k))
                first += k
            free = [span for span in spans if span[0].constraint is None]
            if free:  # every position of every unconstrained block picked at once
                if len(free) < len(spans):
                    rows_of = [start + i for _, start, k in free for i in range(k)]
                    logits_free = logits[torch.tensor(rows_of, device=self.device)]
                else:
                    logits_free = logits
                flat = [req for req, _, k in free for _ in range(k)]
                tokens, probs = pick_drafts(flat, logits_free, self.generators, self.seed, self.device, False)
                at = 0
                for req, _, k in free:
                    drafts[req.seq_id] = (tokens[at : at + k], list(probs[at : at + k]))
                    at += k
            for req, start, k in spans:
                if req.constraint is not None:  # position by position, masked by the constraint after the drafts
                    rows_k = [logits[start + i : start + i + 1] for i in range(k)]
                    picked = [pick_drafts([req], row, self.generators, self.seed, self.device, True) for row in rows_k]
                    drafts[req.seq_id] = ([tokens[0] for tokens, _ in picked], [probs[0] for _, probs in picked])
        return as_drafts(requests, drafts)

    def on_commit(self, seq_id: str, accepted: int, num_tokens: int) -> None:
        """The context keeps only positions the target has computed (< num_tokens - 1)."""
        limit = num_tokens - 1
        ctx = self.contexts.get(seq_id)
        if ctx is not None and ctx.end > limit:
            if limit <= ctx.start:
                del self.contexts[seq_id]
            else:
                ctx.truncate(limit)
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
