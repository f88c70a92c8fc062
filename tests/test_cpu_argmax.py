"""jspec.cpu_argmax: the greedy token by the kernel is jnp.argmax's, and the loop takes it there."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
import tiny
from jspec import api
from jspec import bundle as bundle_lib
from jspec import cpu_argmax
from jspec import cpu_kernels
from jspec import decode
from jspec import model
from jspec import sampling

pytestmark = pytest.mark.skipif(not cpu_kernels.available(),
                                reason=f"kernels unavailable: {cpu_kernels.unavailable_reason()}")


def _reference(x: np.ndarray, limit) -> np.ndarray:
  """jnp.argmax over the ids below limit, as `sampling.argmax` computes it without the kernel."""
  v = x.shape[-1]
  limit = v if limit is None else limit
  return np.asarray(jnp.argmax(jnp.where(jnp.arange(v) < limit, jnp.asarray(x), -jnp.inf), -1))


@pytest.mark.parametrize("width", [4096, 4099, 65568, 151936])
@pytest.mark.parametrize("limit", [None, -37, 5, 1])
def test_the_kernel_gives_jnp_argmax_over_the_ids_below_the_limit(width, limit):
  if limit is not None and limit < 0:
    limit = width + limit
  rs = np.random.RandomState(width + (limit or 0))
  x = rs.standard_normal((6, width)).astype(np.float32)
  top = float(x.max()) + 1.0
  x[1, [7, 3000]] = top  # a tie: the first index wins
  x[2, width - 2] = top  # the largest in the row's scalar tail (past its last full vector)
  x[3, width - 1] = top + 5  # past every limit but None's
  x[4, 0] = top  # the first id
  x[5, :] = x[5, 0]  # every id equal
  got = np.asarray(jax.jit(lambda a: cpu_argmax.argmax(a, limit))(jnp.asarray(x)))
  np.testing.assert_array_equal(got, _reference(x, limit))


def test_nan_and_infinite_rows_follow_jnp_argmax():
  x = np.full((5, 4100), -np.inf, np.float32)  # row 0: all -inf -> 0
  x[1, [9, 4098]] = np.nan  # the first NaN wins, over any number
  x[1, 2] = np.inf
  x[2, [40, 41]] = np.inf  # +inf ties: the first
  x[3, 4099] = np.nan  # a NaN past the limit is not seen
  x[3, 100] = 1.0
  x[4, 10:] = 2.0
  x[4, 4097] = np.nan  # in the tail
  for limit in (None, 4099):
    got = np.asarray(cpu_argmax.argmax(jnp.asarray(x), limit))
    np.testing.assert_array_equal(got, _reference(x, limit))
  assert list(np.asarray(cpu_argmax.argmax(jnp.asarray(x), 4099))) == [0, 9, 40, 100, 4097]


def test_bad_shapes_are_refused_before_the_call():
  with pytest.raises(ValueError, match="expected V >= 1 and limit >= 1"):
    cpu_argmax.argmax(jnp.zeros((2, 0), jnp.float32))
  with pytest.raises(ValueError, match="expected V >= 1 and limit >= 1"):
    cpu_argmax.argmax(jnp.zeros((2, 8), jnp.float32), 0)


def test_sampling_takes_the_kernel_only_for_wide_float32_rows_of_a_kernel_model():
  s = sampling.Sampling(temperature=0.0, vocab_limit=5000)
  def calls(x, kernels):
    text = jax.jit(lambda a: sampling.argmax(a, s, kernels)).lower(x).as_text()
    return cpu_kernels.TARGET_ARGMAX in text
  wide = jnp.zeros((2, 3, cpu_argmax.MIN_WIDTH + 64), jnp.float32)
  assert calls(wide, True)
  assert not calls(wide, False)
  assert not calls(jnp.zeros((2, cpu_argmax.MIN_WIDTH - 32), jnp.float32), True)
  assert not calls(wide.astype(jnp.bfloat16), True)
  x = np.random.RandomState(0).standard_normal((2, 3, 5100)).astype(np.float32)
  x[0, 0, 5050] = 99.0  # past vocab_limit
  np.testing.assert_array_equal(sampling.argmax(jnp.asarray(x), s, True),
                                sampling.argmax(jnp.asarray(x), s, False))


def test_a_greedy_loop_over_a_wide_vocabulary_takes_every_token_by_the_kernel():
  # The verify's widths, the draft's steps and its catch-up each choose
  # their greedy token with the kernel once the vocabulary is wide enough
  # (the tiny pairs' vocabularies keep XLA's argmax), and the speculative
  # loop still gives target-only's tokens. The draft is the target's
  # weights (stored in 4 bits), so that it drafts tokens the target keeps.
  vocab = cpu_argmax.MIN_WIDTH
  cfg = dataclasses.replace(tiny.PACKABLE_TARGET, vocab_size=vocab)
  params = model.init_params(cfg, jax.random.key(3), scale=0.3)
  bundle = bundle_lib.make((cfg, params), (cfg, params), settings=jspec.Settings(kernels=True))
  prompt = tiny.prompt(1, 7, vocab)
  req = api.request(bundle, prompt, jspec.Options(max_new_tokens=16))
  text = req.run.program().as_text()
  assert text.count(f'custom_call_target="{cpu_kernels.TARGET_ARGMAX}"') >= (
      len(decode.verify_widths(req.spec)) + 2)
  spec = jspec.generate(bundle, prompt, max_new_tokens=16)
  base = jspec.generate(bundle, prompt, max_new_tokens=16, method="target")
  assert spec.token_ids == base.token_ids
  assert spec.stats["accepted"] > 0
