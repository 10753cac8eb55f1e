"""The MTP head: loaded from `mtp.*` tensors, matches a transformers-built oracle, caches exactly."""

import shutil

import pytest
import torch

from deltaspec import LLM
from deltaspec.execution.batch import Scheduled, build_batch
from tests.engine_helpers import forward_in_chunks, new_sequence
from tests.hf_reference import float64_class
from tests.tiny_models import add_mtp_weights

PROMPT = [(13 * i + 7) % 500 + 3 for i in range(40)]


@pytest.fixture(scope="module")
def mtp_dir(checkpoints, tmp_path_factory):
    path = tmp_path_factory.mktemp("mtp") / "model"
    shutil.copytree(checkpoints["qwen3_5_r2"], path)
    add_mtp_weights(path)
    return path


@pytest.fixture(scope="module")
def engine(mtp_dir):
    return LLM(str(mtp_dir), dtype="float64", device="cpu", block_size=4, speculative="mtp").engine


def mtp_rows(engine, hidden, token_ids, chunks):
    """MTP over rows (t_{i+1}, h_i) at position i, in chunks; its hidden states [rows, H]."""
    seq = new_sequence(engine, token_ids)
    outs = []
    try:
        for rows in chunks:
            schedule = [Scheduled(seq, rows)]
            assert engine.cache.reserve(seq.cache, seq.cache.num_computed + rows)
            batch = build_batch(schedule, engine.cache.block_size, engine.device)
            with torch.inference_mode():
                outs.append(
                    engine.model.mtp_forward(
                        batch, hidden[seq.cache.num_computed : seq.cache.num_computed + rows], engine.cache.caches
                    )
                )
            seq.cache.num_computed += rows
    finally:
        engine.cache.release(seq.cache)
    return torch.cat(outs)


def target_hidden(engine, ids):
    seq = new_sequence(engine, ids)
    try:
        assert engine.cache.reserve(seq.cache, len(ids))
        batch = build_batch([Scheduled(seq, len(ids))], engine.cache.block_size, engine.device)
        with torch.inference_mode():
            return engine.model(batch, engine.cache.caches)
    finally:
        engine.cache.release(seq.cache)


def test_mtp_head_is_loaded_with_its_own_kv_layer_only_when_it_drafts(engine, mtp_dir, checkpoints):
    assert engine.model.mtp is not None and len(engine.model.mtp.layers) == 1
    assert engine.model.num_kv_layers == len(engine.model_config.attention_layer_ids) + 1
    assert len(engine.cache.kv.k) == engine.model.num_kv_layers
    for other in ("none", "ngram"):  # the head is a drafter's memory: not loaded, no KV layer, nothing planned
        unused = LLM(str(mtp_dir), dtype="float64", device="cpu", block_size=4, speculative=other).engine
        assert unused.model.mtp is None and len(unused.cache.kv.k) == len(engine.model_config.attention_layer_ids)
        assert unused.plan.drafter.weights == 0 and unused.plan.weights == engine.plan.weights
    assert engine.plan.drafter.weights == sum(
        {p.data_ptr(): p.numel() * 8 for p in engine.model.mtp.parameters()}.values()
    )
    assert engine.plan.kv + engine.plan.drafter_bytes - engine.plan.drafter.weights == engine.cache.kv.bytes()
    plain = LLM(str(checkpoints["qwen3_5_r2"]), dtype="float64", device="cpu").engine
    assert plain.model.mtp is None
    torch.testing.assert_close(
        forward_in_chunks(engine, PROMPT, [40]), forward_in_chunks(plain, PROMPT, [40]), rtol=0, atol=0
    )


def test_mtp_matches_a_transformers_built_oracle(engine, mtp_dir):
    import transformers as tf
    from safetensors.torch import load_file

    hidden = target_hidden(engine, PROMPT)
    shifted = PROMPT[1:]
    ours = mtp_rows(engine, hidden, shifted, [len(shifted)])

    module = __import__(float64_class(tf.Qwen3_5ForCausalLM).__module__, fromlist=["x"])
    config = tf.AutoConfig.from_pretrained(mtp_dir)
    config._attn_implementation = "eager"
    weights = {k: v.double() for k, v in load_file(mtp_dir / "model.safetensors").items()}
    attn_layer = engine.model_config.attention_layer_ids[0]
    layer = module.Qwen3_5DecoderLayer(config, attn_layer).double().eval()
    layer.load_state_dict(
        {k.removeprefix("mtp.layers.0."): v for k, v in weights.items() if k.startswith("mtp.layers.0.")}
    )
    norms = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[name] = module.Qwen3_5RMSNorm(config.hidden_size, config.rms_norm_eps).double()
        norms[name].weight.data = weights[f"mtp.{name}.weight"]
    rotary = module.Qwen3_5TextRotaryEmbedding(config)
    n = len(shifted)
    embeds = weights["model.embed_tokens.weight"][torch.tensor(shifted)]
    with torch.no_grad():
        x = torch.cat((norms["pre_fc_norm_embedding"](embeds), norms["pre_fc_norm_hidden"](hidden[:n])), -1)
        x = (x @ weights["mtp.fc.weight"].T)[None]
        position_ids = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf"), dtype=torch.float64).triu(1)[None, None]
        text_positions = position_ids[None].expand(3, 1, n)  # M-RoPE's (temporal, height, width) positions
        y = layer(x, position_embeddings=rotary(x, text_positions), attention_mask=mask, position_ids=position_ids)
        expected = norms["norm"](y)[0]
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-10)


def test_mtp_cache_gives_the_same_rows_in_chunks(engine):
    hidden = target_hidden(engine, PROMPT)
    shifted = PROMPT[1:]
    whole = mtp_rows(engine, hidden, shifted, [len(shifted)])
    pieces = mtp_rows(engine, hidden, shifted, [1, 7, 1, 1, 29])
    torch.testing.assert_close(pieces, whole, rtol=0, atol=1e-10)
    logits = engine.model.compute_logits(whole)
    assert logits.shape == (len(shifted), engine.model_config.vocab_size)
