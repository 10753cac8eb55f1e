"""NgramDrafter: exact equivalence with a brute-force prompt-lookup search, incremental and rollback."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from deltaspec.spec.drafter import Draft, Drafter, DraftRequest
from deltaspec.spec.ngram import NgramDrafter


def reference(t: list[int], max_tokens: int, min_n: int, max_n: int) -> tuple[list[int], int]:
    """Brute force: longest recurring suffix n-gram, most recent earlier occurrence, its continuation."""
    L = len(t)
    if max_tokens == 0:
        return [], 0
    for n in range(max_n, min_n - 1, -1):
        if n >= L:
            continue
        suffix = t[L - n :]
        for p in range(L - n - 1, -1, -1):
            if t[p : p + n] == suffix:
                return t[p + n : p + n + max_tokens], n
    return [], 0


def check(d: NgramDrafter, seq_id: str, t: list[int], k: int) -> Draft:
    [draft] = d.propose([DraftRequest(seq_id, list(t), k)])
    want, n = reference(t, k, d.min_n, d.max_n)
    assert draft.tokens == want, (t, k)
    assert draft.probs is None
    assert draft.confidence == [n / d.max_n] * len(want)
    assert all(0.0 <= c <= 1.0 for c in draft.confidence)
    return draft


def test_protocol_and_dataclasses():
    d = NgramDrafter()
    assert isinstance(d, Drafter)
    assert d.name == "ngram"
    with pytest.raises(ValueError):
        DraftRequest("s", [1, 2], -1)
    with pytest.raises(ValueError):
        Draft(tokens=[1, 2], probs=torch.zeros(3, 8))
    with pytest.raises(ValueError):
        Draft(tokens=[1, 2], confidence=[0.5])
    assert len(Draft(tokens=[4, 5], probs=torch.full((2, 8), 1 / 8), confidence=[1.0, 0.5])) == 2
    for bad in [(0, 3), (3, 2)]:
        with pytest.raises(ValueError):
            NgramDrafter(*bad)


def test_basic_rules():
    d = NgramDrafter(min_n=2, max_n=4)
    # most recent occurrence wins: [1, 2] occurs at 0 (-> 3) and at 4 (-> 9)
    t = [1, 2, 3, 0, 1, 2, 9, 8, 1, 2]
    assert check(d, "a", t, 5).tokens == [9, 8, 1, 2]
    # a longer match beats a more recent shorter one: [7, 1, 2] at 0 (-> 5), [1, 2] alone at 5 (-> 6)
    t = [7, 1, 2, 5, 0, 1, 2, 6, 7, 1, 2]
    dr = check(d, "b", t, 3)
    assert dr.tokens == [5, 0, 1] and dr.confidence == [3 / 4] * 3
    # no match; a match only of length < min_n does not count
    assert check(d, "c", [1, 2, 3, 4, 5], 5).tokens == []
    assert check(d, "d", [1, 2, 3, 1], 5).tokens == []
    assert check(NgramDrafter(min_n=1, max_n=3), "e", [1, 2, 3, 1], 5).tokens == [2, 3, 1]
    # the continuation stops at the end of the context; overlapping occurrences count
    assert check(d, "f", [4, 4, 4, 4], 7).tokens == [4]
    assert check(d, "g", [5, 6, 5, 6, 5, 6], 15).tokens == [5, 6]
    # max_n caps the matched length even when a longer suffix recurs
    t = [1, 2, 3, 4, 5, 6, 9, 1, 2, 3, 4, 5, 6]
    assert check(NgramDrafter(2, 3), "h", t, 2).confidence == [1.0, 1.0]
    # max_tokens 0 and tiny contexts
    assert check(d, "i", [1, 2, 1, 2], 0).tokens == []
    for t in ([], [1], [1, 1], [1, 1, 1]):
        check(d, "j" + str(len(t)), t, 3)


@pytest.mark.parametrize("min_n,max_n,vocab", [(2, 5, 3), (1, 3, 4), (2, 2, 2), (3, 6, 3), (2, 5, 12)])
def test_random_streams_incremental(min_n, max_n, vocab):
    rng = random.Random(1234 + 7 * min_n + max_n + vocab)
    d = NgramDrafter(min_n=min_n, max_n=max_n)
    for s in range(12):
        sid = f"s{s}"
        t = [rng.randrange(vocab) for _ in range(rng.randrange(0, 30))]
        for _ in range(25):
            k = rng.choice([0, 1, 7, 15])
            draft = check(d, sid, t, k)
            # commit like speculative decoding: some drafts accepted plus the target's token,
            # sometimes copying the draft (so matches keep coming), sometimes fresh random tokens
            acc = rng.randint(0, len(draft.tokens))
            new = draft.tokens[:acc] + [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
            t = t + new
            d.on_commit(sid, acc, len(t))
        d.on_finish(sid)
    assert d.state_bytes() == 0


@pytest.mark.parametrize("check_window", [0, 16, None])
def test_rollback(check_window):
    # check_window=0 disables the tail check: rollbacks must then come from a shorter context or
    # from on_commit alone (so this also tests that on_commit forgets what was rolled back)
    rng = random.Random(99)
    d = NgramDrafter(min_n=2, max_n=4, check_window=check_window)
    for trial in range(40):
        sid = f"r{trial}"
        t = [rng.randrange(3) for _ in range(rng.randrange(5, 60))]
        check(d, sid, t, 7)
        cut = rng.randrange(0, len(t))
        how = trial % (2 if check_window == 0 else 3)
        if how == 0:  # shorter context straight to propose
            t = t[:cut]
        elif how == 1:  # rollback announced through on_commit, then regrowth with other tokens
            d.on_commit(sid, 0, cut)
            t = t[:cut] + [rng.randrange(3) for _ in range(rng.randrange(0, len(t) - cut + 10))]
        else:  # tail rewritten in place (within the checked window), same or longer length
            back = rng.randrange(1, min(len(t), 12) + 1)
            t = t[: len(t) - back] + [rng.randrange(3, 5) for _ in range(back + rng.randrange(0, 3))]
        check(d, sid, t, 15)
        for _ in range(5):  # keeps matching the reference while growing again
            t = t + [rng.randrange(3) for _ in range(rng.randint(1, 3))]
            check(d, sid, t, rng.choice([1, 7, 15]))


def test_full_check_catches_any_rewrite():
    d = NgramDrafter(min_n=2, max_n=3, check_window=None)
    t = [1, 2, 3] + [9] * 40 + [1, 2]
    assert check(d, "x", t, 2).tokens == [3, 9]
    t2 = [1, 2, 5] + t[3:] + [7]  # rewrite far outside any window, then grow
    t2 = t2[:-1] + [1, 2]
    check(d, "x", t2, 2)


def test_batch_and_finish_and_state_bytes():
    d = NgramDrafter()
    empty = d.state_bytes()
    assert empty == 0
    rng = random.Random(5)
    ctx = {f"b{i}": [rng.randrange(4) for _ in range(20 + 10 * i)] for i in range(4)}
    reqs = [DraftRequest(s, t, 15) for s, t in ctx.items()]
    drafts = d.propose(reqs)
    assert len(drafts) == len(reqs)
    for r, dr in zip(reqs, drafts):
        assert dr.tokens == reference(r.token_ids, 15, 2, 5)[0]
    sizes = [d.state_bytes()]
    assert sizes[0] > empty
    t = ctx["b0"]
    for _ in range(5):  # grows with the context
        t = t + [rng.randrange(1000) for _ in range(200)]
        d.propose([DraftRequest("b0", t, 3)])
        sizes.append(d.state_bytes())
    assert all(a < b for a, b in itertools.pairwise(sizes))
    for s in ctx:
        d.on_finish(s)
    d.on_finish("b0")  # idempotent
    d.on_commit("unknown", 0, 0)  # ignored
    assert d.state_bytes() == empty
    assert d._seqs == {}


def test_caller_list_not_kept_or_mutated():
    d = NgramDrafter()
    t = [1, 2, 3, 1, 2]
    d.propose([DraftRequest("c", t, 5)])
    assert t == [1, 2, 3, 1, 2]
    t.append(3)  # the caller may reuse its list: the drafter copied what it needs
    assert d._seqs["c"].tokens == [1, 2, 3, 1, 2]
    check(d, "c", t, 5)
