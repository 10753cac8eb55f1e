"""The README and docs/: relative links resolve, anchors name headings, the README stays a five-minute read.

Pure text checks (no torch import), so they run in well under a second.
"""

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]

FENCE = re.compile(r"^(```|~~~)")
INLINE_CODE = re.compile(r"`[^`\n]*`")
# [text](target) or [text](target "title"); images too. Nested brackets in the text are not used in these pages.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(text: str) -> list[str]:
    """The page's lines outside fenced code blocks, with inline code spans blanked."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append(INLINE_CODE.sub("``", line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.replace("`", "").strip().lower()
    kept = [c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN"]
    return "".join(kept).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    counts: dict[str, int] = {}
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        m = None if fenced else HEADING.match(line)
        if m:
            base = slug(m.group(2))
            n = counts.get(base, 0)
            counts[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def relative_links(path: Path) -> list[str]:
    links = []
    for line in prose_lines(path.read_text(encoding="utf-8")):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:, …
                continue
            links.append(target)
    return links


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    bad = []
    for target in relative_links(page):
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
    assert not bad, f"{page.relative_to(ROOT)}: " + "; ".join(bad)


def test_readme_is_short() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 400, f"README.md has {len(lines)} lines; at most 400 (move depth into docs/)"


def test_readme_starts_with_the_two_commands() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    first_block = []
    for line in lines[lines.index("```bash") + 1 :]:
        if line.startswith("```"):
            break
        first_block.append(line.split("#")[0].strip())
    assert lines.index("```bash") < 5, "the README opens with the newcomer's commands"
    assert first_block[:2] == ["make run", "make test"], first_block


def test_readme_links_every_docs_page() -> None:
    linked = {Path(t.partition("#")[0]).name for t in relative_links(README) if t.startswith("docs/")}
    missing = sorted(p.name for p in DOCS if p.name not in linked)
    assert not missing, f"docs pages the README does not link: {missing}"


def test_readme_speed_figures_link_reports() -> None:
    """Each README line that states a rate (tok/s) or a speed-up (N×) links a report under benchmarks/."""
    rate = re.compile(r"\d\s*(?:k\s*)?tok/s|\d(?:\.\d+)?×")
    bad = [
        line
        for line in prose_lines(README.read_text(encoding="utf-8"))
        if rate.search(line) and "](benchmarks/" not in line
    ]
    assert not bad, "README figures without a report link:\n" + "\n".join(bad)


def test_readme_has_no_commit_hashes() -> None:
    """Builds are named only inside report paths (benchmarks/<card>/<commit>/…)."""
    text = "\n".join(prose_lines(README.read_text(encoding="utf-8")))
    text = re.sub(r"\]\([^)]*\)", "]()", text)  # link targets may carry a commit folder
    hashes = [w for w in re.findall(r"\b[0-9a-f]{7,40}\b", text) if re.search(r"[a-f]", w) and re.search(r"\d", w)]
    assert not hashes, f"commit hashes in README.md: {hashes}"
