"""Sessions inferred from prompts' token ids (scheduler/inferred.py), model-free."""
import random

import pytest

from talaria_jax.scheduler.inferred import SessionInference


def _turn(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(50_000) for _ in range(n)]


def ask(idx: SessionInference, tenant: str, prompt: list[int], output=()):
    """A call answered: identified, then finished."""
    got = idx.identify(tenant, prompt)
    idx.finished(got, list(output))
    return got


def test_a_run_is_one_session_and_identical_starts_stay_apart():
    rng = random.Random(0)
    idx = SessionInference(block=16)
    system = _turn(rng, 40)
    runs = {}
    for r in range(6):  # runs 0 and 1 begin with the same prompt; their answers tell them apart
        first = system + (_turn(random.Random(99), 25) if r < 2 else _turn(rng, 25))
        runs[r] = {"prompt": first, "sessions": []}
    for turn in range(5):
        for r in rng.sample(list(runs), len(runs)):  # the runs' calls interleave in any order
            run = runs[r]
            got = idx.identify("tenant", run["prompt"])
            run["sessions"].append(got.session)
            assert got.how == ("new" if turn == 0 else "continued"), (r, turn, got.how)
            out = _turn(random.Random(100 * r + turn), 12)
            idx.finished(got, out)
            observation = _turn(random.Random(1000 * r + turn), 30)
            # the client re-renders the answer: its first tokens are as generated, its end differs
            run["prompt"] = run["prompt"] + out[:8] + _turn(rng, 3) + observation
    sessions = [set(run["sessions"]) for run in runs.values()]
    assert all(len(s) == 1 for s in sessions)  # recall: every call of a run in one session
    assert len(set.union(*sessions)) == len(runs)  # precision: no two runs merged


def test_forks_compaction_retries_and_tenants():
    rng = random.Random(1)
    idx = SessionInference(block=8)
    p1 = _turn(rng, 50)
    a = ask(idx, "t1", p1, [1, 2, 3])
    p2 = p1 + [1, 2, 3] + _turn(rng, 10)
    b = ask(idx, "t1", p2)
    assert (b.session, b.how) == (a.session, "continued")
    fork = ask(idx, "t1", p1 + [1, 2, 3] + _turn(rng, 7))  # a second call extending the first
    assert fork.how == "forked" and fork.session != a.session
    c = ask(idx, "t1", p2 + _turn(rng, 5))  # the original line goes on
    assert (c.session, c.how) == (a.session, "continued")
    compacted = ask(idx, "t1", p1[:20] + _turn(rng, 30))  # system prompt + summary
    assert compacted.how == "new"
    other = ask(idx, "t2", p2 + _turn(rng, 5))  # another tenant, the same tokens
    assert other.how == "new" and other.session not in (a.session, c.session)
    again = ask(idx, "t1", p1)  # the same prompt again: not a continuation of its own call
    assert again.session != a.session


def test_a_call_that_failed_leaves_nothing_and_its_retry_continues():
    rng = random.Random(5)
    idx = SessionInference(block=8)
    p = _turn(rng, 40)
    first = ask(idx, "t", p, [4, 5])
    nxt = p + [4, 5] + _turn(rng, 9)
    failed = idx.identify("t", nxt)  # never finished: refused, or its stream was lost
    retry = ask(idx, "t", nxt)
    assert failed.session == retry.session == first.session and retry.how == "continued"
    assert len(idx) == 2


def test_a_raw_prompt_whose_junction_tokenizes_anew_still_continues():
    """Text appended to a completions prompt can merge with its last token; its last `slack` tokens
    are not matched (the new prompt must still be longer)."""
    rng = random.Random(4)
    idx = SessionInference(block=8, slack=2)
    p = _turn(rng, 40)
    first = ask(idx, "t", p)
    assert ask(idx, "t", p[:-1] + [7, 8, 9] + _turn(rng, 20)).session == first.session
    assert ask(idx, "t", p[:-3] + _turn(rng, 30)).how == "new"  # differs before the slack
    assert ask(idx, "t", p[:-1] + [11]).how == "new"  # no longer than it: not a continuation


def test_short_prompts_and_block_edges():
    idx = SessionInference(block=4)
    first = ask(idx, "t", [5, 6])
    assert ask(idx, "t", [5, 6, 7, 8]).session == first.session  # both inside block 0
    assert ask(idx, "t", [5, 6, 7, 8, 9]).session == first.session  # crosses a boundary
    assert ask(idx, "t", []).how == "new"


def test_bounded_memory_forgets_least_recent_and_keeps_few_alike():
    rng = random.Random(2)
    idx = SessionInference(max_calls=10, block=8)
    prompts = [_turn(rng, 20) for _ in range(30)]
    firsts = [ask(idx, "t", p) for p in prompts]
    assert len(idx) == 10 and idx.forgotten == 20
    assert ask(idx, "t", prompts[-1] + [1]).session == firsts[-1].session
    assert ask(idx, "t", prompts[0] + [1]).how == "new"  # forgotten
    same = SessionInference(alike=3, block=8)  # many calls of one prompt (an eval, a GRPO group)
    p = _turn(rng, 30)
    runs = [ask(same, "t", p, [k]) for k in range(5)]
    assert len(same) == 3
    assert ask(same, "t", p + [4, 9]).session == runs[4].session  # its output tells it apart
    # run 0 was forgotten: its next call goes to one of the kept sessions its prompt extends alike
    assert ask(same, "t", p + [0, 9]).session in (runs[2].session, runs[3].session)
    with pytest.raises(ValueError, match="max_calls"):
        SessionInference(max_calls=0)
    with pytest.raises(ValueError, match="64-bit"):
        SessionInference().identify("t", [1, 2**70])


def test_runs_alike_to_the_token_are_told_apart_by_the_tool_call_ids_they_send_back():
    """Two runs with the same prompt and the same answer differ only in the ids of their tool calls;
    each next call, in whatever order, continues the run whose ids it brings back (another tenant's
    ids name nothing)."""
    rng = random.Random(3)
    idx = SessionInference(block=16)
    prompt, out = _turn(rng, 40), _turn(rng, 10)
    first = [idx.identify("t", prompt) for _ in range(2)]
    for got, tid in zip(first, ("call_a", "call_b")):
        idx.finished(got, out, [tid])
    assert first[0].session != first[1].session
    nxt = prompt + out + _turn(random.Random(4), 20)  # the same tool result for both
    b = idx.identify("t", nxt, ["call_b"])  # the second run's call first
    a = idx.identify("t", nxt, ["call_a"])
    assert (a.session, b.session) == (first[0].session, first[1].session) and a.how == b.how == "continued"
    assert idx.identify("u", nxt, ["call_a"]).how == "new"
