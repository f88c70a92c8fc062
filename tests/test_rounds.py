"""`jspec.rounds`: a greedy round replayed on a known path as the engine runs it."""

import numpy as np

import jspec
import tiny
from jspec import decode
from jspec import rounds


def test_widths_are_the_engines():
  bundle = tiny.pair(0)
  for g in range(1, 10):
    for policy in ("fixed", "confidence"):
      spec = jspec.Options(gamma=g, policy=policy).spec(bundle.target.arch, bundle.draft.arch,
                                                        bundle.vocab_limit)
      assert decode.verify_widths_for(g) == decode.verify_widths(spec), (g, policy)
  assert rounds.width_for(1, 5) == 2 and rounds.width_for(3, 5) == 5 and rounds.width_for(5, 5) == 6


def test_fixed_gamma_on_a_fully_predicted_path():
  ok = np.ones(10, bool)
  c = np.full(10, 0.1)  # every draft right, however unsure
  assert rounds.replay_round(ok, c, 1, rounds.confidence(0.5), 2, 2, stops=False) == (3, 2, 3, 2)
  assert rounds.tokens_and_rounds(ok, c, rounds.confidence(0.5), 2, 2, stops=False) == (9, 3)


def test_confidence_stops_and_counts_only_what_the_width_holds():
  ok = np.ones(12, bool)
  c = np.full(12, 0.9)
  c[2] = 0.3  # the round at 1 drafts position 1 (sure), then 2 (unsure): it stops
  # One counted draft: verify width 2, whose only draft slot is taken, so the
  # computed second draft is not counted; two forwards paid.
  assert rounds.replay_round(ok, c, 1, rounds.confidence(0.5), 8, 8) == (2, 2, 2, 1)
  c[1] = 0.3  # unsure from the first draft: one forward, width 2, whatever follows
  assert rounds.replay_round(ok, c, 1, rounds.confidence(0.5), 8, 8) == (2, 1, 2, 1)
  c[:] = 0.9
  c[5] = 0.3  # three sure drafts, the fourth unsure: width 5 holds it too
  assert rounds.replay_round(ok, c, 2, rounds.confidence(0.5), 8, 8) == (5, 4, 5, 4)
  # The cap ends the round after its drafts, with no extra forward.
  assert rounds.replay_round(ok, np.full(12, 0.9), 1, rounds.confidence(0.5), 2, 2) == (3, 2, 3, 2)


def test_a_wrong_draft_ends_what_is_accepted():
  ok = np.ones(12, bool)
  ok[3] = False  # the round at 1 drafts positions 1, 2 right and 3 wrong
  got = rounds.replay_round(ok, np.ones(12), 1, rounds.confidence(0.5), 4, 4, stops=False)
  assert got == (3, 4, 5, 4)


def test_a_whole_path_by_hand():
  # Positions 0..9 (0 is the prefill's token); threshold 0.7, cap 5 (widths 2, 3, 5, 6).
  ok = np.array([1, 1, 1, 0, 1, 1, 1, 1, 1, 1], bool)
  c = np.array([1, 0.9, 0.9, 0.9, 0.2, 0.9, 0.9, 0.9, 0.9, 0.9])
  # Round at 1: drafts 1, 2, 3 sure, 4 computed and unsure (4 forwards, 3
  # counted, width 5 fills the 4th); 1, 2 accepted, 3 wrong: 3 tokens.
  # Round at 4: its first draft unsure: 1 forward, width 2; accepted: 2 tokens.
  # Round at 6: 6..9 sure, the cap's 5th draft clamped at the end: 4 tokens left.
  assert rounds.replay_round(ok, c, 1, rounds.confidence(0.7), 5, 5) == (3, 4, 5, 4)
  assert rounds.replay_round(ok, c, 4, rounds.confidence(0.7), 5, 5) == (2, 1, 2, 1)
  assert rounds.tokens_and_rounds(ok, c, rounds.confidence(0.7), 5, 5) == (9, 3)
  assert rounds.tokens_and_rounds(ok[:1], c[:1], rounds.confidence(0.7), 5, 5) == (0, 0)
