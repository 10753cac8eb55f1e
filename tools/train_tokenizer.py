"""Train the byte-level BPE tokenizer of the default deltaspec model on the training corpus.

The tokenizer follows Qwen's layout: the Qwen2 split regex, then byte-level mapping (no prefix space), a BPE of
`vocab_size - 7` entries (the 256 byte symbols plus merges), and the added tokens at the end of the vocabulary in the
order `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` (special) and `<think>`, `</think>`, `<tool_call>`, `</tool_call>`.
It is trained on `train_code.jsonl` and `train_chat.jsonl` (the chat texts split around the added tokens, so no merge
spans them) and written as `tokenizer.json` plus a `tokenizer_config.json` carrying the chat template of
`tests/tiny_tokenizer.py`. Training is deterministic for a given corpus.

Usage: python tools/train_tokenizer.py [--vocab-size 8192] [--corpus build/corpus] [--out build/tokenizer]
"""

import argparse
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from tests.tiny_tokenizer import SPECIAL_TOKENS, TEXT_TOKENS, write_tokenizer_config  # noqa: E402

QWEN2_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""  # noqa: E501
ADDED_SPLIT = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS + TEXT_TOKENS))
ROUND_TRIP_SAMPLES = (
    "def f(x):\n    if x:\n\t\treturn  x  \n\n\n        # trailing   \n",
    "class A:\n    '''Doc.'''\n\n    def __init__(self, y: int = 3) -> None:\n        self.y = y\r\n",
    'x = {\'a\': [1, 2.5e-3, -0x1F], "b": f"{y!r:>10}"}  # ünïcödé ✓ 中文 😀\n',
    "<|im_start|>user\nWrite it.<|im_end|>\n<|im_start|>assistant\n"
    "<think>\n\n</think>\n\n```python\npass\n```<|im_end|>\n",
)


def corpus_texts(corpus: Path) -> Iterator[str]:
    """Yield the training code files, then the chat texts cut into the pieces between added tokens."""
    with (corpus / "train_code.jsonl").open(encoding="utf-8") as handle:
        for line in tqdm(handle, desc="train_code", unit="doc"):
            yield json.loads(line)["text"]
    with (corpus / "train_chat.jsonl").open(encoding="utf-8") as handle:
        for line in tqdm(handle, desc="train_chat", unit="doc"):
            yield from (piece for piece in ADDED_SPLIT.split(json.loads(line)["text"]) if piece)


def build_tokenizer() -> Tokenizer:
    """An untrained tokenizer with the Qwen2 split, byte-level mapping and byte-level decoder."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def train(corpus: Path, vocab_size: int) -> Tokenizer:
    """Train the BPE on the corpus and append the added tokens, for exactly `vocab_size` ids in all."""
    added = len(SPECIAL_TOKENS) + len(TEXT_TOKENS)
    tokenizer = build_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - added,
        min_frequency=2,
        show_progress=True,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus_texts(corpus), trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TEXT_TOKENS])
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(f"Trained vocabulary has {tokenizer.get_vocab_size()} ids, expected {vocab_size}.")
    ids = [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS + TEXT_TOKENS]
    if ids != list(range(vocab_size - added, vocab_size)):
        raise RuntimeError(f"Added tokens landed at {ids}, not at the end of the vocabulary.")
    return tokenizer


def check_round_trip(tokenizer: Tokenizer, texts: list[str]) -> None:
    """Raise unless every text decodes back exactly (whitespace and added tokens included)."""
    for text in texts:
        decoded = tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False)
        if decoded != text:
            raise RuntimeError(f"Tokenizer does not round-trip {text[:80]!r}: got {decoded[:80]!r}.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab-size", type=int, default=8192, help="total vocabulary, added tokens included")
    parser.add_argument(
        "--corpus", type=Path, default=REPO_ROOT / "build" / "corpus", help="folder of build_corpus.py's output"
    )
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "build" / "tokenizer", help="output folder")
    parser.add_argument("--model-max-length", type=int, default=4096, help="model_max_length in tokenizer_config.json")
    parser.add_argument("--check-docs", type=int, default=200, help="training documents whose round trip is checked")
    args = parser.parse_args()

    tokenizer = train(args.corpus, args.vocab_size)
    with (args.corpus / "train_code.jsonl").open(encoding="utf-8") as handle:
        samples = [json.loads(line)["text"] for _, line in zip(range(args.check_docs), handle)]
    check_round_trip(tokenizer, list(ROUND_TRIP_SAMPLES) + samples)
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(args.out / "tokenizer.json"))
    write_tokenizer_config(tokenizer, args.out, args.model_max_length)
    print(
        f"vocab {tokenizer.get_vocab_size()}, round trip checked on {len(samples) + len(ROUND_TRIP_SAMPLES)} texts, "
        f"wrote {args.out}"
    )


if __name__ == "__main__":
    main()
