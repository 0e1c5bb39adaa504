"""``bench/replicas_affinity.py`` without servers: which replica served each turn, from the counters each replica
gained in a wave and from turns that resumed exactly where an earlier turn of their conversation stopped; the
conversations it sends (each turn extends the last, no two users start alike); the summary's hit rates and
affinity."""

from __future__ import annotations

import argparse

from dflash2.bench import replicas_affinity as ra


def turn(user, t, prompt, cached, completion=4):
    return {"user": user, "turn": t, "replica": None, "prompt_tokens": prompt, "completion_tokens": completion,
            "cached_tokens": cached, "e2e_s": 1.0, "reply": "r"}


def delta(requests, prompt, hits):
    return {"requests": requests, "prompt_tokens": prompt, "prefix_cache_hits": hits}


def test_a_wave_with_distinct_sums_has_one_fitting_assignment():
    results = [turn(0, 1, 10, 0), turn(1, 1, 12, 0), turn(2, 1, 15, 0)]
    fits = ra.fitting(results, [delta(2, 25, 0), delta(1, 12, 0)])
    assert fits == [(0, 1, 0)]
    assert ra.fitting(results, [delta(3, 37, 0), delta(0, 0, 0)]) == [(0, 0, 0)]
    assert ra.fitting(results, [delta(2, 99, 0), delta(1, 12, 0)]) == []


def test_equal_requests_are_told_apart_by_a_later_turn_that_resumes_where_they_stopped():
    # turn 1: users 0 and 1 send 10-token prompts to different replicas: the counters cannot say which went where
    t1 = [turn(0, 1, 10, 0), turn(1, 1, 10, 0)]
    wave1 = ra.fitting(t1, [delta(1, 10, 0), delta(1, 10, 0)])
    assert sorted(wave1) == [(0, 1), (1, 0)]
    # turn 2: user 0 resumes after its first turn (10 + 4 - 1 tokens) on replica 1, user 1 on replica 0
    t2 = [turn(0, 2, 20, 13), turn(1, 2, 21, 13)]
    wave2 = ra.fitting(t2, [delta(1, 21, 13), delta(1, 20, 13)])
    assert wave2 == [(1, 0)]
    who = ra.attribute([wave1, wave2], t1 + t2)
    assert who == {(0, 1): 1, (1, 1): 0, (0, 2): 1, (1, 2): 0}


def test_what_nothing_decides_stays_unknown():
    t1 = [turn(0, 1, 10, 0), turn(1, 1, 10, 0)]
    t2 = [turn(0, 2, 20, 0), turn(1, 2, 20, 0)]  # no hits: nothing ties the turns together
    wave1 = ra.fitting(t1, [delta(1, 10, 0), delta(1, 10, 0)])
    wave2 = ra.fitting(t2, [delta(1, 20, 0), delta(1, 20, 0)])
    assert set(ra.attribute([wave1, wave2], t1 + t2).values()) == {None}


def test_each_turn_extends_the_previous_and_no_two_users_start_alike():
    first, later = ra.conversations(users=10, turns=3)
    assert len(first) == 10 and all(len(m) == 2 for m in later)
    starts = [f[:12] for f in first]
    assert len(set(starts)) == 10  # a router sees no shared prefix between two conversations' first turns


def test_summary_hit_rates_ceiling_and_affinity():
    turns = [turn(0, 1, 10, 0), turn(0, 2, 20, 13), turn(1, 1, 10, 0), turn(1, 2, 20, 0)]
    for x, replica in zip(turns, (0, 0, 1, 0)):
        x["replica"] = replica
    counters = {k: 0.0 for k in ra.COUNTERS}
    per_replica = [{**counters, "requests": 3.0, "prefix_cache_queries": 40.0, "prefix_cache_hits": 13.0},
                   {**counters, "requests": 1.0, "prefix_cache_queries": 10.0}]
    args = argparse.Namespace(users=2, turns=2)
    r = ra.summarize(args, "m", turns, per_replica, ["http://a", "http://b"], 1.0, 0)
    assert r["hit_rate"] == 13 / 60 and r["later_turns_hit_rate"] == 13 / 40
    assert r["later_turns_ceiling_hit_rate"] == 26 / 40  # each later turn could have reused 10 + 4 - 1 tokens
    assert r["affinity"]["same_replica_as_previous_turn"] == 1 and r["affinity"]["rate"] == 0.5
    assert r["conversations"][1]["replicas"] == [1, 0]
    assert [x["conversations_started"] for x in r["replicas"]] == [1, 1]
    assert r["replicas"][0]["prefix_cache_hit_rate"] == 13 / 40 and r["metrics_hit_rate"] == 13 / 50
