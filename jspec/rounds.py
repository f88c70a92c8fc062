"""Greedy draft-model rounds replayed on a known path.

Greedy, a round's outcome is fixed by the target's own tokens: while its
drafts match, the draft sees exactly the prefix of the target's path. So
whether the draft's argmax agrees with the target at each position of a
path, and the draft's top probability there, give the rounds the engine
would run, without running it. `jspec.distill` estimates tokens per round on
held-out target output this way, and `bench.tools.policy_replay` prices
stopping rules with it. One approximation: after a wrong draft the rule is
shown the confidences of the true path, not of the draft's own wrong
continuation (those drafts are rejected whatever they are; only how many are
run can differ).

Axis letters: N positions of a path.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from jspec import decode

# A rule sees the round's draft confidences one by one and says whether to go
# on: (confidences so far [i], cap) -> bool.
Rule = Callable[[Sequence[float], int], bool]


def confidence(threshold: float) -> Rule:
  """jspec's confidence policy: go on while the newest draft's top probability is at least `threshold`.

  Args:
    threshold: the policy's `min_confidence`.

  Returns:
    The rule.
  """
  return lambda c, cap: c[-1] >= threshold


def width_for(counted: int, gamma_max: int) -> int:
  """The narrowest compiled verify width holding x_{n-1} and `counted` drafts.

  Args:
    counted: drafts the round counts.
    gamma_max: the static bound on drafts (`decode.verify_widths_for`).

  Returns:
    The width.
  """
  return next(w for w in decode.verify_widths_for(gamma_max) if w >= counted + 1)


def replay_round(ok: np.ndarray, c: np.ndarray, j: int, rule: Rule, cap: int, gamma_max: int,
                 stops: bool = True) -> tuple[int, int, int, int]:
  """One greedy round starting at position j (the first token it can emit is the path's j-th).

  Mirrors `drafters.draft_model` and `decode.fill_verify`: the first draft
  always counts; the loop computes draft i + 1 while the row is going and
  counts it if the rule accepts it; a rule that stops leaves its last
  computed draft uncounted, and the fill counts computed drafts into the
  verify's spare positions.

  Args:
    ok: [N] bool, the draft's argmax equals the target's token at each position.
    c: [N] the draft's top probability there.
    j: the round's first position.
    rule: the stopping rule.
    cap: most drafts counted (the policy's gamma).
    gamma_max: the static bound (widths).
    stops: whether the rule is applied (False: fixed gamma).

  Returns:
    (tokens emitted, draft forwards, verify width, drafts counted); the
    tokens are not clipped to the path's end.
  """
  n = len(ok)
  at = lambda i: min(j + i, n - 1)  # draft i + 1's position (clamped past the path's end)
  conf = [float(c[at(0)])]
  counted, forwards = 1, 1
  going = cap > 1 and (not stops or rule(conf, cap))
  while going and forwards < gamma_max:
    conf.append(float(c[at(forwards)]))
    forwards += 1
    take = not stops or rule(conf, cap)
    counted += int(take)
    going = take and forwards < cap
  width = width_for(counted, gamma_max)
  counted = max(counted, min(forwards, width - 1))
  accepted = 0
  while accepted < counted and j + accepted < n and ok[j + accepted]:
    accepted += 1
  return accepted + 1, forwards, width, counted


def tokens_and_rounds(ok: np.ndarray, c: np.ndarray, rule: Rule, cap: int, gamma_max: int,
                      stops: bool = True) -> tuple[int, int]:
  """Replays a whole path from position 1 (position 0 is the prefill's token).

  Args:
    ok: [N] bool, as `replay_round`'s.
    c: [N] the draft's top probability at each position.
    rule, cap, gamma_max, stops: as `replay_round`'s.

  Returns:
    (tokens emitted by rounds, rounds): N - 1 tokens, and 0 rounds for a
    path of at most one position.
  """
  j, rounds = 1, 0
  while j < len(ok):
    emitted = replay_round(ok, c, j, rule, cap, gamma_max, stops)[0]
    rounds += 1
    j += min(emitted, len(ok) - j)
  return max(len(ok) - 1, 0), rounds
