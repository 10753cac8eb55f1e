"""Which deltaspec ran: the commit that reports (benchmarks, KL measurements) record."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def commit() -> str | None:
    """The git commit of the deltaspec checkout, when it is one, with "-dirty" when tracked files differ from it
    (DELTASPEC_COMMIT overrides it, for copies of a checkout whose .git is stale or absent, such as a tree
    shipped to another machine)."""
    if os.environ.get("DELTASPEC_COMMIT"):
        return os.environ["DELTASPEC_COMMIT"]
    try:
        return (
            subprocess.run(
                ["git", "describe", "--always", "--dirty", "--abbrev=7"],
                cwd=Path(__file__).parent,
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        return None
