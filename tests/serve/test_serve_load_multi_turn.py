"""``bench/load_serve.py --multi-turn``: conversations over a shared system prompt with growing histories, on
a real ``ft serve`` of the bundled pair with the prefix cache and, ``--compare-no-cache``, on a second one
without it. The cache hits the later turns, the server without it hits nothing, the usage and the
``/metrics`` counters agree, and greedy replies are the same on both servers turn for turn."""

from __future__ import annotations

import argparse
import json

import pytest

from dflash2.bench import load_serve

USERS, TURNS, SYSTEM, USER, REPLY = 2, 3, 40, 8, 4


def test_multi_turn_with_and_without_the_prefix_cache(tmp_path, capsys):
    out = tmp_path / "multi-turn.json"
    code = load_serve.main(["--multi-turn", "--compare-no-cache", "--system-len", str(SYSTEM), "--users", str(USERS),
                            "--turns", str(TURNS), "--user-len", str(USER), "--output-len", str(REPLY),
                            "--duration-s", "60", "--timeout-s", "60", "--startup-timeout-s", "120", "--out", str(out),
                            "--", "--no-warmup", "--snapshot-interval", "16"])
    assert code == 0
    result = json.loads(out.read_text())
    cache, no_cache, gain = result["cache"], result["no_cache"], result["comparison"]
    assert result["workload"] == "multi-turn"
    assert result["server"]["shutdown"]["exit_status"] == 0 == result["no_cache_server"]["shutdown"]["exit_status"]
    assert "--no-prefix-caching" in result["no_cache_server"]["command"]
    assert "--no-prefix-caching" not in result["server"]["command"]
    assert all("serving '" in result[k]["summary"] for k in ("server", "no_cache_server"))
    for r in (cache, no_cache):
        assert r["num_ok"] == r["num_turns_sent"] == USERS * TURNS and r["num_failed"] == 0
        assert r["turns_without_usage"] == 0 and r["output_tokens"] == USERS * TURNS * REPLY
        # turn t's prompt: the system prompt, t user messages and t - 1 replies
        assert [t["prompt_tokens"] for t in r["turns_detail"] if t["user"] == 0] == \
            [SYSTEM + t * USER + (t - 1) * REPLY for t in range(1, TURNS + 1)]
        assert r["longest_prompt_tokens"] == SYSTEM + TURNS * USER + (TURNS - 1) * REPLY
        assert r["prompt_tokens"] == USERS * sum(SYSTEM + t * USER + (t - 1) * REPLY for t in range(1, TURNS + 1))
        assert r["prefill_tokens_computed"] == r["prompt_tokens"] - r["cached_tokens"]
        assert [t["turn"] for t in r["per_turn"]] == list(range(1, TURNS + 1))
        assert all(t["turns"] == USERS and t["ttft_s"]["n"] == USERS for t in r["per_turn"])
        assert r["turn_1"]["turns"] == USERS and r["later_turns"]["turns"] == USERS * (TURNS - 1)
        assert r["ttft_s"]["p50"] <= r["ttft_s"]["p99"] and r["output_token_throughput_per_s"] > 0
        assert r["server"]["tokens_per_verify_step"] >= 1 and r["server"]["generation_tokens"] == r["output_tokens"]
        assert all(len(t["reply_token_ids"]) == REPLY for t in r["turns_detail"])
        # the engine's parts of TTFT (means over the turns), within the TTFT the client saw
        assert 0 <= r["server"]["queue_s_mean"] and 0 < r["server"]["prefill_s_mean"]
        assert r["server"]["queue_s_mean"] + r["server"]["prefill_s_mean"] <= r["ttft_s"]["mean"]
    # with the cache: every later turn resumes after (at least) the previous turn's prompt, and the /metrics
    # counters count what the usage says
    assert cache["hit_rate"] > 0 and cache["later_turns"]["hit_rate"] > 0.5
    previous = {(t["user"], t["turn"] + 1): t["prompt_tokens"] for t in cache["turns_detail"]}
    for t in cache["turns_detail"]:
        if t["turn"] > 1:
            assert previous[t["user"], t["turn"]] <= t["cached_tokens"] < t["prompt_tokens"]
    assert cache["server"]["prefix_cache_hits"] == cache["cached_tokens"]
    assert cache["server"]["prefix_cache_queries"] == cache["prompt_tokens"]
    assert cache["server"]["prefix_cache_hit_rate"] == pytest.approx(cache["hit_rate"])
    # without: nothing cached, nothing looked up
    assert no_cache["hit_rate"] == 0 and no_cache["cached_tokens"] == 0
    assert no_cache["prefill_tokens_computed"] == no_cache["prompt_tokens"]
    assert no_cache["server"]["prefix_cache_queries"] == 0 and no_cache["server"]["prefix_cache_hit_rate"] is None
    # greedy: the same reply ids per user and turn, so the same histories
    assert [(t["user"], t["turn"], t["reply_token_ids"]) for t in cache["turns_detail"]] == \
        [(t["user"], t["turn"], t["reply_token_ids"]) for t in no_cache["turns_detail"]]
    assert gain["replies"] == {"compared": USERS * TURNS, "identical": USERS * TURNS, "first_differing": []}
    assert gain["prefill_tokens_without_over_with"] > 1
    assert gain["ttft_p50_later_turns_without_over_with"] > 0 and len(gain["ttft_p50_per_turn_without_over_with"]) == TURNS
    text = capsys.readouterr().out
    assert "| multi-turn | cache on | cache off | gain |" in text and "| prefill tokens computed |" in text
    assert "TTFT ms p50/p99 turns >= 2" in text and f"| replies identical | {USERS * TURNS} / {USERS * TURNS} |" in text


def test_the_conversations_are_seeded_and_the_no_cache_server_drops_the_cache():
    args = argparse.Namespace(seed=3, system_len=5, users=2, turns=3, user_len=4, max_token_id=50)
    system, messages = load_serve.conversation_script(args)
    assert (system, messages) == load_serve.conversation_script(args)
    assert len(system) == 5 and [[len(m) for m in user] for user in messages] == [[4] * 3] * 2
    assert max(system + [t for user in messages for m in user for t in m]) < 50
    assert load_serve.no_cache_serve_args(["--model", "m", "--prefix-caching", "--snapshot-interval", "16"]) == \
        ["--model", "m", "--snapshot-interval", "16", "--no-prefix-caching"]


@pytest.mark.parametrize("argv, message", [
    (["--compare-no-cache", "--url", "http://127.0.0.1:1"], "go with --multi-turn"),
    (["--multi-turn", "--compare-no-cache", "--url", "http://127.0.0.1:1"], "--compare-no-cache: expected"),
    (["--multi-turn", "--compare-plain", "--", "--no-warmup"], "do not apply"),
    (["--multi-turn", "--users", "0", "--", "--no-warmup"], "--users=0"),
])
def test_multi_turn_arguments_are_checked(argv, message, capsys):
    with pytest.raises(SystemExit):
        load_serve.main(argv)
    assert message in capsys.readouterr().err
