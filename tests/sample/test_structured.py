"""Structured output on the embedded model: every completion under 50 random JSON schemas parses and validates,
with no drafter and with every drafter, greedy and sampled; constrained speculative greedy output equals
constrained plain greedy output in float64; constrained speculative sampling keeps the constrained distribution;
regexes, choices and grammars hold; and a bad constraint is one clear sentence."""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest
import torch

from deltaspec import LLM, DeltaspecError, SamplingParams, StructuredOutputsParams
from tests.spec.test_speculative import chi_square
from tests.tiny_models import write_block_drafter

DRAFTERS = ["none", "ngram", "draft", "mtp", "draft+ngram", "mtp+ngram", "block"]
PROMPTS = ["config = ", "def load(path):\n    return json.loads(", "# settings\nDEFAULTS = ", "response = "]


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object schema with 1-4 properties: bounded strings, enums, integers and numbers with bounds, booleans,
    short arrays and (twice at most) nested objects; some properties optional. Everything is bounded, so a valid
    instance fits in a few dozen tokens."""
    properties = {}
    for i in range(rng.randint(1, 4)):
        kind = rng.choice(
            ["string", "enum", "integer", "number", "boolean", "array"] + (["object"] if depth < 2 else [])
        )
        if kind == "string":
            prop = {"type": "string", "maxLength": rng.randint(1, 8)}
        elif kind == "enum":
            prop = {"enum": rng.sample(["red", "green", "blue", "on", "off", "x1", "yes"], rng.randint(1, 4))}
        elif kind == "integer":
            low = rng.randint(-50, 50)
            prop = {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 100)}
        elif kind == "number":
            prop = {"type": "number", "minimum": 0, "maximum": 10}
        elif kind == "boolean":
            prop = {"type": "boolean"}
        elif kind == "array":
            prop = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3}
        else:
            prop = random_schema(rng, depth + 1)
        properties[f"k{i}_{kind[:3]}"] = prop
    names = list(properties)
    return {
        "type": "object",
        "properties": properties,
        "required": [n for n in names if rng.random() < 0.7],
        "additionalProperties": False,
    }


SCHEMAS = [random_schema(random.Random(seed)) for seed in range(50)]


@pytest.fixture(scope="module")
def block_dir(tmp_path_factory):
    from deltaspec.model.weights import default_model_path

    target = default_model_path()
    return write_block_drafter(tmp_path_factory.mktemp("block"), target, seed=1, target_layer_ids=(1, 5))


def engine(speculative: str, block_dir, dtype: str = "float32", **options) -> LLM:
    extra = {"draft_model": str(block_dir)} if speculative == "block" else {}
    options.setdefault("max_num_seqs", 64)
    return LLM(dtype=dtype, device="cpu", speculative=speculative, draft_tokens=4, **extra, **options)


def constrained(schema: dict, **kwargs) -> SamplingParams:
    kwargs.setdefault("temperature", 0.0)
    return SamplingParams(max_tokens=200, structured_outputs=StructuredOutputsParams(json=schema), **kwargs)


@pytest.mark.parametrize("speculative", DRAFTERS)
def test_every_completion_validates_against_its_random_schema(speculative, block_dir):
    llm = engine(speculative, block_dir)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(SCHEMAS))]
    greedy = llm.generate(prompts, [constrained(s) for s in SCHEMAS])
    sampled = []
    if speculative in ("none", "ngram", "draft", "mtp+ngram"):
        params = [constrained(s, temperature=0.9, seed=i) for i, s in enumerate(SCHEMAS)]
        sampled = llm.generate(prompts, params)
    for out, schema in zip(greedy, SCHEMAS):
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    assert_valid_or_within_the_constraint(llm, sampled, SCHEMAS[: len(sampled)])
    if speculative != "none":
        assert sum(o.metrics.get("spec_rounds", 0) for o in greedy + sampled) > 0


@pytest.mark.parametrize(
    ("speculative", "tree"), [(drafter, 0) for drafter in DRAFTERS[1:]] + [("mtp+ngram", 12), ("draft", 8)]
)  # tree > 0: trees of drafts, pruned to what the constraint allows and masked per path
def test_constrained_speculative_greedy_equals_constrained_plain_greedy_in_float64(speculative, tree, block_dir):
    prompts = PROMPTS * 2
    params = [constrained(s) for s in SCHEMAS[: len(prompts)]]
    regex = SamplingParams(max_tokens=24, temperature=0.0, structured_outputs=StructuredOutputsParams(regex=r"[a-z_]+"))
    plain = engine("none", block_dir, "float64").generate(prompts + PROMPTS, params + [regex] * len(PROMPTS))
    llm = engine(speculative, block_dir, "float64", speculative_tree=tree)
    spec = llm.generate(prompts + PROMPTS, params + [regex] * len(PROMPTS))
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert sum(o.metrics.get("spec_rounds", 0) for o in spec) > 0
    assert (llm.engine.speculator.tree_rounds > 0) == (tree > 0)


def assert_valid_or_within_the_constraint(llm: LLM, outs, schemas: list[dict]) -> None:
    """Sampled completions: those that stopped validate; one that ran out of tokens (a number's digits are
    unbounded: plain sampling runs 6 % of schema 46's samples past 200 tokens) is a prefix the constraint allows,
    token by token. Most stop."""
    for out, schema in zip(outs, schemas):
        if out.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(out.outputs[0].text), schema)
            continue
        assert out.outputs[0].finish_reason == "length", out.outputs[0].finish_reason
        ids = list(out.outputs[0].token_ids)
        state = llm.engine.structured.state(StructuredOutputsParams(json=schema))
        assert state.matcher.try_consume_tokens(ids) == len(ids), out.outputs[0].text
    assert sum(out.outputs[0].finish_reason == "stop" for out in outs) >= 0.9 * len(outs)


def test_sampled_trees_of_drafts_keep_every_completion_valid(block_dir):
    """Sampled requests verify trees pruned to what each constraint allows, with each row masked after its own
    path: every completion still validates (or, cut by its length, stays within the constraint)."""
    llm = engine("mtp+ngram", block_dir, speculative_tree=12)
    schemas = SCHEMAS[:24]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(schemas))]
    outs = llm.generate(prompts, [constrained(s, temperature=0.9, seed=i) for i, s in enumerate(schemas)])
    assert_valid_or_within_the_constraint(llm, outs, schemas)
    assert llm.engine.speculator.tree_rounds > 0


def test_regex_choice_grammar_and_json_object_hold(block_dir):
    llm = engine("ngram", block_dir)
    cases = [
        (
            StructuredOutputsParams(regex=r"[a-z]{3,6}@(example|test)\.(com|org)"),
            r"[a-z]{3,6}@(example|test)\.(com|org)",
        ),
        (StructuredOutputsParams(choice=["alpha", "beta", "gamma δ"]), r"alpha|beta|gamma δ"),
        (StructuredOutputsParams(grammar='start: "x = " NUMBER\nNUMBER: /[1-9][0-9]{0,2}/'), r"x = [1-9][0-9]{0,2}"),
    ]
    import re

    for spec, pattern in cases:
        for temperature in (0.0, 1.0):
            params = SamplingParams(max_tokens=40, temperature=temperature, seed=3, structured_outputs=spec)
            for out in llm.generate(PROMPTS, params):
                assert re.fullmatch(pattern, out.outputs[0].text), (spec, out.outputs[0].text)
    objects = llm.generate(
        PROMPTS,
        SamplingParams(max_tokens=120, temperature=0.0, structured_outputs=(StructuredOutputsParams(json_object=True))),
    )
    assert all(isinstance(json.loads(o.outputs[0].text), dict) for o in objects)


CHOICES = ["ab ab ab", "ab cd", "cd cd cd", "ef", "ab ef ab"]
CHOICE_PROMPT, CHOICE_SAMPLES = "words = ['ab', 'cd', 'ef']\nx = ", 1500


@pytest.fixture(scope="module")
def plain_choices():
    """The default model's constrained choices without drafts: 1500 seeded samples (shared by the drafters)."""
    spec = StructuredOutputsParams(choice=CHOICES)
    return LLM(device="cpu", max_num_seqs=256).generate(
        [CHOICE_PROMPT] * CHOICE_SAMPLES,
        [
            SamplingParams(max_tokens=12, temperature=1.0, seed=s, structured_outputs=spec)
            for s in range(CHOICE_SAMPLES)
        ],
    )


@pytest.mark.parametrize("speculative", ["ngram", "draft", "block"])
def test_constrained_speculative_sampling_keeps_the_constrained_distribution(speculative, block_dir, plain_choices):
    """Rejection sampling against the masked target distribution is lossless: the choice made under a constraint
    has the same law with and without drafts (two-sample chi-square, p = 0.001)."""
    spec, n = StructuredOutputsParams(choice=CHOICES), CHOICE_SAMPLES
    drafted = engine(speculative, block_dir, max_num_seqs=256).generate(
        [CHOICE_PROMPT] * n,
        [SamplingParams(max_tokens=12, temperature=1.0, seed=10_000 + s, structured_outputs=spec) for s in range(n)],
    )
    assert sum(o.metrics.get("spec_accepted_tokens", 0) for o in drafted) > n // 50  # drafts shaped many samples
    count = [
        torch.bincount(torch.tensor([CHOICES.index(o.outputs[0].text) for o in outs]), minlength=5)
        for outs in (plain_choices, drafted)
    ]
    assert chi_square(*count) < 18.5  # 4 degrees of freedom


def test_bad_constraints_are_one_sentence():
    llm = LLM(device="cpu")
    cases = [
        (dict(json={"type": "objekt"}), "JSON schema the output is constrained to is invalid"),
        (dict(json="{not json"), "not valid JSON"),
        (dict(regex="(ab"), "regex the output is constrained to is invalid"),
        (dict(grammar="start: nothing_here"), "grammar the output is constrained to is invalid"),
    ]
    for fields, message in cases:
        with pytest.raises(DeltaspecError, match=message) as info:
            llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(**fields)))
        assert "\n" not in str(info.value)
    with pytest.raises(DeltaspecError, match="exactly one of json, json_object, regex, choice or grammar"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(DeltaspecError, match="non-empty list of strings"):
        StructuredOutputsParams(choice=[])


def test_the_mask_allows_exactly_the_constraints_tokens():
    """apply_bitmask turns the packed words into -inf exactly at the clear bits (bit t % 32 of word t // 32)."""
    from deltaspec.sample.structured import apply_bitmask

    llm = LLM(device="cpu")
    state = llm.engine.structured.state(StructuredOutputsParams(choice=["yes", "no"]))
    mask = state.next_mask()
    logits = apply_bitmask(torch.zeros(1, llm.engine.model_config.vocab_size), mask)
    allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[: logits.shape[1]]
    assert allowed == np.flatnonzero(bits).tolist() and 0 < len(allowed) < 50
    texts = {llm.engine.tokenizer.decode([t]) for t in allowed}
    assert all("yes".startswith(t) or "no".startswith(t) for t in texts)


@pytest.mark.parametrize("speculative", ["draft", "mtp", "block"])
def test_token_by_token_drafters_follow_the_constraint(speculative, block_dir):
    """The draft model, MTP and the block drafter mask each draft position with the constraint (the block drafter
    after computing the whole block), so none of their drafts is cut; the Speculator then puts the constraint back
    where the output stands."""
    from deltaspec.spec.drafter import DraftRequest

    llm = engine(speculative, block_dir)
    prompt = llm.engine.encode("config = ")
    seq = llm.engine.add_request("s", None, prompt, constrained(SCHEMAS[3]))
    while not seq.output_ids:
        llm.engine.step()  # prefill: the first token, and the MTP head's hidden states
    state, drafter = seq.request.grammar, llm.engine.speculator.drafter
    before = state.next_mask().copy()
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, seed=1)
        request = DraftRequest("s", seq.all_ids, 8, params, state)
        draft = drafter.propose([request])[0].tokens
        state.end_draft()
        ending = next(
            (i for i, t in enumerate(draft) if t in seq.request.eos_ids), len(draft)
        )  # the output may end there
        assert len(draft) == 8 and state.valid_prefix(draft) == ending, draft
        assert all(
            t in seq.request.eos_ids for t in draft[ending:]
        )  # once complete, the constraint allows only the end
        assert (state.next_mask() == before).all()
        drafter.on_commit("s", 0, seq.num_tokens)
