"""Tiny random multimodal checkpoints (`Qwen3_5ForConditionalGeneration`, dense or MoE) made with transformers'
own classes, and transformers' vision tower as the test oracle (test helper)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.hf_reference import float64_class
from tests.tiny_models import _common

IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 500, 501, 502, 503
VISION = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=48,
    num_heads=2,
    patch_size=4,
    temporal_patch_size=2,
    spatial_merge_size=2,
    out_hidden_size=64,
    num_position_embeddings=36,  # a 6 x 6 table: smaller grids resample it down, larger ones up
)
PROCESSOR = dict(
    patch_size=4,
    temporal_patch_size=2,
    merge_size=2,
    image_mean=[0.5, 0.5, 0.5],
    image_std=[0.5, 0.5, 0.5],
    size={"shortest_edge": 16 * 16, "longest_edge": 48 * 48},
)
TOKENS = dict(
    image_token_id=IMAGE_TOKEN,
    video_token_id=VIDEO_TOKEN,
    vision_start_token_id=VISION_START,
    vision_end_token_id=VISION_END,
)


def make_multimodal(kind: str = "qwen3_5", seed: int = 0):
    """A random `Qwen3_5ForConditionalGeneration` (or its MoE sibling) with a tiny text model and tower; every
    norm weight and bias random, so parity tests see them."""
    import transformers as tf

    torch.manual_seed(seed)
    if kind == "qwen3_5":
        config = tf.Qwen3_5Config(text_config=_common(), vision_config=VISION, **TOKENS)
        model = tf.Qwen3_5ForConditionalGeneration(config)
    else:
        moe = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
        config = tf.Qwen3_5MoeConfig(text_config=_common(**moe), vision_config=VISION, **TOKENS)
        model = tf.Qwen3_5MoeForConditionalGeneration(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" in name and ("norm" in name or name.endswith("bias")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (1.0 if name.endswith("weight") else 0.0))
    return model.eval()


def write_multimodal(directory: Path, kind: str = "qwen3_5", seed: int = 0) -> Path:
    """Save a random multimodal checkpoint of `kind` (float32 safetensors) with its preprocessor_config.json."""
    make_multimodal(kind, seed).save_pretrained(directory)
    raw = PROCESSOR | dict(image_processor_type="Qwen2VLImageProcessor", processor_class="Qwen3VLProcessor")
    (directory / "preprocessor_config.json").write_text(json.dumps(raw, indent=2))
    return directory


def reference_tower(model_dir: Path, dtype: torch.dtype):
    """transformers' vision tower of the checkpoint at `model_dir` in `dtype` (float64: the float64-faithful copy,
    eager attention)."""
    import transformers as tf
    from safetensors.torch import load_file

    config = tf.AutoConfig.from_pretrained(model_dir).vision_config
    tower_class = tf.AutoModel._model_mapping[type(config)]  # Qwen3_5VisionModel or Qwen3_5MoeVisionModel
    if dtype == torch.float64:
        tower_class = float64_class(tower_class)
        config._attn_implementation = "eager"
    tower = tower_class(config).to(dtype)
    weights = load_file(model_dir / "model.safetensors")
    state = {k.removeprefix("model.visual."): v for k, v in weights.items() if k.startswith("model.visual.")}
    tower.load_state_dict(state, strict=True)
    return tower.eval()


# The user turn of Qwen3-VL's and Qwen3.5's chat templates: content parts, an image part becoming one placeholder.
VISION_CHAT_TEMPLATE = r"""{%- for message in messages %}
    {{- '<|im_start|>' + message.role + '\n' }}
    {%- if message.content is string %}
        {{- message.content }}
    {%- else %}
        {%- for content in message.content %}
            {%- if content.type == 'image' or 'image' in content or 'image_url' in content %}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' }}
            {%- elif 'text' in content %}
                {{- content.text }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
    {{- '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}"""


def write_vision_tokenizer(directory: Path) -> None:
    """The tiny test tokenizer (`tests.tiny_tokenizer`) with reserved tokens up to the tiny checkpoints' vision ids
    (<|image_pad|> at IMAGE_TOKEN, as a real Qwen3.5 tokenizer has its own) and a chat template whose user turns
    take content parts."""
    from tokenizers import AddedToken, Tokenizer

    from tests.tiny_tokenizer import write_tiny_tokenizer

    write_tiny_tokenizer(directory)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    reserved = [f"<|reserved_{i}|>" for i in range(tokenizer.get_vocab_size(), IMAGE_TOKEN)]
    vision = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]  # IMAGE_TOKEN, ... VISION_END
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in reserved + vision])
    assert [tokenizer.token_to_id(t) for t in ("<|image_pad|>", "<|vision_start|>")] == [IMAGE_TOKEN, VISION_START]
    tokenizer.save(str(directory / "tokenizer.json"))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    added = config["added_tokens_decoder"]
    for token in reserved + vision:  # transformers' tokenizer (and so llama.cpp's converter) reads them from here
        added[str(tokenizer.token_to_id(token))] = {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
    (directory / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": VISION_CHAT_TEMPLATE}))
