"""The adaptive draft length follows acceptance and never lands on a row count slower than a longer one."""

from deltaspec.spec.policy import DraftLengthPolicy, VerifyCostTable


def test_good_acceptance_drafts_long_and_poor_acceptance_drafts_short():
    policy = DraftLengthPolicy(max_k=8, probe_every=100)  # no probe within the test
    for _ in range(20):
        policy.update("good", drafted=8, accepted=8)
        policy.update("bad", drafted=policy.choose("bad", 8) or 1, accepted=0)
    assert policy.choose("good", 8) == 8
    assert policy.choose("bad", 8) == 0
    assert policy.choose("good", 3) == 3  # the budget caps it


def test_a_row_count_slower_than_a_longer_one_is_never_chosen():
    # two rows cost as much as four (a kernel switch point): drafting 1 or 2 is never better than 3
    table = VerifyCostTable(costs=(1.0, 1.5, 1.45, 1.5, 1.9, 2.3))
    assert table.allowed(5) == [0, 2, 3, 4, 5]
    policy = DraftLengthPolicy(max_k=5, table=table)
    for _ in range(30):
        policy.update("s", drafted=2, accepted=1)  # position 1 always accepted, position 2 never
    # one draft would be the best rate on a monotone table, but its 2-row pass is slower than 3 rows
    assert policy.choose("s", 5) == 2


def test_ema_moves_towards_observed_acceptance():
    policy = DraftLengthPolicy(max_k=4, prior=0.5)
    policy.update("s", drafted=4, accepted=2)
    p = policy.ema["s"]
    assert p[0] > 0.5 and p[1] > 0.5 and p[2] < 0.5 and len(p) == 3  # position 4 was never reached
    policy.forget("s")
    assert "s" not in policy.ema


def test_a_sequence_that_stopped_drafting_probes_again_and_recovers():
    policy = DraftLengthPolicy(max_k=4, probe_every=5)
    for _ in range(20):
        policy.update("s", drafted=policy.choose("s", 4) or 1, accepted=0)
    assert policy.choose("s", 4) == 0  # not worth drafting any more...
    rounds = [policy.choose("s", 4) for _ in range(10)]
    probes = [i for i, k in enumerate(rounds) if k]
    assert len(probes) == 2 and probes[1] - probes[0] == 5  # ...but every 5th round probes
    for _ in range(10):  # the text turned repetitive: probes are accepted, and drafting comes back
        k = policy.choose("s", 4)
        if k:
            policy.update("s", drafted=k, accepted=k)
    assert policy.choose("s", 4) > 0
    policy.forget("s")
    assert "s" not in policy.idle
