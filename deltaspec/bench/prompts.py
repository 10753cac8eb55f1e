"""The fixed prompt set of the serving benchmarks: code to complete and chat requests."""

from __future__ import annotations

import sysconfig
from pathlib import Path

CODE = [
    'def read_lines(path):\n    """Return the lines of the file at path, without newlines."""\n',
    'def merge_sorted(a, b):\n    """Merge two sorted lists into one sorted list."""\n',
    'class LRUCache:\n    """A least-recently-used cache with a fixed capacity."""\n\n'
    "    def __init__(self, capacity):\n",
    'def parse_query(url):\n    """Return the query parameters of url as a dict."""\n',
    'def chunks(items, size):\n    """Yield successive lists of at most size items."""\n',
    'async def fetch_all(session, urls):\n    """Fetch every url concurrently and return the bodies."""\n',
]

CHAT = [
    "Write a function that reverses a string.",
    "Write a Python function that returns the sum of a list.",
    "Implement a function that checks whether a number is prime.",
    "Write a function that counts the words in a text.",
]


def requests(count: int) -> list[tuple[str, dict]]:
    """`count` benchmark requests as (endpoint, body without model/stream), cycling code and chat."""
    out = []
    for i in range(count):
        if i % 2 == 0:
            out.append(("completions", {"prompt": CODE[i // 2 % len(CODE)]}))
        else:
            out.append(("chat/completions", {"messages": [{"role": "user", "content": CHAT[i // 2 % len(CHAT)]}]}))
    return out


def documents(count: int, chars: int, label: str = "") -> list[str]:
    """`count` different long documents of about `chars` characters: standard-library sources of this Python,
    each opening with a line naming it (`label` and its index), so that documents with other labels share
    no prefix with them."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"), key=lambda p: p.name)
    docs, i = [], 0
    while len(docs) < count:
        text = f"# {label}document {len(docs)}\n"
        while len(text) < chars:
            text += files[i % len(files)].read_text(errors="replace")
            i += 1
        docs.append(text[:chars])
    return docs
