"""The lossy int8 target: an explicit opt-in that stores the target per output in int8.

Its matrices hold the per-row int8 quantization as symmetric blocks of 32
inputs (each row's scale repeated), multiplied with float32 activations by
the block kernel, so a row's product does not depend on the rows beside it
and a verify row equals the target-only step's. The first form quantized
each activation row to int8 too, which turned float summation-order
differences between a step and a verify into flipped near ties on the real
pair (docs/decisions-compact.md, "Lossy int8 target"). Against the
full-precision target the loss is measured, not assumed (`bench.tools.target_int8`).
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
BLOCK = 32


def _matrices(m: bundle_lib.Model) -> list:
  return [w for w in jax.tree.leaves(m.params, is_leaf=weights.is_leaf) if weights.is_leaf(w)]


def _targets(seed: int = 0):
  """The tiny packable target, full precision and int8, from the same weights."""
  params = model.init_params(tiny.PACKABLE_TARGET, jax.random.key(seed), scale=0.3)
  full = bundle_lib.prepare(tiny.PACKABLE_TARGET, params, "target")
  q8 = bundle_lib.prepare(tiny.PACKABLE_TARGET, params, "target",
                          jspec.Settings(target_int8=True))
  return full, q8


def _is_int8_blocks(w) -> bool:
  """A symmetric `Blocks` leaf with one scale per 32 inputs."""
  return (isinstance(w, weights.Blocks) and w.offset is None and w.q.dtype == np.int8
          and w.q.shape[1] == BLOCK * w.scale.shape[1])


def test_only_the_opt_in_quantizes_the_target():
  full, q8 = _targets()
  assert not any(isinstance(w, (*INT8, weights.Blocks)) for w in _matrices(full))
  assert all(_is_int8_blocks(w) for w in _matrices(q8)), {type(w) for w in _matrices(q8)}
  assert q8.backend.dtype == "float32"
  # The draft's int8 form is its own (activations quantized too: it only proposes).
  bundle = tiny.packable_pair(5, target_int8=True, draft_int4=False)
  assert all(_is_int8_blocks(w) for w in _matrices(bundle.target))
  assert all(isinstance(w, INT8) for w in _matrices(bundle.draft))
  with pytest.raises(ValueError, match="target_int8='yes': expected True or False"):
    jspec.Settings(target_int8="yes")


def test_the_int8_target_holds_each_rows_int8_quantization_exactly():
  # The blocks repeat each row's scale: they widen to the per-row int8 values, bit for bit.
  params = model.init_params(tiny.PACKABLE_TARGET, jax.random.key(0), scale=0.3)
  _, q8 = _targets()
  source = _matrices(bundle_lib.Model(tiny.PACKABLE_TARGET, params))
  got = _matrices(q8)
  assert len(source) == len(got) > 0
  for w, stored in zip(source, got):
    assert stored.shape == w.shape
    want = weights.matrix(weights.to_int8(w))
    np.testing.assert_array_equal(np.asarray(weights.matrix(stored)), np.asarray(want))
  # Rows read from the token table are the quantized rows too.
  ids = jax.numpy.asarray([[0, 5, 63]])
  table = q8.params["embed"]["table"]
  want = weights.lookup(weights.to_int8(params["embed"]["table"]), ids)
  np.testing.assert_array_equal(np.asarray(weights.lookup(table, ids)), np.asarray(want))


def test_a_one_ulp_nudge_to_the_activations_moves_the_product_by_rounding_only():
  # What broke the first form: an activation row quantized to int8 turns a
  # one-ulp difference at a rounding boundary into a whole step.
  _, q8 = _targets()
  rng = np.random.RandomState(0)
  for w in _matrices(q8):
    i = w.shape[0]
    x = rng.uniform(-100, 100, (4, i)).astype(np.float32)
    x[:, 0] = 127.0  # each row's absmax, so its int8 step would be 1.0
    x[:, 1] = 10.5  # a rounding tie in int8
    nudged = x.copy()
    nudged[:, 1] = np.nextafter(np.float32(10.5), np.float32(11))
    y = np.asarray(weights.dot(jax.numpy.asarray(x), w))
    y2 = np.asarray(weights.dot(jax.numpy.asarray(nudged), w))
    m = np.asarray(weights.matrix(w), np.float64)  # [I, O]
    bound = 1e-5 * (np.abs(x) @ np.abs(m)).max()
    assert np.abs(y2 - y).max() <= bound, (w.shape, np.abs(y2 - y).max(), bound)
    # Float activations: the product is x @ W up to float32 rounding.
    np.testing.assert_allclose(y, x.astype(np.float64) @ m, rtol=0, atol=bound)


def test_each_row_of_an_int8_target_product_is_the_same_whatever_rows_share_the_call():
  _, q8 = _targets()
  rng = np.random.RandomState(1)
  for w in _matrices(q8):
    x = jax.numpy.asarray(rng.standard_normal((9, w.shape[0])).astype(np.float32))
    together = np.asarray(weights.dot(x, w))
    for m in (1, 2, 3, 5):
      np.testing.assert_array_equal(np.asarray(weights.dot(x[:m], w)), together[:m])
    alone = np.stack([np.asarray(weights.dot(x[r:r + 1], w))[0] for r in range(9)])
    np.testing.assert_array_equal(alone, together)


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


def test_greedy_speculative_output_is_the_int8_targets_own():
  # The property the first form lost on the real pair: over seeds and
  # prompts (one past a prefill chunk), every mode's greedy output is
  # the int8 target's target-only output, token for token.
  for seed in (0, 1, 2):
    bundle = tiny.packable_pair(seed, target_int8=True)
    for k, length in enumerate((6, 70)):
      prompt = tiny.prompt(10 * seed + k, length, tiny.PACKABLE_VOCAB)
      base = jspec.generate(bundle, prompt, max_new_tokens=24, method="target").token_ids
      for gamma, policy in ((4, "fixed"), (3, "confidence")):
        got = jspec.generate(bundle, prompt, max_new_tokens=24, gamma=gamma, policy=policy)
        assert got.token_ids == base, (seed, length, gamma, policy)


def test_speculative_sampling_is_lossless_for_the_int8_target():
  bundle = tiny.packable_pair(5, target_int8=True)
  prompt = [2, 7, 1, 8, 2, 8, 1, 8]
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
