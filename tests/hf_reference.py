"""transformers as the test oracle, including a float64-faithful copy of its model code.

transformers computes several parts of these models in float32 whatever the model dtype (the GDN
kernels cast to float32, norms call `.float()`, RoPE and softmax use float32). For float64
parity at 1e-9 the oracle must not round there, so `float64_class` re-executes the modeling
module's own source with those float32 casts turned into float64 ones. The math is transformers'
own; only the precision changes.
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
import types

import torch


@functools.cache
def float64_class(model_class: type) -> type:
    """`model_class` from a copy of its module in which float32 islands compute in float64."""
    module = sys.modules[model_class.__module__]
    source = inspect.getsource(module)
    source = re.sub(r"torch\.float32\b", "torch.float64", source)
    source = re.sub(r"torch\.float\b", "torch.float64", source)
    source = source.replace(".float()", ".double()")
    copy = types.ModuleType(module.__name__ + "_float64")
    copy.__dict__.update(__package__=module.__package__, __file__=module.__file__)
    sys.modules[copy.__name__] = copy
    exec(compile(source, module.__file__, "exec"), copy.__dict__)
    return getattr(copy, model_class.__name__)


def load_reference(model_dir, dtype: torch.dtype):
    """The transformers model saved at `model_dir`, in `dtype` (float64: the float64-faithful copy)."""
    import transformers as tf

    config = tf.AutoConfig.from_pretrained(model_dir)
    model_class = tf.AutoModelForCausalLM._model_mapping[type(config)]
    if dtype == torch.float64:
        model_class = float64_class(model_class)
        return model_class.from_pretrained(
            model_dir, config=config, dtype=dtype, attn_implementation="eager", experts_implementation="eager"
        ).eval()
    return model_class.from_pretrained(model_dir, dtype=dtype).eval()


@torch.no_grad()
def reference_logits(model, token_ids: list[int]) -> torch.Tensor:
    """Logits of every position of one prompt: [L, vocab]."""
    return model(torch.tensor([token_ids])).logits[0]


@torch.no_grad()
def reference_greedy(model, token_ids: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(
        torch.tensor([token_ids]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(token_ids) :].tolist()
