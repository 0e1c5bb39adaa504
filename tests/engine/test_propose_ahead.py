"""fast/engine/graphs/propose_ahead.py: when a captured step launches the next step's proposal, and when that
proposal is used. The policy is host logic; the captured step that follows it is tested in
tests/engine/test_step_replay_order.py and, on the GPU, conformance/gpu/test_cuda_graphs.py."""

from __future__ import annotations

from dflash2.fast.engine.graphs.propose_ahead import Prediction, ProposeAhead

KEY = ("verify", 1, 8)
FIELDS = ((5,), (17,), (0,), ())


def step(policy: ProposeAhead, epoch: int, fields=FIELDS, replays: int = 0, requested: bool = True) -> tuple[bool, bool]:
    """One steady step: claim, decide, expect the same key and the given fields next. Returns (used, launched)."""
    used = policy.claim(KEY, replays, epoch, fields)
    launched = policy.should_launch(requested)
    policy.expect(Prediction(KEY, replays, epoch, fields), launched)
    return used, launched


def test_a_steady_batch_uses_every_proposal_after_the_first_step():
    policy = ProposeAhead()
    results = [step(policy, epoch) for epoch in range(1, 6)]
    assert results[0] == (False, True)  # nothing was launched before the first step
    assert all(result == (True, True) for result in results[1:])
    assert policy.used == 4


def test_a_proposal_is_used_only_when_nothing_it_read_changed():
    for change in ({"fields": ((6,), (17,), (0,), ())}, {"replays": 1}, {"epoch_gap": 2}, {"key": ("verify", 2, 8)}):
        policy = ProposeAhead()
        step(policy, 1)
        fields = change.get("fields", FIELDS)
        epoch = 1 + change.get("epoch_gap", 1)  # a gap: another runner step ran in between
        key = change.get("key", KEY)
        assert not policy.claim(key, change.get("replays", 0), epoch, fields), change
        assert policy.used == 0


def test_one_proposal_serves_one_step_at_most():
    policy = ProposeAhead()
    step(policy, 1)
    assert policy.claim(KEY, 0, 2, FIELDS)
    assert not policy.claim(KEY, 0, 3, FIELDS)  # forgotten once claimed


def test_a_churning_batch_stops_launching_and_resumes_once_steady():
    policy = ProposeAhead(window=8, min_hits=6)
    epoch = 0
    for i in range(8):  # every step's fields differ from the prediction: requests join and finish
        epoch += 1
        step(policy, epoch, fields=((i,), (i,), (0,), ()))
    assert not policy.should_launch(True)  # 8 misses in the window
    launches = []
    for _ in range(10):
        epoch += 1
        launches.append(step(policy, epoch)[1])
    # the first steady step still misses (the churning step before predicted other fields); every later one
    # records a hit though nothing was launched, and launching resumes once at most 2 of the last 8 missed
    assert launches.index(True) == 6 and all(launches[6:])


def test_disabled_or_not_requested_never_launches():
    assert not ProposeAhead(enabled=False).should_launch(True)
    assert not ProposeAhead().should_launch(False)
    policy = ProposeAhead(enabled=False)
    for epoch in range(1, 4):
        assert step(policy, epoch) == (False, False)
