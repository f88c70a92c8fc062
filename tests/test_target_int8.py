"""The lossy int8 target: an explicit opt-in that stores the target per output in int8.

On these tiny models speculative decoding gives the quantized target's own
output. On the real pair it may not, token for token: quantizing each
activation row can turn summation-order differences between a step and a
verify into a flipped near tie (docs/decisions-compact.md, "Lossy int8
target"). Against the full-precision target the loss is measured, not
assumed (`bench.tools.target_int8`).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jspec
import test_lossless
import tiny
from bench.tools import target_int8
from jspec import bundle as bundle_lib
from jspec import cli
from jspec import model
from jspec import weights

INT8 = (weights.Int8, weights.Int8Panels)


def _matrices(m: bundle_lib.Model) -> list:
  return [w for w in jax.tree.leaves(m.params, is_leaf=weights.is_leaf) if weights.is_leaf(w)]


def _targets(seed: int = 0):
  """The tiny packable target, full precision and int8, from the same weights."""
  params = model.init_params(tiny.PACKABLE_TARGET, jax.random.key(seed), scale=0.3)
  full = bundle_lib.prepare(tiny.PACKABLE_TARGET, params, "target")
  q8 = bundle_lib.prepare(tiny.PACKABLE_TARGET, params, "target",
                          jspec.Settings(target_int8=True))
  return full, q8


def test_only_the_opt_in_quantizes_the_target():
  full, q8 = _targets()
  assert not any(isinstance(w, INT8) for w in _matrices(full))
  assert all(isinstance(w, INT8) for w in _matrices(q8))
  assert q8.backend.dtype == "float32"
  with pytest.raises(ValueError, match="target_int8='yes': expected True or False"):
    jspec.Settings(target_int8="yes")


def test_the_int8_target_is_close_to_the_full_one_but_not_the_same():
  full, q8 = _targets()
  ids = tiny.prompt(3, 40, tiny.PACKABLE_VOCAB)
  same = target_int8.quality(full, full, ids, 8)
  assert same["top1_agreement"] == 1.0 and abs(same["mean_kl"]) < 1e-6
  got = target_int8.quality(full, q8, ids, 8)
  assert got["positions"] == 32
  assert 0 < got["mean_kl"] < 0.05, got  # lossy, but a small loss
  assert got["top1_agreement"] >= 0.8, got
  assert got["max_kl"] >= got["mean_kl"]


def test_quality_scores_the_positions_that_predict_the_path():
  # The reference's own greedy path: its argmax at every scored position is the next token.
  bundle = tiny.packable_pair(1, draft_int8=False)
  prompt = tiny.prompt(4, 9, tiny.PACKABLE_VOCAB)
  path = jspec.generate(bundle, prompt, max_new_tokens=12, method="target").token_ids
  got = target_int8.quality(bundle.target, bundle.target, prompt + path, len(prompt))
  assert got["reference_follows_path"] == 1.0 and got["positions"] == 12
  shifted = target_int8.quality(bundle.target, bundle.target, prompt + path, len(prompt) + 1)
  assert shifted["positions"] == 11
  with pytest.raises(ValueError, match="start=0"):
    target_int8.quality(bundle.target, bundle.target, prompt, 0)


def test_speculative_decoding_is_lossless_for_the_int8_target():
  bundle = tiny.packable_pair(5, target_int8=True)
  assert all(isinstance(w, INT8) for w in _matrices(bundle.target))
  prompt = [2, 7, 1, 8, 2, 8, 1, 8]
  base = jspec.generate(bundle, prompt, max_new_tokens=20, method="target").token_ids
  for policy in ("fixed", "confidence"):
    got = jspec.generate(bundle, prompt, max_new_tokens=20, gamma=4, policy=policy)
    assert got.token_ids == base
  spec = jspec.Options(temperature=1.0, gamma=3, policy="fixed").spec(
      bundle.target.arch, bundle.draft.arch, bundle.vocab_limit)
  samples = test_lossless.draw(bundle, [prompt], spec, 2, seed=13)[0]
  probs = test_lossless.exact_joint(bundle, prompt, 2, spec.sampling)
  assert test_lossless.chi_square_p(samples, probs) > test_lossless.ALPHA


def test_the_command_line_flag_reaches_the_settings(monkeypatch, capsys):
  seen = {}

  def fake_load(target, draft, **kwargs):  # stops the command before anything loads
    seen.update(kwargs)
    raise cli.UsageError("stopped by the test")

  monkeypatch.setattr(cli.loading, "load", fake_load)
  assert cli.main(["generate", "hi", "--target-int8", "--method", "target"]) == 2
  assert seen["settings"].target_int8 is True
  assert "lossy" in capsys.readouterr().err
  assert cli.main(["generate", "hi", "--method", "target"]) == 2
  assert seen["settings"].target_int8 is False
  assert "lossy" not in capsys.readouterr().err
