"""The program of a tensor-parallel follower process that rank 0 starts (`deltaspec.engine.workers.launch`):
`python -m deltaspec.engine.follower` reads its arguments, pickled, from standard input and follows rank 0
(`run_follower`). Its own module, so the process never imports the starting program's `__main__`."""

from __future__ import annotations

import pickle
import sys

from deltaspec.engine.workers import run_follower

if __name__ == "__main__":
    run_follower(*pickle.load(sys.stdin.buffer))
