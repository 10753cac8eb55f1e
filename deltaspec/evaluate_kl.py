"""KL divergence of a model's next-token distributions from a base model's, as llama.cpp's
`llama-perplexity --kl-divergence` measures a quantized model against its original.

The text is tokenized with the base's tokenizer and cut into non-overlapping windows of `window` tokens, each
scored from its own start as `deltaspec.evaluate.perplexity` does. At every predicted position both models'
log-softmax (float32, float64 for a float64 model) gives KL(base || model); the report has its mean, median,
99th percentile and maximum, the fraction of positions where both argmaxes agree, and both models' perplexity
and bits per byte. Work goes window by window: only one window's logits of each model are held at a time.

The base's logits can be saved (`save_base`) and compared later without running it (`base_logits`). The file
is safetensors: `token_ids` int64 [tokens] (the scored windows back to back), `logits` [positions, vocab] in the
dtype the base computed them (row i predicts the i-th token that is not a window's first; exact, so KL from
the file equals KL from the running base), and string metadata `format`, `model`, `dtype`, `state_dtype`,
`kv_cache_dtype`, `device`, `prefill_chunk` (tokens a pass), `window`.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from deltaspec.config.engine import EngineConfig
from deltaspec.engine.engine import Engine
from deltaspec.errors import DeltaspecError
from deltaspec.execution.batch import Scheduled
from deltaspec.llm import LLM
from deltaspec.provenance import commit
from deltaspec.sample.params import SamplingParams

FORMAT = "deltaspec-kl-base-logits/1"
SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
BLOCK = 256  # positions per log-softmax block: bounds the float32 temporaries to BLOCK x vocab


def read_corpus(paths: list[str]) -> str:
    """The text files concatenated."""
    try:
        return "".join(Path(p).read_text() for p in paths)
    except (OSError, UnicodeDecodeError) as exc:
        raise DeltaspecError(f"Could not read the text to score ({exc}).") from None


def cut_windows(ids: list[int], window: int, max_windows: int | None) -> list[list[int]]:
    """Non-overlapping windows of `window` tokens (the first `max_windows`), each with at least two tokens."""
    windows = [ids[i : i + window] for i in range(0, len(ids), window) if len(ids[i : i + window]) > 1]
    return windows[:max_windows] if max_windows is not None else windows


def tokens_of(llm: LLM, text: str) -> list[int]:
    if llm.tokenizer is None:
        raise DeltaspecError(f"The checkpoint at {llm.engine.model_dir} has no tokenizer, so it cannot score text.")
    return llm.tokenizer.encode(text)


def identity(llm: LLM) -> dict:
    config = llm.engine.config
    return {
        "path": str(llm.engine.model_dir),
        "dtype": config.load.dtype,
        "state_dtype": config.cache.state_dtype,
        "kv_cache_dtype": config.cache.kv_cache_dtype,
        "fp8_activations": config.load.fp8_activations,
        "device": config.host.device,
        "prefill_chunk": min(config.scheduler.prefill_chunk, config.scheduler.max_num_batched_tokens),
    }


@torch.inference_mode()
def window_logits(engine: Engine, window: list[int]) -> torch.Tensor:
    """Logits [len(window) - 1, vocab] in the model's dtype: row i predicts window[i + 1]. One fresh sequence is
    prefilled chunk by chunk through the engine's runner, as prompt logprobs are."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    seq = engine.new_sequence("kl", None, window, params)
    engine.cache.admit(seq.cache, seq.all_ids, resume=seq.request.params.prompt_logprobs is None)
    chunk = min(engine.config.scheduler.prefill_chunk, engine.config.scheduler.max_num_batched_tokens)
    rows = []
    try:
        while seq.cache.num_computed < len(window):
            n = min(chunk, len(window) - seq.cache.num_computed)
            if not engine.cache.reserve(seq.cache, seq.cache.num_computed + n):
                raise DeltaspecError(
                    "The KV page pool cannot hold one window; lower --window or raise --num-kv-blocks."
                )
            (out,) = engine.runner.execute([Scheduled(seq, n)])
            engine.cache.after_pass(seq.cache, n, out.logged, verifying=bool(seq.proposal.tokens))
            rows.append(out.prompt_logits)  # [n, vocab]
    finally:
        engine.cache.release(seq.cache)
    return torch.cat(rows)[: len(window) - 1]


def log_probs(logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[N, vocab] logits -> [N, vocab] log-softmax in `dtype`."""
    return torch.log_softmax(logits.to(dtype), dim=-1)


def compute_dtype(*logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in logits) else torch.float32


def nll(lp: torch.Tensor, targets: torch.Tensor) -> float:
    """Summed negative log-likelihood of `targets` [N] under log-probabilities `lp` [N, vocab]."""
    return -lp.gather(1, targets[:, None]).double().sum().item()


class SavedBase:
    """A base-logits file written by `save_base`, read lazily row range by row range."""

    def __init__(self, path: str):
        if not Path(path).is_file():
            raise DeltaspecError(f"There is no base logits file at {path}; write one with --save-base.")
        try:
            self.file = safe_open(path, framework="pt", device="cpu")
        except (OSError, SafetensorError) as exc:
            raise DeltaspecError(f"Could not read the base logits file {path} ({exc}).") from None
        meta = self.file.metadata() or {}
        if meta.get("format") != FORMAT or set(self.file.keys()) != {"token_ids", "logits"}:
            raise DeltaspecError(f"{path} is not a base logits file written by `deltaspec kl --save-base`.")
        self.path, self.window = path, int(meta["window"])
        self.identity = {"path": meta["model"], "dtype": meta["dtype"], "state_dtype": meta.get("state_dtype")}
        self.identity["kv_cache_dtype"] = meta.get("kv_cache_dtype")
        self.identity["fp8_activations"] = meta.get("fp8_activations", "none")  # files from before the option: none
        self.identity |= {"device": meta["device"], "prefill_chunk": int(meta.get("prefill_chunk", 0)) or None}
        self.token_ids = self.file.get_tensor("token_ids").tolist()
        self.logits = self.file.get_slice("logits")
        self.vocab = self.logits.get_shape()[1]

    def rows(self, lo: int, hi: int) -> torch.Tensor:
        return self.logits[lo:hi]  # [hi - lo, vocab]


@contextmanager
def base_logits_writer(
    path: str, windows: list[list[int]], window: int, base_id: dict, first: torch.Tensor
) -> Iterator[Callable]:
    """Write a base-logits file window by window: yields `write(logits [rows, vocab])`, called once per window in
    order, `first` (the first window's logits) written already. The file appears at `path` only when complete."""
    ids = torch.tensor([t for w in windows for t in w], dtype=torch.int64)  # [tokens]
    rows, vocab = sum(len(w) - 1 for w in windows), first.shape[1]
    id_bytes, logit_bytes = ids.numel() * 8, rows * vocab * first.element_size()
    header = {
        "__metadata__": {
            "format": FORMAT,
            "model": base_id["path"],
            "dtype": base_id["dtype"],
            "state_dtype": base_id["state_dtype"],
            "kv_cache_dtype": base_id["kv_cache_dtype"],
            "fp8_activations": base_id["fp8_activations"],
            "device": base_id["device"],
            "prefill_chunk": str(base_id["prefill_chunk"]),
            "window": str(window),
        },
        "token_ids": {"dtype": "I64", "shape": [ids.numel()], "data_offsets": [0, id_bytes]},
        "logits": {
            "dtype": SAFETENSORS_DTYPES[first.dtype],
            "shape": [rows, vocab],
            "data_offsets": [id_bytes, id_bytes + logit_bytes],
        },
    }
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    partial = Path(f"{path}.partial")
    try:
        with partial.open("wb") as file:

            def write(logits: torch.Tensor) -> None:
                file.write(logits.contiguous().cpu().view(torch.uint8).numpy())

            file.write(struct.pack("<Q", len(text)) + text + ids.numpy().tobytes())
            write(first)
            yield write
        partial.replace(path)
    except OSError as exc:
        raise DeltaspecError(f"Could not write the base logits to {path} ({exc}).") from None
    finally:
        partial.unlink(missing_ok=True)


def scores(nll_sum: float, positions: int, nbytes: int) -> dict:
    loss = nll_sum / positions
    return {"loss": loss, "ppl": float(np.exp(loss)), "bits_per_byte": nll_sum / np.log(2) / max(nbytes, 1)}


@dataclass
class Tally:
    """What the windows scored so far add up to."""

    positions: int = 0
    nll_base: float = 0.0
    nll_model: float = 0.0
    agree: int = 0  # positions where both argmaxes agree
    kl: list[torch.Tensor] = field(default_factory=list)  # per block: KL of each position [block] float64, CPU

    def add(self, base: torch.Tensor, model: torch.Tensor | None, targets: torch.Tensor) -> None:
        """One window: logits [rows, vocab] of the base and of the model (None: the base alone) on one device, and
        the tokens they predict [rows]."""
        dtype = compute_dtype(base) if model is None else compute_dtype(base, model)
        for lo in range(0, len(targets), BLOCK):
            hi = lo + BLOCK
            lp_base = log_probs(base[lo:hi], dtype)  # [block, V]
            self.nll_base += nll(lp_base, targets[lo:hi])
            if model is None:
                continue
            lp_model = log_probs(model[lo:hi], dtype)  # [block, V]
            self.nll_model += nll(lp_model, targets[lo:hi])
            p = lp_base.exp()  # [block, V]
            self.kl.append(torch.where(p > 0, p * (lp_base - lp_model), 0).sum(-1).double().cpu())  # [block]
            self.agree += (base[lo:hi].argmax(-1) == model[lo:hi].argmax(-1)).sum().item()
        self.positions += len(targets)

    def divergence(self) -> dict:
        kl = torch.cat(self.kl).numpy()  # [positions] float64
        return {
            "kl": {
                "mean": float(kl.mean()),
                "median": float(np.median(kl)),
                "p99": float(np.percentile(kl, 99)),
                "max": float(kl.max()),
            },
            "top1_agreement": self.agree / self.positions,
        }


def check_request(
    has_model: bool,
    has_base: bool,
    base_logits: str | None,
    save_base: str | None,
    window: int,
    max_windows: int | None,
) -> None:
    """Refuse a request that names its base twice or never, saves a base it does not run, or compares nothing."""
    if has_base == (base_logits is not None):
        raise DeltaspecError("Give the base once: as a model (--base) or as saved logits (--base-logits).")
    if save_base is not None and not has_base:
        raise DeltaspecError("--save-base saves the base that runs; give it with --base, not --base-logits.")
    if not has_model and save_base is None:
        raise DeltaspecError("Give the model to compare with --model (or only --save-base F to save the base).")
    if window < 2 or (max_windows is not None and max_windows < 1):
        raise DeltaspecError("--window must be at least 2 tokens and --max-windows at least 1.")


def check_shared_vocabulary(model: LLM, vocab: int, windows: list[list[int]], theirs: list[list[int]], saved) -> None:
    """Refuse a model whose vocabulary size or tokens of the text (`theirs`) differ from the base's."""
    if model.engine.model_config.vocab_size != vocab:
        raise DeltaspecError(
            f"The base has a vocabulary of {vocab} tokens and the model {model.engine.model_config.vocab_size}; KL "
            "divergence needs one shared vocabulary."
        )
    if theirs == windows:
        return
    if saved is None:
        raise DeltaspecError(
            "The model tokenizes the text differently from the base; KL divergence needs one shared vocabulary."
        )
    raise DeltaspecError(
        f"The model's tokens of the text differ from those saved in {saved.path} ({len(windows)} windows of "
        f"{saved.window}); give the same text files, --window and --max-windows as when it was saved."
    )


def kl_divergence(
    model: LLM | None,
    text: str,
    window: int = 1024,
    max_windows: int | None = None,
    base: LLM | None = None,
    base_logits: str | None = None,
    save_base: str | None = None,
    progress: bool = False,
) -> dict:
    """KL(base || model) over the windows of `text`, the base run (`base`) or read from a file (`base_logits`);
    `save_base` also writes the running base's logits there. Without `model`, only the base is scored."""
    check_request(model is not None, base is not None, base_logits, save_base, window, max_windows)
    saved = SavedBase(base_logits) if base_logits is not None else None
    if saved is not None:
        windows, vocab, base_id = cut_windows(saved.token_ids, saved.window, None), saved.vocab, saved.identity
    else:
        windows = cut_windows(tokens_of(base, text), window, max_windows)
        vocab, base_id = base.engine.model_config.vocab_size, identity(base)
    if not windows:
        raise DeltaspecError("The text is too short to measure; give at least two tokens.")
    if model is not None:
        check_shared_vocabulary(model, vocab, windows, cut_windows(tokens_of(model, text), window, max_windows), saved)
    tally, write = Tally(), None
    with ExitStack() as stack, torch.inference_mode():
        for w in tqdm(windows, desc="KL divergence", unit="window", disable=not progress):
            rows = len(w) - 1
            if saved is not None:
                b = saved.rows(tally.positions, tally.positions + rows)  # [rows, V]
            else:
                b = window_logits(base.engine, w)  # [rows, V]
            if write is not None:
                write(b)
            elif save_base is not None:
                write = stack.enter_context(base_logits_writer(save_base, windows, window, base_id, b))
            m = window_logits(model.engine, w) if model is not None else None  # [rows, V]
            b = b.to(m.device) if m is not None else b
            tally.add(b, m, torch.tensor(w[1:], device=b.device))
    scorer = model if model is not None else base
    nbytes = sum(len(scorer.tokenizer.decode(w[1:], skip_special_tokens=True).encode()) for w in windows)
    report = {"base": {**base_id, **scores(tally.nll_base, tally.positions, nbytes)}}
    if base_logits is not None or save_base is not None:
        report["base"]["logits_file"] = base_logits or save_base
    if model is not None:
        report["model"] = {**identity(model), **scores(tally.nll_model, tally.positions, nbytes)}
    report.update(window=window, max_windows=max_windows, windows=len(windows), positions=tally.positions)
    report["commit"] = commit()
    report["bytes"] = nbytes
    return report | (tally.divergence() if model is not None else {})


def scoring_config(config: EngineConfig, window: int, **changes) -> EngineConfig:
    """`config` with `changes`, sized for scoring one window at a time when the streams and context are unset (on
    one device: windows run through the runner directly, outside the steps tensor-parallel ranks share)."""
    config = config.with_settings(**changes)
    if config.parallel.world_size > 1:
        raise DeltaspecError(
            "KL scoring and imatrix calibration run on one device; drop --tensor-parallel-size and "
            "--pipeline-parallel-size."
        )
    return config.with_settings(
        max_num_seqs=config.scheduler.max_num_seqs or 1, max_model_len=config.scheduler.max_model_len or window + 1
    )


def run_kl(
    config: EngineConfig,
    text: str,
    base: str | None,
    base_dtype: str | None,
    base_options: dict[str, str],
    base_logits: str | None,
    save_base: str | None,
    window: int,
    max_windows: int | None,
) -> dict:
    """The `deltaspec kl` command: load the base (unless its logits are saved; in `base_dtype`, default the model's,
    with its own `base_options`: `state_dtype`, `kv_cache_dtype`, `fp8_activations`) and the model of `config`
    (none when `config.load.model` is None: the base only runs to be saved), then `kl_divergence`."""
    check_request(config.load.model is not None, base is not None, base_logits, save_base, window, max_windows)
    if base_logits is not None:
        SavedBase(base_logits)  # a missing or foreign file fails before any model loads
    base_llm = model_llm = None
    if base is not None:
        changes = dict(model=base, dtype=base_dtype or config.load.dtype, **base_options)
        base_config = scoring_config(config, window, **changes)
        base_llm = LLM(progress=True, **base_config.flat())
    if config.load.model is not None:
        model_llm = LLM(progress=True, **scoring_config(config, window).flat())
    return kl_divergence(model_llm, text, window, max_windows, base_llm, base_logits, save_base, progress=True)
