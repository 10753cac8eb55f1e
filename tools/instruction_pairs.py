"""Instruction pairs for the default model's chat data: from each documented top-level function or method of a
Python file, requests for that function in several phrasings (templates keyed by name; the verb-led ones only when
the docstring opens with a known verb) and its source as the answer, in the Qwen chat format with thinking off.
Used by `build_corpus.py`.
"""

import ast
import hashlib
import re
import textwrap
import warnings
from collections.abc import Iterator

CHAT_FORMAT = (
    "<|im_start|>user\n{request}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n{answer}<|im_end|>\n"
)
MIN_BODY_LINES, MAX_BODY_LINES = 3, 60

# Verbs that open docstrings ("Return ...", "Returns ..."); they let a request say "that returns ..." or
# "to return ...".
VERBS = frozenset(
    """
    accept add append apply build calculate call check clean clear close collect compare compile compute configure
    connect construct convert copy count create decode delete determine display dispatch draw emit encode ensure escape
    estimate evaluate execute expand extract fetch filter find fit flatten flush format generate get group handle
    initialize insert install invoke iterate join list load lookup make map mark match merge normalize open parse
    perform plot populate predict prepare print process produce quote raise read register remove render replace reset
    resolve retrieve return run sanitize save scan search send serialize set setup show sort split start stop store
    strip take test tokenize transform translate traverse truncate try update use validate verify visit walk wrap
    write yield
    """.split()
)

NOT_AFTER_VERB = frozenset({"of", "is", "are", "was", "were", "has", "have", "which", "and", "or", "for", "in"})

FUNCTION_TEMPLATES = {
    "that": "Write a Python function `{sig}` that {third}",
    "which": "Implement `{defline}` which {third}",
    "to": "Write a Python function `{sig}` to {imperative}",
    "ask": "Can you write a Python function `{name}` that {third_q}?",
    "describe": "Write a Python function `{sig}` based on this description: {summary}",
    "spec": "Implement the following function in Python.\n\nSignature: `{defline}`\nDescription: {summary}",
    "after": "{summary}\n\nWrite this as a Python function `{sig}`.",
}
METHOD_TEMPLATES = {
    "that": "Write a method `{sig}` for the class `{cls}` that {third}",
    "which": "Implement `{cls}.{name}`, declared as `{defline}`, which {third}",
    "to": "Add a method `{sig}` to the `{cls}` class to {imperative}",
    "ask": "Can you write the `{name}` method of a `{cls}` class that {third_q}?",
    "describe": "Write the method `{cls}.{sig}` based on this description: {summary}",
    "spec": "Implement the following method of the class `{cls}` in Python.\n\n"
    "Signature: `{defline}`\nDescription: {summary}",
}
VERB_TEMPLATES = frozenset({"that", "which", "to", "ask"})


def stable_int(*parts: str) -> int:
    """A large integer that depends only on `parts` (the phrasing order of a function's requests)."""
    return int(hashlib.sha256("\0".join(parts).encode()).hexdigest(), 16)


def _summary(docstring: str) -> str | None:
    """The docstring's first paragraph on one line, or None when it is not a usable sentence."""
    paragraph = " ".join(docstring.strip().split("\n\n", 1)[0].split())
    if len(paragraph) > 300:
        match = re.match(r"(.{20,300}?[.!?])\s", paragraph + " ")
        if not match:
            return None
        paragraph = match.group(1)
    words = paragraph.split()
    if len(words) < 3 or not paragraph[0].isalpha() or ">>>" in paragraph or "deprecated" in paragraph.lower():
        return None
    if paragraph[-1] not in ".!?":
        paragraph = paragraph.rstrip(":;,") + "."
    return paragraph


def _third_person(verb: str) -> str:
    if verb.endswith(("s", "x", "z", "ch", "sh")):
        return verb + "es"
    if verb.endswith("y") and verb[-2:-1] not in ("a", "e", "i", "o", "u"):
        return verb[:-1] + "ies"
    return verb + "s"


def _verb_forms(summary: str) -> tuple[str, str] | None:
    """`(third person, imperative)` versions of the summary when it opens with a known verb, else None.

    "List of names." or "Set is ..." use the word as a noun, so the word after it must not be one of `NOT_AFTER_VERB`.
    """
    first, _, rest = summary.partition(" ")
    if rest.split(" ", 1)[0] in NOT_AFTER_VERB:
        return None
    word = first.lower()
    bases = [word] if word in VERBS else []
    bases += [b for b in (word[:-1], word[:-2], word[:-3] + "y") if word.endswith("s") and b in VERBS]
    if not bases:
        return None
    base = bases[0]
    return f"{_third_person(base)} {rest}", f"{base} {rest}"


def _function_source(lines: list[str], node: ast.AST) -> str | None:
    """The node's source, dedented; like `textwrap.dedent(ast.get_source_segment(text, node, padded=True))`.

    `lines` is the file split on `\\n` (the file is normalised), so this avoids re-splitting the whole file for
    every function. None when the `def` shares its first line with other code or cannot be dedented cleanly.
    """
    first = lines[node.lineno - 1]
    if first.encode()[: node.col_offset].strip():
        return None
    segment = lines[node.lineno - 1 : node.end_lineno]
    segment[-1] = segment[-1].encode()[: node.end_col_offset].decode()
    code = textwrap.dedent("\n".join(segment))
    return None if code[:1].isspace() else code


def function_requests(node: ast.AST, cls: str | None, summary: str) -> dict[str, str]:
    """The applicable request phrasings for a function or method, keyed by template name."""
    args = ast.unparse(node.args)
    returns = f" -> {ast.unparse(node.returns)}" if node.returns else ""
    prefix = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    fields = {
        "name": node.name,
        "cls": cls,
        "sig": f"{node.name}({args})",
        "defline": f"{prefix} {node.name}({args}){returns}:",
        "summary": summary,
    }
    forms = _verb_forms(summary)
    if forms:
        fields["third"], fields["imperative"] = forms
        fields["third_q"] = fields["third"].rstrip(".!?")
    templates = METHOD_TEMPLATES if cls else FUNCTION_TEMPLATES
    return {key: template.format(**fields) for key, template in templates.items() if forms or key not in VERB_TEMPLATES}


def instruction_pairs(source: str, path: str, text: str, phrasings: int) -> Iterator[tuple[str, bool, list[str]]]:
    """Yield `(answer, is_test, chat texts)` for each documented top-level function or method of a top-level class.

    The chat texts ask for the same function with up to `phrasings` different request templates, in an order
    derived from the source, path and qualified name; the answer is the function's dedented source (docstring
    included) in a ```python fence.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return
    lines = text.split("\n")
    candidates = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            candidates.append((node, None))
        elif isinstance(node, ast.ClassDef):
            candidates += [
                (item, node.name) for item in node.body if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
            ]
    for node, cls in candidates:
        docstring = ast.get_docstring(node)
        if not docstring or len(node.body) < 2:
            continue
        if not MIN_BODY_LINES <= node.end_lineno - node.body[1].lineno + 1 <= MAX_BODY_LINES:
            continue
        summary = _summary(docstring)
        code = _function_source(lines, node) if summary else None
        if code is None:
            continue
        requests = function_requests(node, cls, summary)
        qualname = f"{cls}.{node.name}" if cls else node.name
        keys = sorted(requests, key=lambda key: stable_int(source, path, qualname, key))[:phrasings]
        answer = f"```python\n{code}\n```"
        is_test = node.name.startswith("test") or (cls or "").startswith("Test")
        yield answer, is_test, [CHAT_FORMAT.format(request=requests[key], answer=answer) for key in keys]
