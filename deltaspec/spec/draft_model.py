"""`DraftModelDrafter`: a separate small model with the target's tokenizer drafts autoregressively.

The drafter owns the draft model and its caches (paged KV + GDN state slots), one sequence slot
per target sequence. To propose for a sequence it first catches up on the tokens the target
committed since its last call (in one ragged forward for all sequences), snapshots the slot's GDN
states (the committed point), then drafts k tokens one pass at a time: greedy when the request
is greedy, else sampled from the draft distribution q (temperature / top-k / top-p / min-p of the
request, with the drafter's own seeded generator; within the request's structured-output constraint when it
has one) and returned as `probs` for lossless
verification (seeded from the request's seed, so a configuration and seed give the same output
every time). On commit the slot's states go back to the snapshot and the accepted tokens are
caught up next time, so rejected drafts leave no trace; KV rows past the committed length are
simply overwritten later.
"""

from __future__ import annotations

import functools
import zlib
from pathlib import Path
from typing import Any

import torch

from deltaspec.cache.manager import CacheManager
from deltaspec.config.cache_spec import CacheSpec
from deltaspec.config.model import ModelConfig
from deltaspec.errors import DeltaspecError
from deltaspec.execution.batch import Scheduled, build_batch
from deltaspec.execution.request import Request
from deltaspec.execution.sequence import Sequence
from deltaspec.model.gguf_load import load_gguf_model
from deltaspec.model.hf_config import parse_model_config, read_config_json
from deltaspec.model.weights import load_model
from deltaspec.ops.dispatch import ops_for
from deltaspec.sample.params import SamplingParams
from deltaspec.sample.sampler import make_generator, processed_probs, sample
from deltaspec.sample.structured import mask_next
from deltaspec.spec.drafter import Draft, DraftRequest

GREEDY = SamplingParams(temperature=0.0)
UNPROCESSED = SamplingParams()  # the softmax of the logits
DRAFT_SEED_SALT = 0x5EED_D2AF  # the draft stream of a seeded request differs from the target's own stream


def pick_drafts(
    reqs: list[DraftRequest],
    logits: torch.Tensor,
    generators: dict[str, torch.Generator],
    seed: int,
    device: torch.device,
    follow_constraints: bool,
) -> tuple[list[int], torch.Tensor]:
    """One draft token per request from its logits [len(reqs), V]: greedy for greedy requests and for requests
    drafting for a tree (`DraftRequest.candidates`), else drawn from the processed distribution q with a
    per-sequence generator seeded from the request's seed. With
    `follow_constraints` (the requests are distinct sequences at their next drafting position), a constrained
    request's logits are masked first and its constraint steps past the picked token. Returns the tokens and
    q [len(reqs), V]."""
    constraints = [r.constraint if follow_constraints else None for r in reqs]
    tokens, probs = _pick(reqs, mask_next(logits, constraints), generators, seed, device)
    for constraint, token in zip(constraints, tokens):
        if constraint is not None:
            constraint.draft_step(token)
    return tokens, probs


def _pick(
    reqs: list[DraftRequest],
    logits: torch.Tensor,
    generators: dict[str, torch.Generator],
    seed: int,
    device: torch.device,
) -> tuple[list[int], torch.Tensor]:
    """Tokens and the distributions they come from. A request drafting for a tree takes its argmax, and its row of
    q is the distribution its candidates come from: the processed one when it samples, the softmax when greedy."""
    params = [r.params or GREEDY for r in reqs]
    choose = [GREEDY if r.candidates else p for r, p in zip(reqs, params)]
    spread = [UNPROCESSED if r.candidates and p.greedy else p for r, p in zip(reqs, params)]
    gens = [
        None
        if p.greedy
        else generators.setdefault(
            r.seq_id,
            make_generator(
                DRAFT_SEED_SALT ^ (p.seed if p.seed is not None else zlib.crc32(r.seq_id.encode()) ^ seed), device
            ),
        )
        for r, p in zip(reqs, choose)
    ]
    return sample(logits, choose, gens).tolist(), processed_probs(logits, spread)


def as_drafts(requests: list[DraftRequest], drafts: dict[str, tuple[list[int], list[torch.Tensor]]]) -> list[Draft]:
    """One `Draft` per request from the tokens and q rows picked for it: q for sampled requests, or for a request
    drafting for a tree the top `candidates` of each row."""
    out = []
    for req in requests:
        tokens, probs = drafts.get(req.seq_id, ([], []))
        if req.candidates and probs:
            top = torch.stack(probs).topk(min(req.candidates, probs[0].shape[-1]), dim=-1)
            candidates = [list(zip(ids, ps)) for ids, ps in zip(top.indices.tolist(), top.values.tolist())]
            out.append(Draft(tokens=tokens, candidates=candidates))
            continue
        sampled = req.params is not None and not req.params.greedy
        out.append(Draft(tokens=tokens, probs=torch.stack(probs) if sampled and probs else None))
    return out


def draft_checkpoint(path: Path) -> tuple[dict, ModelConfig, Any]:
    """The draft model at `path` (a checkpoint directory or a GGUF file): its raw config, parsed config and, for
    a GGUF file, the file's contents (a `GGUFCheckpoint`; None for a directory)."""
    if path.suffix == ".gguf":
        stat = path.stat()
        checkpoint = _read_gguf(str(path.resolve()), stat.st_mtime_ns, stat.st_size)
        return checkpoint.config, parse_model_config(checkpoint.config), checkpoint
    raw = read_config_json(path)
    return raw, parse_model_config(raw), None


@functools.lru_cache(maxsize=1)
def _read_gguf(path: str, mtime_ns: int, size: int) -> Any:
    """The GGUF file at `path` as it is at (`mtime_ns`, `size`): the memory planner reads a GGUF draft model and
    the drafter then loads it, so the last file read is kept (parsing a large vocabulary's metadata takes
    seconds); a file that changed is read again."""
    from deltaspec.model.gguf_file import read_gguf  # the gguf package is imported only for GGUF files

    return read_gguf(path)


class DraftModelDrafter:
    name = "draft"
    needs_hidden = False

    def __init__(
        self,
        model_dir: Path,
        target_vocab: int,
        cache: CacheSpec,
        seed: int,
    ):
        """The draft model at `model_dir`, with caches of `cache` (`CacheSpec.for_draft_model`)."""
        raw, self.config, gguf = draft_checkpoint(model_dir)
        if self.config.vocab_size != target_vocab:
            raise DeltaspecError(
                f"The draft model at {model_dir} has a vocabulary of {self.config.vocab_size} "
                f"tokens but the target has {target_vocab}; a draft model must share its tokenizer."
            )
        self.device = device = cache.device
        dtype = cache.dtype
        ops = ops_for(device)
        if gguf is not None:
            self.model = load_gguf_model(gguf, self.config, dtype, device, ops, progress=False, with_mtp=False)
        else:
            self.model = load_model(model_dir, self.config, raw, dtype, device, ops, progress=False, with_mtp=False)
        self.block_size = cache.block_size
        self.cache = CacheManager(self.config, self.model.num_kv_layers, cache)
        self.seqs: dict[str, Sequence] = {}
        self.snapshots: dict[str, tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]] = {}
        self.generators: dict[str, torch.Generator] = {}
        self.seed = seed

    def _sequence(self, req: DraftRequest) -> Sequence:
        self._restore(req.seq_id)  # drafts that were never verified (no commit came) are forgotten too
        seq = self.seqs.get(req.seq_id)
        if seq is not None and seq.cache.num_computed >= len(req.token_ids):  # the target went back: start over
            self.on_finish(req.seq_id)
            seq = None
        if seq is None:
            seq = Sequence(Request(req.seq_id, None, [], GREEDY, frozenset()))  # its tokens are output_ids
            self.cache.admit(seq.cache, seq.all_ids)
            self.seqs[req.seq_id] = seq
        seq.output_ids = list(req.token_ids)
        return seq

    def _forward(self, items: list[Scheduled]) -> torch.Tensor:
        """One pass of the draft model; logits of each item's last row [len(items), V]."""
        for item in items:
            if not self.cache.reserve(item.seq.cache, item.seq.cache.num_computed + item.num_rows):
                raise DeltaspecError(
                    "The draft model's KV cache is full; lower --draft-tokens or the number of streams."
                )
        batch = build_batch(items, self.block_size, self.device)
        with torch.inference_mode():
            hidden = self.model(batch, self.cache.caches)
            logits = self.model.compute_logits(hidden[batch.last_row_indices])
        for item in items:
            item.seq.cache.num_computed += item.num_rows
        return logits

    def _pick(self, reqs: list[DraftRequest], logits: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        return pick_drafts(reqs, logits, self.generators, self.seed, self.device, follow_constraints=True)

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        live = [r for r in requests if r.max_tokens > 0]
        drafts: dict[str, tuple[list[int], list[torch.Tensor]]] = {r.seq_id: ([], []) for r in live}
        if live:
            seqs = [self._sequence(r) for r in live]
            logits = self._forward([Scheduled(s, s.num_tokens - s.cache.num_computed) for s in seqs])
            for seq in seqs:  # the committed point: restored on commit
                slot = seq.cache.state_slot
                self.snapshots[seq.request.request_id] = (
                    seq.cache.num_computed,
                    [(st[slot].clone(), cv[slot].clone()) for st, cv in zip(self.cache.gdn.state, self.cache.gdn.conv)],
                )
            active = list(range(len(live)))
            while active:
                reqs = [live[i] for i in active]
                tokens, probs = self._pick(reqs, logits)
                for j, i in enumerate(active):
                    drafts[live[i].seq_id][0].append(tokens[j])
                    drafts[live[i].seq_id][1].append(probs[j])
                active = [i for i in active if len(drafts[live[i].seq_id][0]) < live[i].max_tokens]
                if active:
                    for i in active:
                        seqs[i].output_ids.append(drafts[live[i].seq_id][0][-1])
                    logits = self._forward([Scheduled(seqs[i], 1) for i in active])
        return as_drafts(requests, drafts)

    def observe(self, seq_id: str, first_position: int, hidden) -> None:
        """The draft model reads tokens, not the target's hidden states."""

    def on_commit(self, seq_id: str, accepted: int, num_tokens: int) -> None:
        self._restore(seq_id)

    def _restore(self, seq_id: str) -> None:
        """Back to the committed point of the last proposal: its states, its length."""
        seq = self.seqs.get(seq_id)
        if seq is None or seq_id not in self.snapshots:
            return
        committed, states = self.snapshots.pop(seq_id)
        slot = seq.cache.state_slot
        for (state, conv), st, cv in zip(states, self.cache.gdn.state, self.cache.gdn.conv):
            st[slot].copy_(state)
            cv[slot].copy_(conv)
        seq.cache.num_computed = committed  # the drafted rows are forgotten; accepted ones are caught up next time
        del seq.output_ids[committed:]

    def on_finish(self, seq_id: str) -> None:
        seq = self.seqs.pop(seq_id, None)
        if seq is not None:
            self.cache.release(seq.cache)
        self.snapshots.pop(seq_id, None)
        self.generators.pop(seq_id, None)

    def state_bytes(self) -> int:
        return self.cache.kv.bytes() + self.cache.gdn.bytes()
