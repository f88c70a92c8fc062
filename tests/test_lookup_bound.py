"""bench.tools.lookup_bound: the replay drafts what prompt lookup drafts, and bounds the gain."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from bench.tools import lookup_bound
from jspec import drafters


@pytest.mark.parametrize("ngram, min_ngram", [(1, 1), (2, 1), (3, 1), (2, 2), (3, 3)])
def test_the_replay_drafts_what_the_engine_drafts(ngram, min_ngram):
  # Few distinct tokens, so that matches are common, several per sequence,
  # of every length, and some sequences have none.
  rng = np.random.RandomState(10 * ngram + min_ngram)
  width, gamma = 40, 5  # 5 >> 1 = 2 and 5 >> 2 = 1 drafts after shorter matches
  counts = set()
  for _ in range(40):
    n = rng.randint(1, width)
    tokens = rng.randint(0, 4, size=width)
    drafts, _, count = drafters.prompt_lookup(jnp.asarray(tokens[None], jnp.int32),
                                              jnp.array([n], jnp.int32), jnp.array([gamma]),
                                              gamma, ngram, vocab=4, min_ngram=min_ngram)
    want = list(np.asarray(drafts)[0, :int(count[0])])
    assert lookup_bound.lookup(list(tokens[:n]), ngram, gamma, min_ngram) == want
    counts.add(len(want))
  assert 0 in counts and gamma in counts
  if min_ngram < ngram:  # a shorter match drafts fewer
    assert gamma >> 1 in counts


def test_a_shorter_match_is_a_fallback_and_drafts_half_as_many_per_token_short():
  tokens = [7, 3, 8, 4, 6, 1, 2, 9, 3]  # the last 3 follows 7 before: a 1-gram match
  assert lookup_bound.lookup(tokens, 3, 8) == [8, 4]  # 8 >> 2 of the 7 that follow
  assert lookup_bound.lookup(tokens, 2, 8) == [8, 4, 6, 1]  # 8 >> 1
  assert lookup_bound.lookup(tokens, 1, 8) == [8, 4, 6, 1, 2, 9, 3]  # a full match: 8, 7 there
  assert lookup_bound.lookup(tokens, 3, 8, min_ngram=2) == []
  tokens = tokens + [8, 4]  # "3 8 4" occurred at 1..3: a full 3-gram match
  assert lookup_bound.lookup(tokens, 3, 8) == [6, 1, 2, 9, 3, 8, 4]


def test_replay_counts_rounds_and_the_bound_follows():
  # Prompt 1 2 3 4 5; the output copies "3 4 5" after "1 2", then 7 is new.
  prompt, output = [1, 2, 3, 4, 5, 1, 2], [3, 4, 5, 7]
  # Round 1: after "1 2 3" (n = 2: "2 3" occurred) drafts 4 5 1 2; 4 5 accepted, 7 emitted.
  assert lookup_bound.replay(prompt, output, 2, 16) == {"rounds": 1, "empty_rounds": 0,
                                                        "accepted": 2}
  # A full 4-gram only: "5 1 2 3" matches nothing, so 4 alone; then "1 2 3 4"
  # drafts 5 1 ..., 5 accepted. Falling back, "1 2 3" matches at once.
  assert lookup_bound.replay(prompt, output, 4, 16, min_ngram=4) == {
      "rounds": 2, "empty_rounds": 1, "accepted": 1}
  assert lookup_bound.replay(prompt, output, 4, 16)["rounds"] == 1
  results = {"prompts": {"p": {"prompt_ids": prompt, "modes": {"target": {
      "token_ids": output, "new_tokens": 4, "prefill_s": 1.0, "decode_s": 3.0}}}}}
  out = lookup_bound.bounds(results)["p"]
  assert out["step_s"] == pytest.approx(1.0)
  assert out["ngram"][2]["bound"] == pytest.approx(4.0 / 2.0)  # (1 + 3) / (1 + 1 round)
  assert out["exact"][4]["bound"] == pytest.approx(4.0 / 3.0)
  assert out["ngram"][4]["bound"] == pytest.approx(4.0 / 2.0)
  with pytest.raises(ValueError, match="not in the results"):
    lookup_bound.bounds(results, ["q"])


def test_the_oracle_takes_the_best_earlier_occurrence():
  # After "... 5", the latest 5 is followed by 1 2, the first by 1 3 (the output).
  prompt, output = [5, 1, 3, 5, 1, 2], [5, 1, 3, 8]
  assert lookup_bound.replay(prompt, output, 1, 16)["rounds"] == 2  # 1 accepted, then 3 ... 8
  assert lookup_bound.replay(prompt, output, 1, 16, oracle="token") == {
      "rounds": 1, "empty_rounds": 0, "accepted": 2}


def test_the_span_oracle_copies_from_anywhere():
  # After "... 9" the output 4 6 never followed a 9, but "4 6" is in the prompt.
  prompt, output = [4, 6, 2, 9], [9, 4, 6]
  # Anchored: the earlier 9 was followed by 9, not 4; 4 is emitted, then 4 -> 6.
  assert lookup_bound.replay(prompt, output, 1, 16, oracle="token") == {
      "rounds": 2, "empty_rounds": 1, "accepted": 1}
  assert lookup_bound.replay(prompt, output, 1, 16, oracle="span") == {
      "rounds": 1, "empty_rounds": 0, "accepted": 2}  # drafts 4 6, both accepted
  with pytest.raises(ValueError, match="expected one of"):
    lookup_bound.replay(prompt, output, 1, 16, oracle="best")


def test_the_rounds_a_goal_allows_at_the_measured_round_cost():
  prompt, output = [1, 2, 3, 1, 2], [3, 4, 5, 6, 7]
  results = {"settings": {"mode_args": {"prompt_lookup": {"gamma": 4, "ngram": 2}}},
             "prompts": {"p": {"prompt_ids": prompt, "modes": {
                 "target": {"token_ids": output, "new_tokens": 5, "prefill_s": 2.0,
                            "decode_s": 8.0},
                 "prompt_lookup": {"rounds": 3, "decode_s": 3.0, "speedup_vs_target": 2.0}}}}}
  m = lookup_bound.bounds(results, goal=2.0)["p"]["measured"]
  assert m["round_s"] == pytest.approx(1.0)  # 3 s over 3 rounds
  assert m["rounds_for_goal"] == 3  # (10 / 2 - 2) / 1
  assert lookup_bound.bounds(results, goal=2.5)["p"]["measured"]["rounds_for_goal"] == 2  # 2 / 1


def test_main_reads_a_results_file(tmp_path, capsys):
  path = tmp_path / "r.json"
  path.write_text(json.dumps({"prompts": {"p": {"prompt_ids": [1, 2, 1], "modes": {"target": {
      "token_ids": [2, 1, 2], "new_tokens": 3, "prefill_s": 1.0, "decode_s": 2.0}}}}}))
  out = lookup_bound.main([str(path)])
  assert out["p"]["ngram"][1]["rounds"] == 1  # "2" -> drafts 1 2; both accepted
  assert "at most" in capsys.readouterr().out
  with pytest.raises(SystemExit):
    lookup_bound.main([str(tmp_path / "missing.json")])
