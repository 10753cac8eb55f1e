"""`deltaspec bench agents`: agents that each load their own long document and ask follow-ups.

Agent i starts `stagger` seconds after agent i-1, sends its document with a first question, then
two follow-up questions in the same conversation, each as soon as the previous answer is complete,
so that some agents ask follow-ups while others are still loading their documents. The report
gives the wait for each turn's first token: first turns (document load) and follow-ups separately;
the command adds what the server ran (`client.served_identity`: its model or shape and drafter).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from deltaspec.bench.client import Client
from deltaspec.bench.prompts import documents
from deltaspec.bench.stats import percentiles

QUESTIONS = (
    "Summarise what the code above does.",
    "Which function in it is the most complex?",
    "Suggest one test for it.",
)


def run_agent(client: Client, document: str, delay: float, max_tokens: int) -> list[dict]:
    time.sleep(delay)
    messages, turns = [], []
    for k, question in enumerate(QUESTIONS):
        content = f"{document}\n\n{question}" if k == 0 else question
        messages.append({"role": "user", "content": content})
        timing = client.stream(
            "chat/completions",
            {
                "messages": messages,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "chat_template_kwargs": {"enable_thinking": False},
            },
        )
        messages.append({"role": "assistant", "content": timing.text})
        turns.append(
            {
                "turn": k,
                "wait_s": timing.ttft,
                "prompt_tokens": timing.prompt_tokens,
                "cached_tokens": timing.cached_tokens,
                "total_s": (timing.chunk_times[-1] if timing.chunk_times else time.perf_counter()) - timing.sent,
            }
        )
    return turns


def bench_agents(
    client: Client, agents: int, doc_chars: int, stagger: float, max_tokens: int, run: int = 0, progress=print
) -> dict:
    """One run of the scenario; each run's documents are new to the server (a run never finds the documents
    of an earlier one in the prefix cache)."""
    docs = documents(agents, doc_chars, label=f"run {run}, ")
    start = time.perf_counter()
    with ThreadPoolExecutor(agents) as pool:
        per_agent = list(pool.map(lambda i: run_agent(client, docs[i], i * stagger, max_tokens), range(agents)))
    wall = time.perf_counter() - start
    first = [t["wait_s"] for turns in per_agent for t in turns if t["turn"] == 0 and t["wait_s"] is not None]
    follow = [t["wait_s"] for turns in per_agent for t in turns if t["turn"] > 0 and t["wait_s"] is not None]
    report = {
        "agents": agents,
        "doc_chars": doc_chars,
        "stagger_s": stagger,
        "max_tokens": max_tokens,
        "doc_tokens_median": percentiles([t[0]["prompt_tokens"] for t in per_agent])["p50"],
        "first_turn_wait_s": percentiles(first),
        "follow_up_wait_s": percentiles(follow),
        "follow_up_wait_max_s": max(follow, default=None),
        "wall_s": wall,
        "turns": per_agent,
    }
    progress(
        f"{agents} agents: first turn wait p50 {report['first_turn_wait_s']['p50'] or 0:.2f} s, "
        f"follow-up wait p50 {report['follow_up_wait_s']['p50'] or 0:.2f} s, "
        f"max {report['follow_up_wait_max_s'] or 0:.2f} s"
    )
    return report
