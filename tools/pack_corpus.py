"""Tokenize the corpus into flat uint16 token streams for training and evaluating the default deltaspec model.

Every document (a code file or a chat pair) is encoded with the trained tokenizer and followed by `<|endoftext|>`.
The training stream is the code files and chat pairs of the training split in one shuffled order (fixed seed); the
held-out code and chat streams keep corpus order. Outputs, in `build/pack/`:

    train.bin, heldout_code.bin, heldout_chat.bin   raw little-endian uint16 token ids
    train.bin.xz                                     train.bin compressed with lzma (for shipping to the GPU machine)
    meta.json                                        token and UTF-8 byte counts (for bits per byte), vocabulary size,
                                                     tokenizer sha256, chat share of the training tokens, file hashes

Each stream is read back and its first documents decoded and compared with their texts before anything is reported.

Usage: python tools/pack_corpus.py [--corpus build/corpus] [--tokenizer build/tokenizer] [--out build/pack]
"""

import argparse
import hashlib
import json
import lzma
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm

REPO_ROOT = Path(__file__).resolve().parent.parent
EOT = "<|endoftext|>"


def read_texts(path: Path) -> list[str]:
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line)["text"] for line in handle]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def write_stream(tokenizer: Tokenizer, texts: list[str], path: Path, batch_size: int, desc: str) -> np.ndarray:
    """Encode `texts` in order into `path`, each followed by `<|endoftext|>`; return each document's token count."""
    eot = np.array([tokenizer.token_to_id(EOT)], dtype=np.uint16)
    counts = np.zeros(len(texts), dtype=np.int64)
    tmp = path.with_suffix(path.suffix + ".part")
    with tmp.open("wb") as handle, tqdm(total=len(texts), desc=desc, unit="doc") as progress:
        for start in range(0, len(texts), batch_size):
            for offset, encoding in enumerate(
                tokenizer.encode_batch(texts[start : start + batch_size], add_special_tokens=False)
            ):
                ids = np.asarray(encoding.ids, dtype=np.uint16)
                handle.write(ids.astype("<u2").tobytes())
                handle.write(eot.astype("<u2").tobytes())
                counts[start + offset] = len(ids) + 1
            progress.update(min(batch_size, len(texts) - start))
    tmp.replace(path)
    return counts


def check_stream(tokenizer: Tokenizer, path: Path, texts: list[str], counts: np.ndarray, docs: int) -> None:
    """Read `path` back and check that its first `docs` documents decode exactly to their texts."""
    stream = np.fromfile(path, dtype="<u2")
    if len(stream) != counts.sum():
        raise RuntimeError(f"{path} holds {len(stream)} tokens, expected {counts.sum()}.")
    eot = tokenizer.token_to_id(EOT)
    start = 0
    for text, count in zip(texts[:docs], counts[:docs]):
        ids = stream[start : start + count]
        if ids[-1] != eot or tokenizer.decode(ids[:-1].tolist(), skip_special_tokens=False) != text:
            raise RuntimeError(f"{path}: the document at token {start} does not decode to its text.")
        start += count


def compress(path: Path, preset: int) -> Path:
    """Write `path` + `.xz` with lzma at `preset`, streaming."""
    target = path.with_name(path.name + ".xz")
    tmp = target.with_suffix(".xz.part")
    size = path.stat().st_size
    with (
        path.open("rb") as source,
        lzma.open(tmp, "wb", preset=preset) as sink,
        tqdm(total=size, desc="xz", unit="B", unit_scale=True) as progress,
    ):
        while chunk := source.read(1 << 22):
            sink.write(chunk)
            progress.update(len(chunk))
    tmp.replace(target)
    return target


def utf8_bytes(texts: list[str]) -> int:
    return sum(len(text.encode("utf-8")) for text in texts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--corpus", type=Path, default=REPO_ROOT / "build" / "corpus", help="folder of build_corpus.py's output"
    )
    parser.add_argument(
        "--tokenizer", type=Path, default=REPO_ROOT / "build" / "tokenizer", help="folder of tokenizer.json"
    )
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "build" / "pack", help="output folder")
    parser.add_argument("--seed", type=int, default=0, help="seed of the training documents' shuffle")
    parser.add_argument("--batch-size", type=int, default=256, help="documents per encode_batch call")
    parser.add_argument("--xz-preset", type=int, default=6, help="lzma preset for train.bin.xz")
    parser.add_argument("--check-docs", type=int, default=200, help="documents per stream decoded back and compared")
    args = parser.parse_args()

    tokenizer_path = args.tokenizer / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    vocab_size = tokenizer.get_vocab_size()
    if vocab_size > 1 << 16:
        raise ValueError(f"Vocabulary of {vocab_size} ids does not fit uint16.")
    args.out.mkdir(parents=True, exist_ok=True)

    code = read_texts(args.corpus / "train_code.jsonl")
    chat = read_texts(args.corpus / "train_chat.jsonl")
    order = np.random.default_rng(args.seed).permutation(len(code) + len(chat))
    train = [code[i] if i < len(code) else chat[i - len(code)] for i in order]
    is_chat = order >= len(code)
    counts = write_stream(tokenizer, train, args.out / "train.bin", args.batch_size, "train")
    check_stream(tokenizer, args.out / "train.bin", train, counts, args.check_docs)
    chat_tokens = int(counts[is_chat].sum())

    splits = {
        "train": {
            "file": "train.bin",
            "documents": len(train),
            "tokens": int(counts.sum()),
            "text_bytes": utf8_bytes(train),
            "code_documents": len(code),
            "code_tokens": int(counts.sum()) - chat_tokens,
            "code_text_bytes": utf8_bytes(code),
            "chat_documents": len(chat),
            "chat_tokens": chat_tokens,
            "chat_text_bytes": utf8_bytes(chat),
            "chat_token_fraction": round(chat_tokens / int(counts.sum()), 4),
        }
    }
    for name in ("heldout_code", "heldout_chat"):
        texts = read_texts(args.corpus / f"{name}.jsonl")
        held = write_stream(tokenizer, texts, args.out / f"{name}.bin", args.batch_size, name)
        check_stream(tokenizer, args.out / f"{name}.bin", texts, held, args.check_docs)
        splits[name] = {
            "file": f"{name}.bin",
            "documents": len(texts),
            "tokens": int(held.sum()),
            "text_bytes": utf8_bytes(texts),
        }
    for split in splits.values():
        split["bytes_per_token"] = round(split["text_bytes"] / split["tokens"], 4)
        split["sha256"] = file_sha256(args.out / split["file"])

    packed = compress(args.out / "train.bin", args.xz_preset)
    meta = {
        "dtype": "uint16 little-endian",
        "vocab_size": vocab_size,
        "eot_token": EOT,
        "eot_token_id": tokenizer.token_to_id(EOT),
        "tokenizer_sha256": file_sha256(tokenizer_path),
        "shuffle_seed": args.seed,
        "notes": "tokens count one <|endoftext|> after every document; "
        "text_bytes are the documents' UTF-8 bytes without it",
        "splits": splits,
        "train_xz": {
            "file": packed.name,
            "bytes": packed.stat().st_size,
            "preset": args.xz_preset,
            "sha256": file_sha256(packed),
        },
    }
    (args.out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps(meta, indent=2))


if __name__ == "__main__":
    main()
