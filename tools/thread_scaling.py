"""Measure CPU decode of the embedded model by thread count, with and without other processes competing for the
cores, and write the report (benchmarks/threads-cpu-default-model.json).

Each configuration runs in its own process (OpenMP reads its wait policy when torch starts): one stream, greedy,
`--tokens` new tokens after a short prompt, the median of `--runs` timed runs after one warm-up, decode tok/s as
DESIGN §6 defines it. A competing load is that many processes spinning in a loop while the runs are timed. The
configurations: 1 thread and the physical cores (deltaspec's default), OpenMP's default wait policy (threads spin
between parallel regions) and OMP_WAIT_POLICY=PASSIVE (they sleep), with no load and with one spinning process per
core. (deltaspec itself sets PASSIVE when the variable is unset; the runs import torch first so that "default" is
OpenMP's own.) Usage:

    .venv/bin/python tools/thread_scaling.py --out benchmarks/threads-cpu-default-model.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

MEASURE = """
import json, subprocess, sys, time
import torch  # first, so that OpenMP reads the wait policy this process was started with, not deltaspec's default
sys.path.insert(0, {root!r})
from deltaspec import LLM, SamplingParams
llm = LLM(None, dtype="float32", device="cpu", max_num_seqs=1, max_model_len=512, threads={threads})
params = SamplingParams(max_tokens={tokens}, temperature=0.0, ignore_eos=True)
llm.generate(["def f(x):"], params)
spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range({load})]
rates = []
try:
    time.sleep(0.5)
    for _ in range({runs}):
        rates.append(llm.generate(["def f(x):"], params)[0].metrics["decode_tok_s"])
finally:
    for spinner in spinners:
        spinner.kill()
print(json.dumps(rates))
"""


def measure(threads: int, load: int, passive: bool, tokens: int, runs: int) -> dict:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"} if passive else dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    if not passive:
        env.pop("OMP_WAIT_POLICY", None)
    code = MEASURE.format(root=str(ROOT), threads=threads, tokens=tokens, load=load, runs=runs)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    rates = json.loads(done.stdout.strip().splitlines()[-1])
    return {
        "threads": threads,
        "competing_processes": load,
        "omp_wait_policy": "PASSIVE" if passive else "default",
        "decode_tok_s": round(statistics.median(rates), 1),
        "runs": [round(r, 1) for r in rates],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from deltaspec.config.host import physical_cores
    from deltaspec.provenance import commit

    cores = physical_cores()
    rows = []
    for passive in (False, True):
        for load in (0, cores):
            for threads in sorted({1, cores}):
                rows.append(measure(threads, load, passive, args.tokens, args.runs))
                print(json.dumps(rows[-1]), flush=True)
    report = {"tool": "tools/thread_scaling.py", "commit": commit(), "physical_cores": cores,
              "logical_cpus": os.cpu_count(), "tokens": args.tokens, "rows": rows}  # fmt: skip
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
