"""Engine: loads a model and runs requests. `step()` = schedule -> execute -> update (DESIGN §3)."""

from __future__ import annotations

import itertools
import time
from dataclasses import replace
from pathlib import Path

import torch

from deltaspec.cache.manager import CacheManager
from deltaspec.config import EngineConfig, parse_dtype, resolve_engine_config
from deltaspec.engine.cuda_graphs import CudaGraphRunner
from deltaspec.engine.graph_buckets import graph_rows_of, uses_cuda_graphs
from deltaspec.engine.runner import Runner, StepOutput
from deltaspec.engine.scheduler import Scheduled, Scheduler
from deltaspec.engine.sequence import Sequence
from deltaspec.errors import DeltaspecError
from deltaspec.cache.memory_plan import MemoryPlan, plan_memory, require_fit, weight_bytes
from deltaspec.config import ModelConfig
from deltaspec.model.hf_config import checkpoint_dtype, parse_model_config, read_config_json
from deltaspec.model.tokenizer import BorrowedTokenizer, Tokenizer
from deltaspec.model.random_init import build_model, random_plan
from deltaspec.model.weights import checkpoint_files, count_mtp_layers, resolve_model_path, target_name
from deltaspec.ops.dispatch import ops_for
from deltaspec.sample.logprobs import gather_logprobs
from deltaspec.sample.params import SamplingParams
from deltaspec.sample.sampler import apply_penalties, make_generator, sample
from deltaspec.spec.drafter import DraftRequest
from deltaspec.spec.factory import make_drafter
from deltaspec.spec.policy import DraftLengthPolicy, VerifyCostTable
from deltaspec.spec.verify import verify_greedy_tokens, verify_sampling


ROUTED_WEIGHT_ELEMENTS = 1 << 22  # weights of at least 4 M elements get a measured GEMM route


def default_model_path() -> Path:
    """The embedded default model, shipped inside the package."""
    return Path(__file__).resolve().parent.parent / "default_model" / "target"


def model_dir_for(model: str | None) -> Path:
    """The checkpoint directory of `model`, or of the embedded default model when it is None."""
    if model is not None:
        return resolve_model_path(model)
    path = default_model_path()
    if not (path / "config.json").is_file():
        raise DeltaspecError("No model was given and the embedded default model is not installed; "
                             "pass a checkpoint directory or hub id with --model / LLM(model=...).")
    return path


def plan_for(config: EngineConfig) -> tuple[MemoryPlan, EngineConfig, ModelConfig, dict, Path | None]:
    """The memory plan of `config` (resolved), computed from the checkpoint's headers alone (or the shape's
    parameter count for --random-weights, which has no directory)."""
    if config.random_weights or config.shape is not None:
        return random_plan(config)
    model_dir = model_dir_for(config.model)
    raw = read_config_json(model_dir)
    model_config = parse_model_config(raw)
    resolved = resolve_engine_config(config, checkpoint_dtype(raw))
    files = checkpoint_files(model_dir)
    dtype, device = parse_dtype(resolved.dtype), torch.device(resolved.device)
    streams, ctx = resolved.max_num_seqs, resolved.max_model_len
    if resolved.num_kv_blocks:
        ctx = resolved.num_kv_blocks * resolved.block_size // streams
    plan = plan_memory(model_config, len(model_config.attention_layer_ids) + count_mtp_layers(files),
                       weight_bytes(files, dtype, skip=lambda name: target_name(name) is None), dtype,
                       parse_dtype(resolved.state_dtype), streams, ctx, resolved.block_size,
                       resolved.max_num_batched_tokens, resolved.prefill_chunk, device,
                       log_rows=resolved.log_rows, checkpoints=resolved.prefix_checkpoints,
                       graph_rows=graph_rows_of(resolved, model_config))
    return plan, resolved, model_config, raw, model_dir


def plain_greedy(seq: Sequence) -> bool:
    """The next token is the argmax of the raw logits: greedy, no penalties, no logprobs, min_tokens met."""
    p = seq.params
    return p.greedy and p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty \
        and p.logprobs is None and len(seq.output_ids) >= p.min_tokens


class Engine:
    def __init__(self, config: EngineConfig, progress: bool = True):
        self.plan, self.config, self.model_config, raw, model_dir = plan_for(config)
        require_fit(self.plan)
        self.model_dir = model_dir
        self.device = torch.device(self.config.device)
        self.dtype = parse_dtype(self.config.dtype)
        self.ops = ops_for(self.device, reference_only=self.config.kernels == "reference")
        self.model = build_model(self.config, model_dir, self.model_config, raw, self.dtype, self.device,
                                 self.ops, progress)
        self.tokenizer = Tokenizer.from_dir(model_dir) if model_dir is not None else self._borrowed_tokenizer()
        verify_costs = self._route_gemms(progress)
        self.max_model_len = self.config.max_model_len
        cfg = self.config
        num_blocks = cfg.num_kv_blocks or cfg.max_num_seqs * -(-cfg.max_model_len // cfg.block_size)
        self.cache = CacheManager(self.model_config, self.model.num_kv_layers, cfg.max_num_seqs, num_blocks,
                                  cfg.block_size, self.dtype, parse_dtype(cfg.state_dtype), self.device,
                                  log_rows=cfg.log_rows,
                                  checkpoint_slots=cfg.prefix_checkpoints,
                                  offload_bytes=int(cfg.prefix_offload_gib * 2 ** 30))
        self.scheduler = Scheduler(self.cache, cfg.max_num_batched_tokens, cfg.prefill_chunk,
                                   checkpoint_min_prompt=cfg.prefix_checkpoint_min_prompt)
        self.drafter = make_drafter(cfg, model_dir, self.model_config.vocab_size, self._mtp_drafter)
        self.draft_policy = DraftLengthPolicy(max_k=cfg.draft_tokens, table=verify_costs)
        self.runner = Runner(self.model, self.cache.caches, cfg.block_size, self.device, self._graph_runner(progress))
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None:
            eos |= self.tokenizer.eos_token_ids
        self.eos_ids = frozenset(eos)
        self._seed_counter = itertools.count(cfg.seed)

    def _borrowed_tokenizer(self) -> Tokenizer | None:
        """A random-weight model borrows the embedded model's tokenizer when its ids fit the shape's vocabulary
        (they fit every real shape), so the server and the text benchmarks run on it too; ids beyond the
        borrowed vocabulary decode as ids within it (`BorrowedTokenizer`)."""
        lent = Tokenizer.from_dir(default_model_path())
        if lent is None or lent.vocab_size > self.model_config.vocab_size:
            return None
        return BorrowedTokenizer.lend(lent)

    def _route_gemms(self, progress: bool) -> VerifyCostTable:
        """On CUDA in 16-bit precision with the Triton kernels, route every weight multiply by the device's
        measured skinny-GEMM table (DESIGN §6) and read the verify-cost table from the same measurements;
        elsewhere keep torch's matmul and the default cost estimate. Weights too small to be bandwidth-bound
        stay on torch's matmul without measuring; a model with no large weight keeps the default estimate."""
        if self.device.type != "cuda" or self.config.kernels == "reference" \
                or self.dtype not in (torch.bfloat16, torch.float16):
            return VerifyCostTable()
        from deltaspec.ops.gemm_routing import GemmRouter

        shapes = {shape: count for shape, count in self.model.linear_shapes().items()
                  if shape[0] * shape[1] >= ROUTED_WEIGHT_ELEMENTS}
        if not shapes:
            return VerifyCostTable()
        router = GemmRouter(shapes, self.dtype, self.device, show_progress=progress)
        self.ops = replace(self.ops, linear=router.linear)
        self.model.use_ops(self.ops)
        return VerifyCostTable(router.relative_costs(max(self.config.draft_tokens + 1, 2)))

    def _graph_runner(self, progress: bool) -> CudaGraphRunner | None:
        """CUDA graphs for decode and verify passes, where `uses_cuda_graphs` allows them."""
        cfg = self.config
        if not uses_cuda_graphs(self.device.type, cfg.enforce_eager, cfg.kernels, self.model_config.moe is not None):
            return None
        graphs = CudaGraphRunner(self.model, self.cache.caches, cfg.block_size, self.device, cfg.max_num_seqs,
                                 cfg.log_rows, cfg.max_model_len, self.cache.gdn.scratch_slot)
        graphs.capture_all(progress)
        return graphs

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise DeltaspecError(f"The checkpoint at {self.model_dir} has no tokenizer.json, so text prompts "
                                 "cannot be encoded; pass {'prompt_token_ids': [...]} instead.")
        return self.tokenizer.encode(text)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens)

    def new_sequence(self, request_id: str, prompt: str | None, prompt_ids: list[int],
                     params: SamplingParams) -> Sequence:
        """Validate a request and make its sequence (not yet scheduled); user errors raise DeltaspecError."""
        if not prompt_ids:
            raise DeltaspecError("The prompt is empty; give at least one token.")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise DeltaspecError(f"Prompt token ids must lie in [0, {vocab}); got one outside it.")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise DeltaspecError(
                f"The prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds the "
                f"context of {self.max_model_len} tokens; shorten the prompt, lower max_tokens, or raise --max-model-len.")
        seed = params.seed if params.seed is not None else next(self._seed_counter)
        return Sequence(request_id, prompt, list(prompt_ids), params, self.eos_ids,
                        generator=None if params.greedy else make_generator(seed, self.device))

    def add_request(self, request_id: str, prompt: str | None, prompt_ids: list[int],
                    params: SamplingParams) -> Sequence:
        seq = self.new_sequence(request_id, prompt, prompt_ids, params)
        self.scheduler.add(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        if not seq.finished:
            seq.finish_reason = "abort"
            seq.finish_time = time.perf_counter()
            self._finish(seq)

    def usage(self) -> dict:
        """Running and waiting sequences, KV pages and GDN state slots in use, and what prefix checkpoints hold
        (their pages count as cached, not used: eviction frees them)."""
        kv, gdn, prefix = self.cache.kv.allocator, self.cache.gdn, self.cache.prefix
        cached = prefix.pages_held_only_here() if prefix is not None else 0
        return {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "kv_blocks_used": kv.num_blocks - kv.num_free - cached, "kv_blocks_cached": cached,
                "kv_blocks_total": kv.num_blocks,
                "prefix_checkpoints": len(prefix.checkpoints) if prefix is not None else 0,
                "prefix_hits": prefix.hits if prefix is not None else 0,
                "state_slots_used": self.config.max_num_seqs - gdn.num_free,
                "state_slots_total": self.config.max_num_seqs, "preemptions": self.scheduler.num_preemptions,
                "steps": self.scheduler.step_count}

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[Sequence]:
        """One forward pass over every runnable sequence; returns the sequences that got a new token
        (those that finished have `finished` set)."""
        if self.drafter is not None:
            self._propose_drafts()
        schedule = self.scheduler.schedule()
        result = self.runner.execute(schedule)
        return self._update(schedule, result)

    def fail(self, seqs: list[Sequence], error: str) -> None:
        """End `seqs` with finish reason "error" and free their caches."""
        for seq in seqs:
            if not seq.finished:
                seq.finish_reason, seq.error = "error", error
                seq.finish_time = time.perf_counter()
                self._finish(seq)

    def _update(self, schedule: list[Scheduled], result: StepOutput) -> list[Sequence]:
        for i, logits in result.prompt_logits.items():
            self._record_prompt_logprobs(schedule[i], logits)
        before = [item.seq.num_computed for item in schedule]
        for item in schedule:
            seq = item.seq
            seq.num_computed += item.num_rows
            seq.pending_fold = 0  # this pass replayed it
            if seq.checkpoint_at and seq.checkpoint_at[0] == seq.num_computed and not seq.draft:
                self.cache.checkpoint(seq, seq.checkpoint_at.pop(0))
        for i in result.logged:
            schedule[i].seq.pending_fold = 1  # its one row ran as a verify row; fold it next pass
        updated = self._commit_verified(schedule, result.verify_logits, result.greedy, result.row_starts)
        if getattr(self.drafter, "wants_hidden", False):
            for item, start, row in zip(schedule, before, result.row_starts):
                if not item.seq.finished:
                    committed = item.seq.num_computed - start
                    self.drafter.observe(item.seq.request_id, start, result.hidden[row:row + committed])
        if not result.sample_index:
            return updated
        seqs = [schedule[i].seq for i in result.sample_index]
        if result.greedy is not None and all(map(plain_greedy, seqs)):
            for i, seq in zip(result.sample_index, seqs):
                self._append(seq, [result.greedy[result.row_starts[i] + schedule[i].num_rows - 1]], [None])
            return updated + seqs
        params = [s.params for s in seqs]
        logits = apply_penalties(result.sample_logits, [s.prompt_ids for s in seqs], [s.output_ids for s in seqs],
                                 params, [s.eos_ids for s in seqs])
        tokens = sample(logits, params, [s.generator for s in seqs]).tolist()
        wanted = [p.logprobs for p in params]
        logprobs = gather_logprobs(result.sample_logits, torch.tensor(tokens, device=logits.device), wanted) \
            if any(w is not None for w in wanted) else [None] * len(seqs)
        for seq, token, lp in zip(seqs, tokens, logprobs):
            self._append(seq, [token], [lp])
        return updated + seqs

    def _commit_verified(self, schedule: list[Scheduled], verify_logits: dict[int, torch.Tensor],
                         greedy: list[int] | None, starts: list[int]) -> list[Sequence]:
        """Verify the drafts of the sequences that had some, keep the accepted rows, append the new tokens.
        When the pass computed every row's argmax on device and all are plain greedy, those decide."""
        if not verify_logits:
            return []
        seqs = [schedule[i].seq for i in verify_logits]
        drafts = [list(seq.draft) for seq in seqs]
        if greedy is not None and all(map(plain_greedy, seqs)):
            verdict = verify_greedy_tokens([greedy[starts[i]:starts[i] + 1 + len(d)]
                                            for i, d in zip(verify_logits, drafts)], drafts)
        else:
            probs = [None if seq.draft_probs is None else seq.draft_probs[:len(seq.draft)] for seq in seqs]
            verdict = verify_sampling(list(verify_logits.values()), drafts, probs, [s.params for s in seqs],
                                      [s.generator for s in seqs])
        for seq, logits, draft, tokens, accepted in zip(seqs, verify_logits.values(), drafts, verdict.tokens,
                                                        verdict.accepted):
            seq.num_computed -= len(draft) - accepted  # rejected rows never happened
            seq.pending_fold = 1 + accepted  # the last sampled token's row and the accepted drafts
            seq.draft, seq.draft_probs = [], None
            seq.spec_rounds += 1
            seq.spec_accepted += accepted
            grow = len(draft) - len(seq.drafted_at)
            seq.drafted_at.extend([0] * max(grow, 0))
            seq.accepted_at.extend([0] * max(grow, 0))
            for position in range(len(draft)):
                seq.drafted_at[position] += 1
                seq.accepted_at[position] += position < accepted
            logprobs = [None] * len(tokens)
            if seq.params.logprobs is not None:
                logprobs = gather_logprobs(logits[:len(tokens)], torch.tensor(tokens, device=logits.device),
                                           [seq.params.logprobs] * len(tokens))
            self._append(seq, tokens, logprobs)
            self.draft_policy.update(seq.request_id, len(draft), accepted)
            if not seq.finished:
                self.drafter.on_commit(seq.request_id, accepted, seq.num_tokens)
        return seqs

    def _append(self, seq: Sequence, tokens: list[int], logprobs: list) -> None:
        """Append new tokens one by one, stopping at the first stop condition."""
        now = time.perf_counter()
        if seq.first_token_time is None:
            seq.first_token_time = now
        for token, lp in zip(tokens, logprobs):
            seq.output_ids.append(token)
            if lp is not None:
                seq.logprobs.append(self._with_text(lp))
            if self._check_stop(seq, token):
                seq.finish_time = now
                self._finish(seq)
                return

    def _mtp_drafter(self):
        """The MTP head as a drafter, reading this engine's caches and sequences."""
        from deltaspec.spec.mtp import MTPDrafter

        if self.model.mtp is None:
            raise DeltaspecError(f"The checkpoint at {self.model_dir} has no MTP head (mtp.* tensors); "
                                 "use speculative='ngram' or 'draft' instead.")
        return MTPDrafter(self.model, self.cache, lambda seq_id: next(
            s for s in self.scheduler.running if s.request_id == seq_id), self.device, self.config.seed)

    def _finish(self, seq: Sequence) -> None:
        if seq.finish_reason in ("stop", "length") and seq.state_slot is not None:
            self.cache.checkpoint(seq, seq.num_computed - seq.pending_fold)  # where its state stands
        self.scheduler.finish(seq)
        if self.drafter is not None:
            self.drafter.on_finish(seq.request_id)
            self.draft_policy.forget(seq.request_id)

    def _propose_drafts(self) -> None:
        """Ask the drafter for up to `draft_tokens` tokens for every decoding sequence that can use them."""
        requests, seqs = [], []
        for seq in self.scheduler.running:
            params = seq.params
            if not seq.decoding or len(seq.output_ids) < params.min_tokens or params.repetition_penalty != 1.0 \
                    or params.presence_penalty or params.frequency_penalty:
                continue
            k = self.draft_policy.choose(seq.request_id, min(params.max_tokens - len(seq.output_ids) - 1,
                                                             self.max_model_len - seq.num_tokens - 1))
            if k > 0:
                requests.append(DraftRequest(seq.request_id, seq.all_ids, k, params))
                seqs.append(seq)
        for seq, draft in zip(seqs, self.drafter.propose(requests) if requests else []):
            seq.draft, seq.draft_probs = list(draft.tokens), draft.probs

    def _record_prompt_logprobs(self, item: Scheduled, logits: torch.Tensor) -> None:
        """Logprob of each next prompt token given its prefix (the first prompt token gets None).
        A sequence recomputed after preemption does not record them twice."""
        seq, start = item.seq, item.seq.num_computed
        if start == 0 and not seq.prompt_logprobs:
            seq.prompt_logprobs.append(None)
        if len(seq.prompt_logprobs) != start + 1:
            return
        targets = seq.prompt_ids[start + 1:start + 1 + logits.shape[0]]
        if not targets:
            return
        rows = logits[:len(targets)]
        got = gather_logprobs(rows, torch.tensor(targets, device=rows.device),
                              [seq.params.prompt_logprobs] * len(targets))
        seq.prompt_logprobs.extend(self._with_text(lp) for lp in got)

    def _with_text(self, logprobs: dict) -> dict:
        if self.tokenizer is None:
            return logprobs
        return {t: type(lp)(lp.logprob, lp.rank, self.tokenizer.decode_token(t)) for t, lp in logprobs.items()}

    def _check_stop(self, seq: Sequence, token: int) -> bool:
        params = seq.params
        n = len(seq.output_ids)
        if n >= params.min_tokens:
            if not params.ignore_eos and token in seq.eos_ids:
                seq.finish_reason = "stop"
                return True
            if token in params.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token
                if not params.include_stop_str_in_output and self.tokenizer is not None:
                    seq.stop_text = self.decode(seq.output_ids[:-1], params.skip_special_tokens)
                return True
            if params.stop and self.tokenizer is not None and self._match_stop_string(seq):
                return True
        if n >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
            return True
        return False

    def _match_stop_string(self, seq: Sequence) -> bool:
        """Look for a stop string in the text of the last few tokens only (any earlier match would have
        stopped the sequence already); on a match, cut the full text once."""
        params = seq.params
        longest = max(len(s) for s in params.stop)
        tail = self.decode(seq.output_ids[-(2 * longest + 8):], params.skip_special_tokens)
        if not any(stop in tail for stop in params.stop):
            return False
        text = self.decode(seq.output_ids, params.skip_special_tokens)
        matches = [(text.find(s), s) for s in params.stop if s in text]
        if not matches:
            return False
        at, stop = min(matches)
        end = at + len(stop) if params.include_stop_str_in_output else at
        seq.finish_reason, seq.stop_reason, seq.stop_text = "stop", stop, text[:end]
        return True
