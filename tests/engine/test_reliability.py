"""No request can take down another (engine side): drafts that do not fit, a budget smaller than the
decoding sequences, a KV pool too small for one request, and passes that raise (fault injection in a real
engine) each end at most the request at fault, and everyone else's output is what it would have been."""

from __future__ import annotations

import pytest

from deltaspec import LLM, DeltaspecError, SamplingParams
from deltaspec.spec.drafter import Draft
from deltaspec.spec.ngram import NgramDrafter

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def token_ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_mtp_drafts_with_a_budget_smaller_than_the_decoding_sequences(caplog):
    """Three decoding sequences, two rows per pass: every one gets its row before anyone's draft rows, the
    drafts that do not fit are dropped, and the MTP drafter drafts again for sequences it drafted for but that
    ran no rows (it used to stack an empty list of hidden states)."""
    prompts = [{"prompt_token_ids": [t]} for t in (11, 200, 3000)]
    plain = LLM(dtype="float64", device="cpu").generate(prompts, GREEDY)
    llm = LLM(
        dtype="float64", device="cpu", speculative="mtp", draft_tokens=3, max_num_batched_tokens=2, max_num_seqs=4
    )
    outs = llm.generate(prompts, GREEDY)
    assert token_ids(outs) == token_ids(plain)
    assert not [r for r in caplog.records if "drafter failed" in r.getMessage()]
    assert sum(o.metrics.get("spec_accepted_tokens", 0) for o in outs) > 0
    assert llm.engine.usage()["kv_blocks_used"] == 0 and llm.engine.usage()["state_slots_used"] == 0


def test_every_decoding_sequence_gets_a_row_before_any_draft(checkpoints):
    path = str(checkpoints["qwen3_5_r2"])
    prompts = [{"prompt_token_ids": [5, 9, 14, 22] * 4 + [i]} for i in range(4)]
    llm = LLM(path, dtype="float64", device="cpu", speculative="ngram", draft_tokens=6, max_num_batched_tokens=4)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    seqs = [llm.engine.add_request(str(i), None, p["prompt_token_ids"], params) for i, p in enumerate(prompts)]
    while any(not s.output_ids for s in seqs):
        llm.engine.step()
    for _ in range(6):  # four decoding sequences, four rows a pass: one row each, no room for drafts
        before = [len(s.output_ids) for s in seqs]
        llm.engine.step()
        assert [len(s.output_ids) - b for s, b in zip(seqs, before)] == [1, 1, 1, 1]


def test_drafts_that_do_not_fit_the_kv_pages_are_cut_not_fatal(checkpoints):
    """A pool with room for the sequences but not for their drafts: drafts shrink to the free pages (never
    preempting another sequence for a draft row), and the output stays exact."""
    path = str(checkpoints["qwen3_5_r2"])
    prompts = [{"prompt_token_ids": ([5, 9, 14, 22, 31] * 3)[i:] + [i]} for i in range(3)]
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    tight = {"num_kv_blocks": 12, "block_size": 4, "max_model_len": 32, "max_num_seqs": 3}
    plain = LLM(path, dtype="float64", device="cpu", **tight)
    expected = token_ids(plain.generate(prompts, params))
    spec = LLM(path, dtype="float64", device="cpu", speculative="ngram", draft_tokens=7, **tight)
    assert token_ids(spec.generate(prompts, params)) == expected
    assert plain.engine.usage()["preemptions"] > 0  # the pool is tight
    assert spec.engine.usage()["preemptions"] <= plain.engine.usage()["preemptions"]
    assert spec.engine.usage()["kv_blocks_used"] == 0


def test_a_kv_pool_smaller_than_one_context_is_refused_at_start(checkpoints):
    """An explicit context the pool cannot hold is refused; an automatic one is the pool's size."""
    with pytest.raises(DeltaspecError, match=r"cannot hold one full context of 4096 tokens; use --num-kv-blocks 256"):
        LLM(str(checkpoints["qwen3_5_r2"]), device="cpu", num_kv_blocks=64, max_num_seqs=8, max_model_len=4096)
    llm = LLM(str(checkpoints["qwen3_5_r2"]), device="cpu", num_kv_blocks=64, max_num_seqs=8)
    assert llm.engine.max_model_len == 64 * 16


POISON = 4242  # a token id that makes the injected fault fire


def poisoned_forward(engine, poison: int = POISON):
    """Fault injection into a real engine's model: any pass whose rows include `poison` raises."""
    run = engine.model.run  # the runner's entry: the pass's hidden states and tapped features

    def run_or_raise(batch, caches):
        if bool((batch.token_ids == poison).any()):
            raise RuntimeError("injected fault")
        return run(batch, caches)

    engine.model.run = run_or_raise


@pytest.mark.parametrize("speculative", ["none", "ngram"])
@pytest.mark.parametrize("poison_at", [3, 40])
def test_a_pass_that_raises_fails_only_the_request_at_fault(speculative, poison_at):
    """Five requests share passes; one has a token that makes any pass holding it raise (in its first prompt
    chunk, or in a later one). That request ends with the error; the others finish with exactly the tokens
    they get without it, and every page and slot is freed."""
    prompts = [list(range(10 + 7 * i, 70 + 7 * i)) for i in range(5)]
    bad = list(prompts[2])
    bad[poison_at] = POISON
    options = dict(dtype="float64", device="cpu", speculative=speculative, draft_tokens=3, prefill_chunk=16)
    clean = LLM(**options).generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    llm = LLM(**options)
    poisoned_forward(llm.engine)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:2] + [bad] + prompts[3:]], GREEDY)
    assert outs[2].outputs[0].finish_reason == "error"
    assert [o.outputs[0].finish_reason for i, o in enumerate(outs) if i != 2] == ["length"] * 4
    assert [o.outputs[0].token_ids for i, o in enumerate(outs) if i != 2] == [
        o.outputs[0].token_ids for i, o in enumerate(clean) if i != 2
    ]
    usage = llm.engine.usage()
    assert usage["kv_blocks_used"] == 0 and usage["state_slots_used"] == 0 and usage["running"] == 0


def test_a_sampling_failure_fails_only_its_request(monkeypatch):
    from deltaspec.engine import next_tokens as module

    real = module.sample

    def sample_or_raise(logits, params, generators):
        if any(p.temperature == 0.77 for p in params):
            raise FloatingPointError("injected fault")
        return real(logits, params, generators)

    monkeypatch.setattr(module, "sample", sample_or_raise)
    llm = LLM(dtype="float32", device="cpu")
    params = [SamplingParams(max_tokens=8, temperature=t, seed=1, ignore_eos=True) for t in (0.5, 0.77, 0.9)]
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 3, params)
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "error", "length"]
    alone = LLM(dtype="float32", device="cpu").generate([{"prompt_token_ids": [5, 6, 7]}] * 2, [params[0], params[2]])
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == token_ids(alone)


class FaultyDrafter(NgramDrafter):
    """Drafts the known greedy continuation; raises for one request, proposes out-of-vocabulary ids for another."""

    def __init__(self, prompt: list[int], truth: list[int]):
        super().__init__()
        self.prompt, self.truth = prompt, truth

    def propose(self, requests):
        if any(r.seq_id.startswith("raise") for r in requests):
            raise RuntimeError("injected drafter fault")
        drafts = []
        for request in requests:
            done = len(request.token_ids) - len(self.prompt)
            tokens = self.truth[done : done + request.max_tokens]
            drafts.append(Draft([10**9] * len(tokens) if request.seq_id.startswith("garbage") else tokens))
        return drafts


def test_a_failing_drafter_costs_its_sequence_the_draft_not_the_request(checkpoints):
    path = str(checkpoints["qwen3_5_r2"])
    prompt = [5, 9, 14, 22, 31] * 4
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    expected = LLM(path, dtype="float64", device="cpu").generate([{"prompt_token_ids": prompt}], params)
    truth = expected[0].outputs[0].token_ids
    engine = LLM(path, dtype="float64", device="cpu", drafter=FaultyDrafter(prompt, truth), draft_tokens=4).engine
    seqs = [engine.add_request(name, None, prompt, params) for name in ("fine", "raise", "garbage")]
    while engine.has_unfinished():
        engine.step()
    assert [s.finish_reason for s in seqs] == ["length"] * 3
    assert all(s.output_ids == truth for s in seqs)
    assert seqs[0].stats.acceptance.accepted > 0  # the others' failures cost it nothing
    assert seqs[1].stats.acceptance.rounds == seqs[2].stats.acceptance.rounds == 0  # they decoded without drafts
