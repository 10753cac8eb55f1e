"""Build the de-duplicated Python source corpus that the default deltaspec model is trained on.

Sources are the running interpreter's standard library and the pinned, permissively licensed sdists in `SOURCES`,
fetched from PyPI's JSON API, verified against their sha256 and cached under `build/sdists/`; the `*.py` files are
read from the archives in memory. Files that are too large, not UTF-8, mostly data, carrying a copyleft licence
header or containing the tokenizer's reserved markers are skipped; exact and near duplicates (same text once
comments and whitespace are removed) are kept once, first come first served in `SOURCES` order. Each remaining file
goes to the held-out split when `sha256(path + source) % 100 < 2`, else to training.

From the functions and methods with a docstring in each split, instruction pairs ("Write a Python function ...")
are formatted in the Qwen chat format, thinking off. Training functions get up to `--phrasings` request phrasings;
the training pairs are chosen deterministically (first phrasings before second ones) so that they make about
`--chat-fraction` of the training bytes. Held-out functions get one phrasing, and none whose code is also a
training answer. Everything is written to `build/corpus/`:

    train_code.jsonl, heldout_code.jsonl   one {"source", "path", "text"} per file
    train_chat.jsonl, heldout_chat.jsonl   one {"text"} per instruction pair
    manifest.json                          per-source versions, licences, hashes and counts; totals; the split rule

Usage: python tools/build_corpus.py [--out build/corpus] [--cache build/sdists] [--chat-fraction 0.25] [--phrasings 2]
"""

import argparse
import hashlib
import io
import json
import os
import platform
import re
import sysconfig
import tarfile
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from instruction_pairs import CHAT_FORMAT, instruction_pairs
from tqdm import tqdm

REPO_ROOT = Path(__file__).resolve().parent.parent


class Source(NamedTuple):
    """A pinned PyPI sdist: `exclude` lists path fragments whose files are left out (vendored code under other
    terms)."""

    name: str
    version: str
    license: str
    sha256: str
    exclude: tuple[str, ...] = ()


# Order matters for de-duplication: the first copy of a file wins, so stand-alone projects come before the ones
# that vendor them (pip, setuptools).
SOURCES = (
    Source("requests", "2.34.2", "Apache-2.0", "f288924cae4e29463698d6d60bc6a4da69c89185ad1e0bcc4104f584e960b9ed"),
    Source("urllib3", "2.8.0", "MIT", "63bf2ead4c879426ebf22ef2a781eeb4aa3b4ae798a0435506f8687fd5bb9b63"),
    Source("httpx", "0.28.1", "BSD-3-Clause", "75e98c5f16b0f35b567856f597f06ff2270a374470a5c2392242528e3e3e42fc"),
    Source(
        "packaging",
        "26.4",
        "Apache-2.0 OR BSD-2-Clause",
        "c4b671c41ddb9bf26e543c37723610d28fb6bf7affc4da17cf048d419d2c062a",
    ),
    Source("more-itertools", "11.2.1", "MIT", "cbf08fd0af284dc69718b9b76a8e6203df624d70209ea511e4219d350c856f63"),
    Source("toolz", "1.2.0", "BSD-3-Clause", "9667a038e9d6ecba37995e26cb2f59ec6420b6ad8dd9677de59db9b956b08490"),
    Source("boltons", "26.2.0", "BSD-3-Clause", "d39cfd15c1a1c3bd4d705c82252fa9edb8e4f5e8cc039f8e39afac7b1b47e92c"),
    Source("attrs", "26.1.0", "MIT", "d03ceb89cb322a8fd706d4fb91940737b6642aa36998fe130a9bc96c985eff32"),
    Source("click", "8.5.1", "BSD-3-Clause", "9bbfada76703fd1d784b83eea012e3e8c6a001a876543ef104fa56aaaeb072b4"),
    Source("pyparsing", "3.3.3", "MIT", "928ae7e20211f3b6f3915a72f06a0cfd29ab9d24279dd6346b6b1a7146397d36"),
    Source("pygments", "2.21.0", "BSD-2-Clause", "610ca751c9bc2492b38eb9a38a7fbc93edbbb2d7182edaf34e66ae493dee5c8c"),
    Source("rich", "15.0.0", "MIT", "edd07a4824c6b40189fb7ac9bc4c52536e9780fbbfbddf6f1e2502c31b068c36"),
    Source(
        "prompt_toolkit", "3.0.53", "BSD-3-Clause", "9ec8a0ad96d5c56148b3f914aa79c1564c3fde5d2e6b876e7bc327e353cf8fa6"
    ),
    Source("jinja2", "3.1.6", "BSD-3-Clause", "0137fb05990d35f1275a587e9aee6d56da821fc83491a0fb838183be43f66d6d"),
    Source("werkzeug", "3.1.9", "BSD-3-Clause", "55ca7c70a75689be937aa27f8ff4b018f06ff4838fc73045560bf0f5a1291060"),
    Source("flask", "3.1.3", "BSD-3-Clause", "0ef0e52b8a9cd932855379197dd8f94047b359ca0a78695144304cb45f87c9eb"),
    Source("starlette", "1.10.0", "BSD-3-Clause", "b8399098d4c1e3522734f7235dc79b1fc967f96cf139c81e0fa30479e0685f9b"),
    Source("pydantic", "2.14.4", "MIT", "7c19f1d46f8accf55a4617a6116e1ade64840870f397b846a2c53fb9019414ba"),
    Source("fastapi", "0.165.0", "MIT", "dd94d4128319c1e1d50535ab023ab698f850a4d2822f0e181747b46f4ff3c0ab"),
    Source("tornado", "6.6.1", "Apache-2.0", "28e6311402af59c8b02e3fa0f5e7d8eb465b25081381803b127d97e6a4395d5a"),
    Source(
        "aiohttp", "3.14.5", "Apache-2.0 AND MIT", "5558a7f5a05af9ecf744af91e5baefc436f93c9333e656c27ec253f9a6bbe178"
    ),
    Source("kombu", "5.7.0", "BSD-3-Clause", "31e62fdfd2381caa3422f8e02b84a491d9a2180ddda74507b57f4cb1e1c2c2c9"),
    Source("celery", "5.7.0", "BSD-3-Clause", "6a5dfcf6662287204f009a02002b9e66c83d4105e47ebabdc7079108772fc6f0"),
    Source("django", "6.1.3", "BSD-3-Clause", "b5d2d9e35295065d13b1927b3f19a59bd119f737aa6299def14ccca1ae3c8c0d"),
    Source("sqlalchemy", "2.1.9", "MIT", "d700a8b2edfb26282a470333d6bc4a454c4acda4d201a3bea7b72fa76c217d28"),
    Source(
        "docutils",
        "0.23",
        "Public-Domain AND BSD-2-Clause (.py files)",
        "746f5060322511280a1e50eb76846ed6bf2342984b2ac04dc42caa1a8d78799e",
    ),
    Source("sphinx", "9.2.0", "BSD-2-Clause", "90470459f3cab15d9dfed146c71cf77694b0445df17b2e0e69059cb9f7fc9ee4"),
    Source("babel", "2.19.0", "BSD-3-Clause", "fddd2cbbbac7c299af3c2880be23609c331bd94f0912baca6cb0abfe054dfc27"),
    Source("parso", "0.8.7", "MIT", "eaaac4c9fdd5e9e8852dc778d2d7405897ec510f2a298071453e5e3a07914bb1"),
    Source("jedi", "0.20.1", "MIT", "2f71208c3f9c1bca057c0e90d3f272aba44ace88fc4067d7587e9e069331b7e5"),
    Source("ipython", "9.18.1", "BSD-3-Clause", "6319c0f5372c196397899479e6db1783dd7937abae06815d1317e8d5d51aaaaf"),
    Source("black", "26.10.1", "MIT", "5f9f83beae62437e060dafd53d7f1fc327e3d3494f74d72ee5c2b73eb90fc4e7"),
    Source("mypy", "2.4.1", "MIT", "63b590965691e540a335fa74dadf31a7069142f6b72e234689bbd244edf55623"),
    Source("networkx", "3.7", "BSD-3-Clause", "fd77a511bd90f39f3d016351345b52cf5319b813bdca01de3f755d3cca62e96a"),
    Source(
        "numpy",
        "2.5.5",
        "BSD-3-Clause",
        "5cddc243c75114ba845f01b1f87aca1572dbf7b6c2d88636ed3e1d2bccd7f1bf",
        ("vendored-meson/",),
    ),
    Source("scikit-learn", "1.9.1", "BSD-3-Clause", "629cada3e33e2b9bf376cdc7614a47a4140b8aedc1d836579e359736fbd82977"),
    Source(
        "matplotlib",
        "3.11.2",
        "PSF-2.0 style (Matplotlib License)",
        "cec596316640f2b394b8f0daa0ea61a8eae82d017b620b9f202befb972a59ea4",
    ),
    Source("dask", "2026.8.0", "BSD-3-Clause", "8a94c37b5de6d869343340dc26c3c3acca7ec48a3abdabe00ea3abb1125884d5"),
    Source("bokeh", "3.10.2", "BSD-3-Clause", "d9fba1004fae149c6e6d54ba37410e52b8d4622ed5c6dad2220afa1b61362de0"),
    # pip vendors certifi (MPL-2.0); setuptools vendors autocommand (LGPL-3.0).
    Source(
        "pip", "26.3", "MIT", "6c36ae7da8695be67e3cd9f7d87919667ced53f57ce2ede75d89b5912ed2bc4c", ("_vendor/certifi/",)
    ),
    Source(
        "setuptools",
        "84.2.1",
        "MIT",
        "3ff8b3b5492a0aa66960f4419365a86b84e013070d4313e4d4a6894f5d64d6bc",
        ("_vendor/autocommand",),
    ),
)

STDLIB_NAME = "python-stdlib"
PYPI_JSON = "https://pypi.org/pypi"
HELDOUT_PERCENT = 2
SPLIT_RULE = f"held-out iff int(sha256((path + source).encode()).hexdigest(), 16) % 100 < {HELDOUT_PERCENT}"

MAX_FILE_BYTES = 1_000_000
LONG_LINE = 300
RESERVED_MARKERS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>")
COPYLEFT = re.compile(r"GNU (?:Lesser |Library |Affero )?General Public License|Mozilla Public License|\bL?GPL", re.I)
LITERAL_LINE = re.compile(r"\s*(?:[-+]?\.?\d|[rbuRBU]{0,2}['\"]|[(\[{}\])])")
NEAR_DUP_NOISE = re.compile(r"#[^\n]*|\s+")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def is_heldout(path: str, source: str) -> bool:
    """The split rule: a file is held out when `sha256(path + source) % 100 < HELDOUT_PERCENT`."""
    return int(_sha256((path + source).encode()), 16) % 100 < HELDOUT_PERCENT


# --------------------------------------------------------------------------------------------------------------
# Fetching and reading sources
# --------------------------------------------------------------------------------------------------------------


def _sdist_entry(source: Source) -> tuple[str, dict]:
    """Return the JSON API address used and the `sdist` file entry of `source`'s pinned version."""
    url = f"{PYPI_JSON}/{source.name}/{source.version}/json"
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            files = json.load(response)["urls"]
    except urllib.error.HTTPError as error:
        if error.code != 404:
            raise
        # Some PyPI mirrors only serve the project document; it lists every release's files.
        url = f"{PYPI_JSON}/{source.name}/json"
        with urllib.request.urlopen(url, timeout=60) as response:
            files = json.load(response)["releases"].get(source.version, [])
    sdists = [entry for entry in files if entry["packagetype"] == "sdist"]
    if not sdists:
        raise RuntimeError(f"{source.name} {source.version} has no sdist on PyPI.")
    return url, sdists[0]


def fetch_sdist(source: Source, cache: Path) -> bytes:
    """Return the verified sdist archive of `source`, downloading it into `cache` unless already there."""
    for suffix in (".tar.gz", ".zip"):
        path = cache / f"{source.name}-{source.version}{suffix}"
        if path.exists():
            data = path.read_bytes()
            if _sha256(data) == source.sha256:
                return data
    api_url, entry = _sdist_entry(source)
    if entry["digests"]["sha256"] != source.sha256:
        raise RuntimeError(
            f"{source.name} {source.version}: PyPI lists sha256 {entry['digests']['sha256']}, pinned {source.sha256}."
        )
    with urllib.request.urlopen(urllib.parse.urljoin(api_url, entry["url"]), timeout=300) as response:
        data = response.read()
    if _sha256(data) != source.sha256:
        raise RuntimeError(f"{source.name} {source.version}: downloaded sdist does not match its sha256.")
    suffix = ".zip" if entry["filename"].endswith(".zip") else ".tar.gz"
    cache.mkdir(parents=True, exist_ok=True)
    tmp = cache / f"{source.name}-{source.version}{suffix}.part"
    tmp.write_bytes(data)
    tmp.replace(cache / f"{source.name}-{source.version}{suffix}")
    return data


def sdist_files(data: bytes) -> Iterator[tuple[str, int, bytes | None]]:
    """Yield `(path, size, content)` for each `*.py` member, sorted, without the archive's top folder.

    `content` is None for members larger than `MAX_FILE_BYTES` (they are not read).
    """
    if zipfile.is_zipfile(io.BytesIO(data)):
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            infos = sorted(
                (i for i in archive.infolist() if not i.is_dir() and i.filename.endswith(".py")),
                key=lambda i: i.filename,
            )
            for info in infos:
                content = archive.read(info) if info.file_size <= MAX_FILE_BYTES else None
                yield info.filename.split("/", 1)[-1], info.file_size, content
        return
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as archive:
        members = sorted(
            (m for m in archive.getmembers() if m.isfile() and m.name.endswith(".py")), key=lambda m: m.name
        )
        for member in members:
            content = archive.extractfile(member).read() if member.size <= MAX_FILE_BYTES else None
            yield member.name.split("/", 1)[-1], member.size, content


def stdlib_files(root: Path) -> Iterator[tuple[str, int, bytes | None]]:
    """Yield `(path, size, content)` for the standard library's `*.py` files, sorted, without site-packages."""
    paths = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in ("site-packages", "__pycache__")]
        paths += [Path(folder) / n for n in names if n.endswith(".py")]
    for path in sorted(paths, key=lambda p: p.relative_to(root).as_posix()):
        size = path.stat().st_size
        yield path.relative_to(root).as_posix(), size, path.read_bytes() if size <= MAX_FILE_BYTES else None


# --------------------------------------------------------------------------------------------------------------
# Filtering and de-duplication
# --------------------------------------------------------------------------------------------------------------


def normalise(content: bytes) -> str | None:
    """Decode strict UTF-8 (dropping a BOM) and turn every line ending into `\\n`; None when not UTF-8."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text.removeprefix("\ufeff").replace("\r\n", "\n").replace("\r", "\n")


def looks_like_data(text: str) -> bool:
    """True for generated tables and embedded data rather than code.

    That is: most lines (or most characters) are in lines longer than `LONG_LINE`, or a file of at least 200
    non-blank lines has more than 70 % of them starting with a literal or a bracket.
    """
    lines = [line for line in text.split("\n") if line.strip()]
    long_lines = [line for line in lines if len(line) > LONG_LINE]
    if 2 * len(long_lines) > len(lines) or 2 * sum(map(len, long_lines)) > len(text):
        return True
    return len(lines) >= 200 and sum(1 for line in lines if LITERAL_LINE.match(line)) > 0.7 * len(lines)


def skip_reason(path: str, text: str | None, exclude: tuple[str, ...]) -> str | None:
    """Why a file is left out, or None to keep it (size and de-duplication are checked elsewhere)."""
    if any(fragment in path for fragment in exclude):
        return "excluded_path"
    if text is None:
        return "not_utf8"
    if not text.strip():
        return "empty"
    if COPYLEFT.search(text[:5000]):
        return "copyleft_header"
    if any(marker in text for marker in RESERVED_MARKERS):
        return "reserved_marker"
    if looks_like_data(text):
        return "data"
    return None


def near_duplicate_key(text: str) -> str:
    """Hash of the text without comments and whitespace: vendored or re-indented copies share it."""
    return _sha256(NEAR_DUP_NOISE.sub("", text).encode())


# --------------------------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------------------------


def _write_jsonl(path: Path, records: list[dict]) -> None:
    tmp = path.with_suffix(path.suffix + ".part")
    with tmp.open("w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    tmp.replace(path)


def collect_files(cache: Path) -> tuple[dict, dict[str, list[dict]]]:
    """Read, filter and de-duplicate every source; return per-source stats and the kept files by split."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    plan = [(STDLIB_NAME, platform.python_version(), "PSF-2.0", None, ())]
    plan += [(s.name, s.version, s.license, s, s.exclude) for s in SOURCES]
    seen_exact: set[str] = set()
    seen_near: set[str] = set()
    splits: dict[str, list[dict]] = {"train": [], "heldout": []}
    stats = {}
    for name, version, license_, source, exclude in tqdm(plan, desc="sources", unit="src"):
        if source is None:
            files, sha256 = stdlib_files(stdlib), None
        else:
            data = fetch_sdist(source, cache)
            files, sha256 = sdist_files(data), source.sha256
        entry = {"version": version, "license": license_, "sha256": sha256, "files_seen": 0, "skipped": {}}
        entry.update(train_files=0, heldout_files=0, bytes=0, train_bytes=0, heldout_bytes=0)
        for path, size, content in tqdm(files, desc=name, unit="file", leave=False):
            entry["files_seen"] += 1
            text = normalise(content) if content is not None else None
            reason = "too_large" if size > MAX_FILE_BYTES else skip_reason(path, text, exclude)
            if reason is None:
                exact, near = _sha256(text.encode()), near_duplicate_key(text)
                reason = "duplicate" if exact in seen_exact else "near_duplicate" if near in seen_near else None
                seen_exact.add(exact)
                seen_near.add(near)
            if reason:
                entry["skipped"][reason] = entry["skipped"].get(reason, 0) + 1
                continue
            split = "heldout" if is_heldout(path, name) else "train"
            splits[split].append({"source": name, "path": path, "text": text})
            nbytes = len(text.encode())
            entry[f"{split}_files"] += 1
            entry[f"{split}_bytes"] += nbytes
            entry["bytes"] += nbytes
        entry["skipped"] = dict(sorted(entry["skipped"].items()))
        stats[name] = entry
    return stats, splits


def build_pairs(
    files: list[dict], phrasings: int, exclude_answers: set[str]
) -> tuple[list[tuple[bool, list[str]]], set[str]]:
    """`(is_test, phrasings)` of the instruction pairs of `files`, one per distinct answer not in `exclude_answers`."""
    pairs, answers = [], set()
    for record in tqdm(files, desc="instruction pairs", unit="file"):
        for answer, is_test, texts in instruction_pairs(record["source"], record["path"], record["text"], phrasings):
            key = _sha256(answer.encode())
            if key in answers or key in exclude_answers:
                continue
            answers.add(key)
            pairs.append((is_test, texts))
    return pairs, answers


def subsample(pairs: list[tuple[bool, list[str]]], budget: int) -> list[tuple[int, str]]:
    """Choose `(function index, chat text)` totalling at most `budget` UTF-8 bytes, deterministically, in corpus order.

    Every function's first phrasing is considered before any second one, and within a round other functions
    before tests, each group in a pseudo-random order (sha256 of the text): extra phrasings only fill what one
    phrasing per function leaves of the budget, and go to non-test functions first.
    """
    candidates = [
        (rank, is_test, _sha256(text.encode()), i, text)
        for i, (is_test, texts) in enumerate(pairs)
        for rank, text in enumerate(texts)
    ]
    chosen, used = [], 0
    for rank, _, _, i, text in sorted(candidates):
        size = len(text.encode())
        if used + size <= budget:
            chosen.append((i, rank, text))
            used += size
    return [(i, text) for i, _, text in sorted(chosen)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "build" / "corpus", help="output folder")
    parser.add_argument("--cache", type=Path, default=REPO_ROOT / "build" / "sdists", help="sdist download cache")
    parser.add_argument(
        "--chat-fraction", type=float, default=0.25, help="target share of chat pairs in the training bytes"
    )
    parser.add_argument("--phrasings", type=int, default=2, help="most request phrasings per training function")
    args = parser.parse_args()

    stats, splits = collect_files(args.cache)
    train_pairs, train_answers = build_pairs(splits["train"], args.phrasings, set())
    heldout_pairs = [texts[0] for _, texts in build_pairs(splits["heldout"], 1, train_answers)[0]]
    code_bytes = sum(s["train_bytes"] for s in stats.values())
    budget = int(code_bytes * args.chat_fraction / (1 - args.chat_fraction))
    chosen = subsample(train_pairs, budget)
    train_chat = [text for _, text in chosen]

    args.out.mkdir(parents=True, exist_ok=True)
    _write_jsonl(args.out / "train_code.jsonl", splits["train"])
    _write_jsonl(args.out / "heldout_code.jsonl", splits["heldout"])
    _write_jsonl(args.out / "train_chat.jsonl", [{"text": t} for t in train_chat])
    _write_jsonl(args.out / "heldout_chat.jsonl", [{"text": t} for t in heldout_pairs])

    chat_bytes = sum(len(t.encode()) for t in train_chat)
    manifest = {
        "sources": stats,
        "split_rule": SPLIT_RULE,
        "filters": {
            "max_file_bytes": MAX_FILE_BYTES,
            "data": f"more than half the lines or characters in lines over {LONG_LINE} chars, "
            "or >=200 lines with >70% literal lines",
            "copyleft_header": COPYLEFT.pattern,
            "near_duplicate": "sha256 of the text without #-comments and whitespace",
        },
        "chat": {"target_byte_fraction": args.chat_fraction, "max_phrasings": args.phrasings, "format": CHAT_FORMAT},
        "totals": {
            "train_files": len(splits["train"]),
            "heldout_files": len(splits["heldout"]),
            "train_code_bytes": code_bytes,
            "heldout_code_bytes": sum(s["heldout_bytes"] for s in stats.values()),
            "train_chat_functions": len(train_pairs),
            "train_chat_functions_used": len({i for i, _ in chosen}),
            "train_chat_pairs": len(train_chat),
            "train_chat_bytes": chat_bytes,
            "train_chat_byte_fraction": round(chat_bytes / (chat_bytes + code_bytes), 4),
            "heldout_chat_pairs": len(heldout_pairs),
            "heldout_chat_bytes": sum(len(t.encode()) for t in heldout_pairs),
        },
    }
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(json.dumps(manifest["totals"], indent=2))


if __name__ == "__main__":
    main()
