"""Engine: loads a model and runs requests. `step()` = schedule -> execute -> update (DESIGN §3).

The update after a pass advances every scheduled sequence (the cache manager records what the pass did to its
state), lets the Speculator commit what verification accepted, picks the next token of every sequence that samples
one, and appends tokens until a stop condition. The engine steps one executor (`deltaspec.engine.executor`), the
ranks it runs on: it records every change made from outside (`admit`, `abort`, `fail`), and with several ranks
(tensor-parallel, pipeline stages) each follower rank's engine applies them and steps in lock step
(`deltaspec.engine.workers`).
"""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from functools import partial

from deltaspec.cache.memory_plan import require_fit
from deltaspec.config.engine import EngineConfig
from deltaspec.engine.admission import check_request
from deltaspec.engine.executor import Executor
from deltaspec.engine.isolation import each_or_alone, guarded
from deltaspec.engine.logprob_text import LogprobText
from deltaspec.engine.next_tokens import next_tokens
from deltaspec.engine.planning import plan_for
from deltaspec.engine.setup import (
    engine_cache,
    engine_drafter,
    engine_executor,
    engine_images,
    engine_model,
    engine_sampling_defaults,
    engine_scheduler,
    engine_speculator,
    engine_tokenizer,
    graph_runner,
    pipeline_pass,
    route_gemms,
)
from deltaspec.engine.stopping import StopChecker
from deltaspec.errors import DeltaspecError, error_text
from deltaspec.execution.request import Request
from deltaspec.execution.runner import Runner, SeqOutput
from deltaspec.execution.sequence import Sequence
from deltaspec.model.vision.prompt import PromptImages
from deltaspec.ops.dispatch import ops_for
from deltaspec.sample.params import SamplingParams
from deltaspec.sample.sampler import make_generator
from deltaspec.sample.structured import StructuredCompiler
from deltaspec.spec.drafter import Drafter
from deltaspec.spec.speculator import DraftLength

log = logging.getLogger("deltaspec.engine")
UNFIT = (
    "This request needs more KV cache pages than the whole pool holds, even alone; shorten the prompt or lower "
    "max_tokens (or start the server with more --num-kv-blocks)."
)


class Engine:
    """Runs requests on one model. `drafter` and `draft_policy` replace the drafter and draft-length policy the
    configuration would build (tests and benchmarks inject their own); with a `drafter`, speculation runs whatever
    `speculative` says, which becomes its name. `executor`: a follower rank's own, else the config's."""

    def __init__(
        self,
        config: EngineConfig,
        progress: bool = True,
        drafter: Drafter | None = None,
        draft_policy: DraftLength | None = None,
        executor: Executor | None = None,
    ):
        planned = plan_for(config, drafter)
        require_fit(planned.plan)
        self.plan, self.config, self.model_config = planned.plan, planned.config, planned.model_config
        self.model_dir, self.max_model_len = planned.model_dir, planned.config.scheduler.max_model_len
        self.device, self.dtype = planned.cache.device, planned.cache.dtype
        self.executor = executor or engine_executor(self.config, type(self))
        weakref.finalize(self, self.executor.close)  # ranks and their group end with the engine, closed or not
        with self.executor.building():
            self._build(planned, progress, drafter, draft_policy)

    def _build(self, planned, progress: bool, drafter: Drafter | None, draft_policy: DraftLength | None) -> None:
        reference_only = self.config.host.kernels == "reference"
        ops = self.ops = ops_for(self.device, reference_only, self.config.load.fp8_activations)
        self.model = engine_model(planned, ops, progress, self.executor.tp, self.executor.pipeline)
        self.tokenizer, self.images = engine_tokenizer(planned), engine_images(planned)
        self.sampling_defaults = engine_sampling_defaults(planned)  # SamplingParams fields a request leaves unset
        verify_costs = route_gemms(self.model, ops, self.config, self.dtype, self.device, progress, self.executor.share)
        verify_costs = self.executor.share(verify_costs)  # rank 0's measurements: every rank drafts alike
        self.cache = engine_cache(planned, self.model)
        self.scheduler = engine_scheduler(self.config, self.cache)
        running = lambda seq_id: next(s for s in self.scheduler.running if s.request.request_id == seq_id)  # noqa: E731
        drafter = drafter or engine_drafter(planned, self.model, self.cache, running, self.ops)
        self.speculator = engine_speculator(self.config, self.model, self.cache, drafter, draft_policy, verify_costs)
        graphs = graph_runner(self.model, self.cache, planned, progress)
        staged = pipeline_pass(self.executor.pipeline, self.config)  # None on one stage
        self.runner = Runner(self.model, self.cache.caches, self.config.cache.block_size, self.device, graphs, staged)
        tokenizer_eos = self.tokenizer.eos_token_ids if self.tokenizer else set()
        self.eos_ids = frozenset(set(self.model_config.eos_token_ids) | tokenizer_eos)
        self.stops = StopChecker(self.tokenizer, self.max_model_len)
        self.structured = StructuredCompiler(self.tokenizer, self.model_config.vocab_size, self.eos_ids)
        self.logprob_text = LogprobText(self.tokenizer)
        self._seed_counter = itertools.count(self.config.scheduler.seed)

    def close(self) -> None:
        """Stop the executor's other ranks (nothing to do on one device)."""
        self.executor.close()

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            no_tokenizer = (
                f"The checkpoint at {self.model_dir} has no tokenizer.json, so text prompts cannot be encoded"
            )
            raise DeltaspecError(no_tokenizer + "; pass {'prompt_token_ids': [...]} instead.")
        return self.tokenizer.encode(text)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens)

    def new_sequence(
        self,
        request_id: str,
        prompt: str | None,
        prompt_ids: list[int],
        params: SamplingParams,
        history_len: int = 0,
        seed: int | None = None,
        images: tuple[bytes, ...] | PromptImages | None = (),
    ) -> Sequence:
        """Validate a request and make its (unscheduled) sequence; user errors raise DeltaspecError. `history_len`: the
        prompt's first tokens a follow-up will share (kept as a prefix checkpoint); `seed`: the sampling seed if neither
        the request nor the engine's counter gives it (a follower rank's: rank 0's); `images`: the prompt's images."""
        prompt_ids, prompt_images, history_len = self.images.prompt(prompt_ids, images, history_len)
        check_request(prompt_ids, params, self.max_model_len, self.model_config.vocab_size)
        if seed is None:
            seed = params.seed if params.seed is not None else next(self._seed_counter)
        generator = None if params.greedy else make_generator(seed, self.device)
        grammar = self.structured.state(params.structured_outputs) if params.structured_outputs else None
        ids = list(prompt_ids)
        return Sequence(
            Request(request_id, prompt, ids, params, self.eos_ids, generator, seed, grammar, prompt_images, history_len)
        )

    def add_request(self, *request, **options) -> Sequence:
        """`new_sequence` (of the same arguments) and `admit` in one."""
        seq = self.new_sequence(*request, **options)
        self.admit(seq)
        return seq

    def admit(self, seq: Sequence) -> None:
        """Queue a sequence made by `new_sequence`."""
        r = seq.request
        files = r.images.files if r.images else ()
        self.executor.record("admit", r.request_id, r.prompt, r.prompt_ids, r.params, r.history_len, r.seed, files)
        self.scheduler.add(seq)

    def abort(self, seq: Sequence) -> None:
        if not seq.finished:
            self.executor.record("abort", seq.request.request_id)
            seq.finish_reason, seq.stats.finish_time = "abort", time.perf_counter()
            self._finish(seq)

    def fail(self, seqs: list[Sequence], error: str) -> None:
        """End `seqs` with finish reason "error" and free their caches (a call from outside the engine's steps)."""
        self.executor.record("fail", [seq.request.request_id for seq in seqs if not seq.finished], error)
        self._end_with_error(seqs, error)

    def _end_with_error(self, seqs: list[Sequence], error: str) -> None:
        for seq in seqs:
            if not seq.finished:
                seq.finish_reason, seq.error = "error", error
                seq.stats.finish_time = time.perf_counter()
                self._finish(seq)

    def usage(self) -> dict:
        """Running and waiting sequences, passes and preemptions, and what the caches hold (`CacheManager.usage`)."""
        return {**self.scheduler.usage(), **self.cache.usage()}

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[Sequence]:
        """One forward pass over every runnable sequence; returns the sequences that got new tokens or ended
        (those that finished have `finished` set). A failure ends only the request at fault."""
        self.executor.step(self.scheduler.running)
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        schedule = self.scheduler.schedule()
        ended = [self._fail_one(seq, UNFIT) for seq in self.scheduler.unfit]
        if not schedule:
            return ended
        try:
            outputs = self.runner.execute(schedule)
        except Exception as exc:  # noqa: BLE001 - the scheduler finds the sequence at fault
            log.exception("a pass of %d sequences failed", len(schedule))
            if len(schedule) > 1:
                self.scheduler.quarantine(schedule)
                return ended
            return ended + [self._fail_one(schedule[0].seq, error_text(exc))]
        return ended + self._update(outputs)

    def _update(self, outputs: list[SeqOutput]) -> list[Sequence]:
        for out in outputs:
            self._advance(out)
        verifying = [out for out in outputs if out.verifying]
        sampling = [out for out in outputs if out.argmax and not out.verifying]
        if self.speculator is not None:
            for out, verdict in zip(verifying, each_or_alone(verifying, self.speculator.verify, self._fail_output)):
                if verdict is not None:
                    guarded(out, partial(self.speculator.commit, out, verdict, self._append), self._fail_output)
            self.speculator.observe(outputs)
        for out, pick in zip(sampling, each_or_alone(sampling, next_tokens, self._fail_output)):
            if pick is not None:
                guarded(out, partial(self._append, out.seq, [pick[0]], [pick[1]]), self._fail_output)
        return [out.seq for out in verifying + sampling]

    def _fail_output(self, out: SeqOutput, exc: BaseException) -> None:
        self._fail_one(out.seq, error_text(exc))

    def _fail_one(self, seq: Sequence, error: str) -> Sequence:
        self._end_with_error([seq], error)  # every rank's step fails it alike: nothing to record
        return seq

    def _advance(self, out: SeqOutput) -> None:
        """The pass computed `out.rows` rows of the sequence: record prompt logprobs, advance it, and leave a
        prefix checkpoint where its prompt asks for one."""
        seq = out.seq
        if out.prompt_logits is not None:
            self.logprob_text.record_prompt(seq, out.first_position, out.prompt_logits)
        self.cache.after_pass(seq.cache, out.rows, out.logged, verifying=bool(seq.proposal.tokens))
        if seq.isolated_until and seq.cache.num_computed >= seq.isolated_until:
            seq.isolated_until = 0  # past the failed pass: it runs with the others again
        if seq.checkpoint_at and seq.checkpoint_at[0] == seq.cache.num_computed and not out.verifying:
            seq.checkpoint_at.pop(0)
            evict = self.scheduler.may_evict_for(seq, seq.cache.num_computed)
            self.cache.checkpoint(seq.cache, seq.cache_ids, evict=evict)

    def _append(self, seq: Sequence, tokens: list[int], logprobs: list) -> None:
        """Append new tokens one by one, stopping at the first stop condition."""
        now = time.perf_counter()
        if seq.stats.first_token_time is None:
            seq.stats.first_token_time = now
        for token, lp in zip(tokens, logprobs):
            seq.output_ids.append(token)
            if lp is not None:
                seq.logprobs.append(self.logprob_text(lp))
            if self.stops(seq, token):
                seq.stats.finish_time = now
                self._finish(seq)
                return

    def _finish(self, seq: Sequence) -> None:
        if seq.finish_reason in ("stop", "length") and seq.cache.state_slot is not None:  # where a chat's next turn
            self.cache.checkpoint(seq.cache, seq.cache_ids, evict=not seq.request.history_len)  # resumes
        self.scheduler.finish(seq)
        if self.speculator is not None:
            self.speculator.finish(seq)
