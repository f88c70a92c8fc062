"""The decode engine: greedy equivalence, rollback, EOS, batches, streaming, compile-once."""

from __future__ import annotations

import dataclasses
import functools

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
import tiny
from jspec import cache as cache_lib
from jspec import decode
from jspec import drafters
from jspec import model
from jspec import options as options_lib
from jspec import programs
from jspec import sampling

# A few fixed engine settings, so hypothesis varies weights, prompts and EOS
# (all data) without compiling a new program for every example.
SETTINGS = [
    dict(method="model", gamma=1, policy="fixed"),
    dict(method="model", gamma=3, policy="fixed"),
    dict(method="model", gamma=2, gamma_max=5, policy="heuristic"),
    dict(method="model", gamma=5, policy="confidence", min_confidence=0.5, gamma_max=5),
    dict(method="model"),  # the defaults
    dict(method="prompt_lookup", gamma=3, ngram=1, policy="fixed"),
    dict(method="prompt_lookup", gamma=4, ngram=2, policy="heuristic", gamma_max=6),
    dict(method="lookup_model", gamma=4, ngram=2, policy="fixed"),
    dict(method="lookup_model", gamma=5, ngram=3, policy="confidence", min_confidence=0.5),
]
MAX_NEW = 24


def with_eos(bundle: jspec.Bundle, eos: tuple[int, ...]) -> jspec.Bundle:
  t_cfg = dataclasses.replace(bundle.target.cfg, eos_token_ids=eos)
  return jspec.Bundle(dataclasses.replace(bundle.target, cfg=t_cfg), bundle.draft)


def spec_of(bundle: jspec.Bundle, **kwargs) -> decode.Spec:
  """The `decode.Spec` that `jspec.generate(bundle, ..., **kwargs)` compiles for."""
  return jspec.Options(**kwargs).spec(bundle.target.arch,
                                      bundle.draft.arch if bundle.draft else None,
                                      bundle.vocab_limit)


# One case per setting, so that each is covered and pytest-xdist can spread
# them over workers; hypothesis draws the data for each, seeded by the
# setting, so every setting sees different weights, prompts and EOS.
@pytest.mark.slow
@pytest.mark.parametrize("setting", range(len(SETTINGS)))
def test_greedy_speculative_equals_target(setting):

  @hypothesis.seed(setting)
  @hypothesis.settings(max_examples=3, deadline=None, database=None,
                       suppress_health_check=[hypothesis.HealthCheck.too_slow])
  @hypothesis.given(seed=st.integers(0, 2**16), length=st.integers(1, 14),
                    eos_at=st.integers(-1, MAX_NEW - 1), scale=st.sampled_from([0.3, 1.0]))
  def check(seed, length, eos_at, scale):
    bundle = tiny.pair(seed, scale=scale)
    prompt = tiny.prompt(seed, length)
    base = jspec.generate(bundle, prompt, max_new_tokens=MAX_NEW, method="target")
    if eos_at >= 0:  # make a token the target really emits the EOS, so rows stop midway
      eos = base.token_ids[eos_at]
      bundle = with_eos(bundle, (eos,))
      base = jspec.generate(bundle, prompt, max_new_tokens=MAX_NEW, method="target")
      assert base.token_ids[-1] == eos and eos not in base.token_ids[:-1]
    got = jspec.generate(bundle, prompt, max_new_tokens=MAX_NEW, **SETTINGS[setting])
    assert got.token_ids == base.token_ids
    assert got.stats["accepted"] <= got.stats["drafted"]

  check()


@pytest.mark.slow
@pytest.mark.parametrize("gamma", [1, 3, 4])
def test_draft_equal_to_target_accepts_everything(gamma):
  bundle = tiny.pair(1)
  bundle = jspec.Bundle(bundle.target, bundle.target)  # the float target: an int8 copy differs
  n_new = 1 + 5 * (gamma + 1)
  out = jspec.generate(bundle, [1, 2, 3], max_new_tokens=n_new, gamma=gamma, policy="fixed")
  base = jspec.generate(bundle, [1, 2, 3], max_new_tokens=n_new, method="target")
  assert out.token_ids == base.token_ids
  # Every round accepts all gamma drafts and adds the bonus token.
  assert out.stats["accepted"] == out.stats["drafted"] == 5 * gamma
  assert out.stats["rounds"] == 5
  assert out.stats["accepted_histogram"] == [0] * gamma + [5]
  assert out.stats["mean_tokens_per_round"] == gamma + 1


@pytest.mark.slow
def test_eos_inside_an_accepted_block_ends_the_row_there():
  bundle = tiny.pair(1)
  bundle = jspec.Bundle(bundle.target, bundle.target)  # every block fully accepted
  base = jspec.generate(bundle, [4, 4, 2], max_new_tokens=20, method="target")
  eos = base.token_ids[6]  # inside the second block of gamma 4 + 1
  first = base.token_ids.index(eos)
  bundle = with_eos(bundle, (eos,))
  out = jspec.generate(bundle, [4, 4, 2], max_new_tokens=20, gamma=4, policy="fixed")
  assert out.token_ids == base.token_ids[:first + 1]
  assert jspec.generate(bundle, [4, 4, 2], max_new_tokens=20, stop_at_eos=False).token_ids \
      == base.token_ids


@pytest.mark.slow
def test_max_new_tokens_is_exact_for_every_gamma():
  bundle = tiny.pair(2)
  bundle = jspec.Bundle(bundle.target, bundle.target)
  for n in (1, 2, 5, 7):
    for gamma in (1, 4):
      assert len(jspec.generate(bundle, [1], max_new_tokens=n, gamma=gamma).token_ids) == n


def _prefill_cache(m: jspec.Model, tokens: list[int], slots: int) -> cache_lib.KVCache:
  cache = cache_lib.init(m.cfg, 1, slots, m.backend.dtype)
  _, cache = model.forward(m.arch, m.params, jnp.asarray([tokens], jnp.int32), cache)
  return cache


@pytest.mark.slow
@pytest.mark.parametrize("method", ["model", "model_is_target", "prompt_lookup", "lookup_model"])
def test_caches_after_rounds_equal_a_fresh_prefill(method):
  bundle = tiny.pair(4)
  if method == "model_is_target":  # every round accepts all drafts: the draft stays behind
    bundle, method = jspec.Bundle(bundle.target, bundle.target), "model"
  uses_draft = method in decode.DRAFT_METHODS
  spec = spec_of(bundle, method=method, temperature=1.0, gamma=3, policy="fixed", ngram=1)
  prompt = [5, 3, 5, 3, 5]
  width = decode.buffer_width(8, 16, 3)
  dparams = bundle.draft.params if uses_draft else None
  state = decode.prefill(bundle.target.params, dparams, jnp.asarray([prompt + [0] * 3]),
                         jnp.asarray([5]), jnp.asarray([16]), jnp.zeros((0,), jnp.int32),
                         jax.random.key(0), spec=spec, width=width)
  for limit in (1, 2, 5):  # stop after a few rounds, compare, go on
    state = decode.run(bundle.target.params, dparams, state, jnp.int32(limit), spec=spec)
    n = int(state.seq_len[0])
    tokens = np.asarray(state.tokens[0, :n]).tolist()
    t_len = int(state.target_cache.lengths[0])
    assert t_len == n - 1
    fresh = _prefill_cache(bundle.target, tokens[:t_len], width)
    chex.assert_trees_all_close((state.target_cache.k[:, :, :t_len],
                                 state.target_cache.v[:, :, :t_len]),
                                (fresh.k[:, :, :t_len], fresh.v[:, :, :t_len]), atol=1e-5)
    if uses_draft:
      # The draft holds what draft_len says: every token but the last, or
      # but the last two when its row accepted every draft it ran (and with
      # lookup_model less, after rounds that prompt lookup drafted).
      held = int(state.draft_len[0])
      assert (n - 2 if method == "model" else 0) <= held <= n - 1
      fresh = _prefill_cache(bundle.draft, tokens[:held], width)
      chex.assert_trees_all_close((state.draft_cache.k[:, :, :held],
                                   state.draft_cache.v[:, :, :held]),
                                  (fresh.k[:, :, :held], fresh.v[:, :, :held]), atol=1e-5)


@pytest.mark.slow
def test_verify_runs_the_narrowest_width_that_holds_every_counted_draft():
  bundle = tiny.pair(11)
  params, arch = bundle.target.params, bundle.target.arch
  spec = spec_of(bundle, method="prompt_lookup", gamma=8, policy="fixed")
  assert decode.verify_widths(spec) == (1, 2, 3, 5, 9)
  assert decode.verify_widths(spec_of(bundle, method="model", gamma=8, policy="fixed")) \
      == (2, 3, 5, 9)
  assert decode.verify_widths(spec_of(bundle, method="model", gamma=2, policy="fixed")) \
      == (2, 3)
  assert decode.verify_widths(dataclasses.replace(spec, dynamic_verify=False)) == (9,)
  slots, starts = 32, jnp.asarray([6, 9])
  _, cache = model.forward(arch, params, jnp.asarray([tiny.prompt(11, 9)] * 2),
                           cache_lib.init(tiny.TARGET, 2, slots))
  cache = cache_lib.with_lengths(cache, starts)
  # A sentinel in every free slot shows which slots the verify wrote.
  free = jnp.arange(slots)[None, None, :, None, None] >= starts[None, :, None, None, None]
  cache = cache.replace(k=jnp.where(free, 123.0, cache.k))
  chunk = jnp.asarray([tiny.prompt(12, 9), tiny.prompt(13, 9)])  # [2, G+1]
  full, _ = model.forward(arch, params, chunk, cache)
  sampled = dataclasses.replace(spec, sampling=sampling.Sampling(1.0))  # logits, not tokens
  for counted, w in [((0, 0), 1), ((1, 0), 2), ((0, 2), 3), ((3, 1), 5), ((4, 4), 5),
                     ((5, 0), 9), ((8, 8), 9)]:
    logits, out = decode.verify(params, sampled, chunk, cache, jnp.asarray(counted))
    # Greedy, the verdict is the argmax token at each position.
    tokens, greedy_out = decode.verify(params, spec, chunk, cache, jnp.asarray(counted))
    for row, c in enumerate(counted):
      np.testing.assert_allclose(logits[row, :c + 1], full[row, :c + 1], atol=1e-5)
      assert tokens[row, :c + 1].tolist() == np.argmax(full[row, :c + 1], -1).tolist()
      for o in (out, greedy_out):
        written = np.any(np.asarray(o.k[:, row]) != 123.0, axis=(0, 2, 3))  # [S]
        assert written.tolist() == [True] * (int(starts[row]) + w) + [False] * (
            slots - int(starts[row]) - w), (counted, w)


def test_fill_verify_counts_ready_drafts_only_into_spare_positions():
  spec = spec_of(tiny.pair(0), method="model", gamma=8, policy="fixed")  # widths 2, 3, 5, 9
  fill = lambda counted, ready, done=(False, False): decode.fill_verify(
      spec, jnp.asarray(counted), jnp.asarray(ready), jnp.asarray(done)).tolist()
  assert fill((1, 1), (2, 2)) == [1, 1]  # one counted: width 2 has no spare position
  assert fill((2, 1), (3, 3)) == [2, 2]  # width 3 holds a second
  assert fill((3, 1), (4, 4)) == [4, 4]  # width 5: up to 4 drafts, no more than ready
  assert fill((4, 2), (5, 5)) == [4, 4]  # width 5 is full: nothing past it
  assert fill((5, 1), (6, 6)) == [6, 6]  # width 9, but only 6 were computed
  assert fill((2, 2), (2, 2)) == [2, 2]  # nothing ready beyond the counted
  # A finished row neither widens the verify nor stops the others filling it.
  assert fill((8, 3), (8, 8), (True, False)) == [8, 4]


@pytest.mark.slow
def test_confidence_policy_stops_an_unsure_greedy_draft():
  # Greedy, q is a point mass (top probability always 1): the policy must
  # read the draft's own softmax instead, or it never stops drafting.
  bundle = tiny.pair(seed=14)
  prompt = tiny.prompt(14, 6)
  base = jspec.generate(bundle, prompt, max_new_tokens=24, method="target")
  traces = {}
  for threshold in (0.0, 0.3, 1.0):
    out = jspec.generate(bundle, prompt, max_new_tokens=24, gamma=6, gamma_max=6,
                         policy="confidence", min_confidence=threshold)
    assert out.token_ids == base.token_ids
    traces[threshold] = out.stats["gamma_trace"]
  assert set(traces[0.0]) == {6}  # always sure enough
  assert set(traces[1.0]) == {1}  # never: only the first draft counts
  assert len(set(traces[0.3])) > 1 and min(traces[0.3]) < 6  # stops where the draft is unsure


@functools.lru_cache(maxsize=None)
def _batch_case():
  """Four prompts of different lengths, a bundle, and each prompt's target-only run alone."""
  bundle = tiny.pair(6)
  prompts = [tiny.prompt(i, n) for i, n in enumerate([3, 9, 1, 14])]
  base = [jspec.generate(bundle, p, max_new_tokens=MAX_NEW, method="target").token_ids
          for p in prompts]
  # An EOS that one row emits early makes rows finish at different times.
  eos = base[1][4]
  bundle = with_eos(bundle, (eos,))
  singles = [jspec.generate(bundle, p, max_new_tokens=MAX_NEW, method="target").token_ids
             for p in prompts]
  return bundle, prompts, singles


@pytest.mark.slow
@pytest.mark.parametrize("setting", range(len(SETTINGS)))
def test_batch_rows_equal_their_single_runs(setting):
  bundle, prompts, singles = _batch_case()
  assert len({len(s) for s in singles}) > 1
  batch = jspec.generate(bundle, prompts, max_new_tokens=MAX_NEW, **SETTINGS[setting])
  assert [r.token_ids for r in batch] == singles, SETTINGS[setting]


@pytest.mark.slow
def test_seed_reproduces_a_sampled_generation():
  bundle = tiny.pair(7)
  kw = dict(max_new_tokens=20, temperature=1.0, top_p=0.9, gamma=3)
  a = jspec.generate(bundle, [1, 2], seed=5, **kw).token_ids
  assert a == jspec.generate(bundle, [1, 2], seed=5, **kw).token_ids
  assert any(jspec.generate(bundle, [1, 2], seed=s, **kw).token_ids != a for s in range(6, 10))


@pytest.mark.slow
def test_prompt_lookup_without_a_match_emits_one_target_token_per_round():
  bundle = tiny.pair(8)
  # Distinct tokens none of which is the first new one: not even a 1-gram
  # occurs twice when the first round looks up.
  for start in range(tiny.VOCAB - 4):
    prompt = list(range(start, start + 4))
    base = jspec.generate(bundle, prompt, max_new_tokens=2, method="target")
    if base.token_ids[0] not in prompt:
      break
  else:
    pytest.fail("every prompt's first new token was in it")
  out = jspec.generate(bundle, prompt, max_new_tokens=2, method="prompt_lookup", ngram=2)
  assert out.token_ids == base.token_ids
  assert out.stats["drafted"] == 0 and out.stats["rounds"] == 1


def test_lookup_model_copies_up_to_sixteen_by_default_and_model_drafts_five():
  gammas = lambda **kw: jspec.Options(**kw).gammas()
  assert gammas(method="lookup_model") == (16, 16)
  assert options_lib.DEFAULT_LOOKUP_MODEL_GAMMA == 16
  assert gammas(method="model") == (5, 5)  # the default policy: confidence, up to 5
  assert gammas(method="lookup_model", policy="fixed") == (4, 4)  # no stopping rule
  assert gammas(method="lookup_model", gamma=5) == (5, 5)  # asked for
  assert gammas(method="model", policy="heuristic") == (4, 8)
  assert gammas(method="model", policy="heuristic", gamma=2, gamma_max=5) == (2, 5)
  assert gammas(method="model", gamma_max=6) == (6, 6)
  assert gammas(method="target") == (0, 0)


@pytest.mark.slow
def test_same_shapes_compile_once_and_run_all_rounds_in_one_dispatch(monkeypatch):
  bundle = tiny.pair(9)
  jspec.generate(bundle, [1, 2, 3], max_new_tokens=30, gamma=2)
  compiles = programs.PROGRAMS.compiles
  calls = []
  real_get = programs.PROGRAMS.get

  def counting_get(name, fn, args, static, **kwargs):
    program, secs = real_get(name, fn, args, static, **kwargs)
    def counted(*a):
      calls.append(name)
      return program(*a)
    counted.out_info = program.out_info  # a faithful stand-in for the compiled program
    return counted, secs
  monkeypatch.setattr(programs.PROGRAMS, "get", counting_get)
  # Another prompt length in the same bucket, another seed: no new compile.
  out = jspec.generate(bundle, [4, 5, 6, 7, 8], max_new_tokens=30, gamma=2, seed=3)
  assert programs.PROGRAMS.compiles == compiles
  assert out.stats["compile_s"] == 0.0
  assert out.stats["rounds"] > 5
  assert calls == ["prefill", "run"]  # many rounds, one dispatch of the loop


def test_decode_seconds_leave_out_the_wait_for_the_loops_compile(monkeypatch):
  # The loop compiles in the background while the prefill runs; a compile
  # that outlasts the prefill is compile time, not decode time (a bench
  # would otherwise read a new buffer width's first run as slow).
  bundle = tiny.pair(9)
  kw = dict(max_new_tokens=6, stop_at_eos=False, gamma=2)
  jspec.generate(bundle, [1, 2, 3], **kw)
  real_get = programs.Programs.get

  def slow_get(self, *args, **kwargs):
    import time
    time.sleep(2.0)
    return real_get(self, *args, **kwargs)

  monkeypatch.setattr(programs.Programs, "get_later", lambda self, *a, **k: programs.Pending(
      programs._COMPILER.submit(slow_get, self, *a, **k)))
  out = jspec.generate(bundle, [1, 2, 3], **kw)
  assert out.stats["decode_s"] < 1.0, out.stats
  pieces = jspec.stream(bundle, [1, 2, 3], **kw)
  try:
    while True:
      next(pieces)
  except StopIteration as done:
    stats = done.value
  assert stats["decode_s"] < 1.0 and stats["new_tokens"] == 6, stats


@pytest.mark.slow
def test_a_new_prompt_length_in_the_same_bucket_traces_nothing(monkeypatch):
  # With the program store off, every compile traces: chex counts the traces.
  monkeypatch.setenv("JSPEC_XLA_CACHE", "0")
  programs.release()
  for name, static in (("prefill", ("spec", "width")), ("run", ("spec",))):
    counted = chex.assert_max_traces(getattr(decode, name).__wrapped__, n=1)
    monkeypatch.setattr(decode, name, jax.jit(counted, static_argnames=static))
  bundle = tiny.pair(9)
  for length in (3, 7, 11):  # buckets 16 (prefill) and 16 (loop) for all three
    jspec.generate(bundle, tiny.prompt(length, length), max_new_tokens=10, gamma=2)
  with pytest.raises(AssertionError, match="traced > 1 times"):
    jspec.generate(bundle, tiny.prompt(1, 20), max_new_tokens=10, gamma=2)  # another bucket
  programs.release()


def _baked(bundle: jspec.Bundle, prompt: list[int], max_new: int, seed: int, **kwargs) -> list[int]:
  """The tokens of a generation whose settings are all compiled in as constants.

  `decode.prefill` without knobs takes them from the spec it is compiled
  for, as every setting was before temperature, top_p and min_confidence
  became data.
  """
  spec = spec_of(bundle, **{"policy": "fixed", **kwargs})
  width = decode.buffer_width(16, 16, spec.gamma_max)
  dparams = bundle.draft.params
  state = decode.prefill(bundle.target.params, dparams,
                         jnp.asarray([prompt + [0] * (16 - len(prompt))]), jnp.asarray([len(prompt)]),
                         jnp.asarray([max_new]), jnp.zeros((0,), jnp.int32), jax.random.key(seed),
                         spec=spec, width=width)
  state = decode.run(bundle.target.params, dparams, state, jnp.int32(1 << 30), spec=spec)
  return np.asarray(state.tokens[0, len(prompt):int(state.seq_len[0])]).tolist()


@pytest.mark.slow
@pytest.mark.parametrize("kind, settings", [
    ("temperature", [dict(temperature=0.7), dict(temperature=1.3)]),
    ("top_p", [dict(temperature=1.0, top_p=0.6), dict(temperature=0.8, top_p=0.9)]),
    ("min_confidence", [dict(policy="confidence", min_confidence=0.3),
                        dict(policy="confidence", min_confidence=0.8)]),
])
def test_temperature_top_p_and_min_confidence_are_data_not_new_programs(kind, settings):
  bundle = tiny.pair(13, scale=1.0, draft_int8=False)
  prompt = tiny.prompt(13, 6)
  got = []
  for i, kwargs in enumerate(settings):
    # One policy on both sides: which drafts a round makes can change which
    # valid sample a seed draws, so a comparison across policies is luck.
    kwargs = {"policy": "fixed", **kwargs}
    out = jspec.generate(bundle, prompt, max_new_tokens=16, seed=5, **kwargs)
    if i == 0:
      compiles = programs.PROGRAMS.compiles
    else:  # another value of the setting: the same programs
      assert programs.PROGRAMS.compiles == compiles
      assert out.stats["compile_s"] == 0.0
    # ... and the same tokens as a program with the value compiled in.
    assert out.token_ids == _baked(bundle, prompt, 16, 5, **kwargs)
    got.append(out)
  if kind == "min_confidence":  # the threshold reached the program: fewer drafts stop early
    assert got[0].stats["drafted"] > got[1].stats["drafted"]
  else:
    assert got[0].token_ids != got[1].token_ids


@pytest.mark.parametrize("chunk,per_row", [(8, False), (32, False), (8, True)])
def test_a_chunked_prefill_equals_one_forward_over_the_prompt(chunk, per_row):
  # Rows of 5, 32 and 17 tokens in a 32-wide buffer: with chunks of 8 the
  # rows end in different chunks (and padding is written past them).
  bundle = tiny.pair(15, draft_int8=False)
  m = bundle.target
  lengths = jnp.asarray([5, 32, 17])
  prompt = jnp.asarray([tiny.prompt(i, 32) for i in range(3)]) * (
      jnp.arange(32)[None] < lengths[:, None])
  fwd = lambda *a, **k: model.forward(m.arch, m.params, *a, **k)
  head = lambda x: model.logits(m.arch, m.params, x)
  logits, cache = decode.encode(fwd, cache_lib.init(m.cfg, 3, 40), prompt, lengths, chunk,
                                per_row=per_row, head=head)
  whole, fresh = fwd(prompt, cache_lib.init(m.cfg, 3, 40), (lengths - 1)[:, None])
  np.testing.assert_array_equal(cache.lengths, lengths)
  chex.assert_trees_all_close(logits, whole[:, 0], atol=1e-5)
  # The cache holds values up to about 10: chunks of other shapes sum in
  # another order (differences up to 1.05e-5 on the Zen 5 host), while a
  # chunk written at the wrong position differs by far more than 5e-5.
  for row, n in enumerate(lengths.tolist()):
    chex.assert_trees_all_close((cache.k[:, row, :n], cache.v[:, row, :n]),
                                (fresh.k[:, row, :n], fresh.v[:, row, :n]), atol=5e-5)


def _vocab_wide_in_loops(jaxpr, vocab, in_loop=False):
  """Equations inside while loops (at any depth) with an output [..., vocab] wide."""
  found = []
  for eqn in jaxpr.eqns:
    if in_loop and any(getattr(v.aval, "shape", ())[-1:] == (vocab,) for v in eqn.outvars):
      found.append(eqn.primitive.name)
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      found += _vocab_wide_in_loops(sub, vocab, in_loop or eqn.primitive.name == "while")
  return found


def test_a_prefill_reads_the_head_once_after_its_chunks():
  # The chunk loop carries hidden states; the head runs once, after it
  # (the draft's prefill, with no head, not at all). *Planted*: logits
  # computed in every chunk again.
  vocab = 53  # no other dimension of the tiny models
  bundle = tiny.pair(15, vocab=vocab)
  lengths = jnp.asarray([5, 30])
  prompt = jnp.asarray([tiny.prompt(i, 32, vocab) for i in range(2)])
  for m, head in ((bundle.target, True), (bundle.draft, False)):
    fwd = lambda *a, m=m, **k: model.forward(m.arch, m.params, *a, **k)
    logits_fn = (lambda x, m=m: model.logits(m.arch, m.params, x)) if head else None
    jaxpr = jax.make_jaxpr(lambda p, n, m=m, f=fwd, h=logits_fn: decode.encode(
        f, cache_lib.init(m.cfg, 2, 40), p, n, 8, head=h))(prompt, lengths)
    assert _vocab_wide_in_loops(jaxpr.jaxpr, vocab) == []
    assert (jaxpr.out_avals[0].shape == (2, vocab)) == head


def test_a_batch_prefilled_row_by_row_is_bit_for_bit_each_row_prefilled_alone():
  # A batch's row then computes exactly what a single request of that
  # prompt computes (the same chunks, the same shapes), and costs its own
  # length, not the longest row's.
  bundle = tiny.pair(15)
  m = bundle.target
  lengths = [5, 32, 17, 1]
  prompt = np.asarray([tiny.prompt(i, 32) for i in range(4)]) * (
      np.arange(32)[None] < np.asarray(lengths)[:, None])
  fwd = lambda *a, **k: model.forward(m.arch, m.params, *a, **k)
  head = lambda x: model.logits(m.arch, m.params, x)
  encode = jax.jit(decode.encode, static_argnums=(0, 4), static_argnames=("per_row", "head"))
  logits, cache = encode(fwd, cache_lib.init(m.cfg, 4, 40), prompt, np.asarray(lengths), 8,
                         per_row=True, head=head)
  np.testing.assert_array_equal(cache.lengths, lengths)
  for row, n in enumerate(lengths):
    one_logits, one = encode(fwd, cache_lib.init(m.cfg, 1, 40), prompt[row:row + 1],
                             np.asarray([n]), 8, head=head)
    np.testing.assert_array_equal(logits[row], one_logits[0])
    np.testing.assert_array_equal(cache.k[:, row, :n], one.k[:, 0, :n])
    np.testing.assert_array_equal(cache.v[:, row, :n], one.v[:, 0, :n])


def test_a_ready_request_compiles_nothing_on_the_way_to_its_tokens(caplog):
  # A new process pays for every small program the request path compiles
  # (a jnp.asarray, jax.random.key, indexing the state): there must be none
  # besides the two programs, which come from the caches.
  bundle = tiny.pair(9)
  first = list(jspec.stream(bundle, [1, 2, 3], max_new_tokens=8, gamma=2))
  jax.clear_caches()  # the small programs' caches; the two programs are kept by `programs`
  caplog.set_level("DEBUG")
  with jax.log_compiles(True):
    again = list(jspec.stream(bundle, [1, 2, 3], max_new_tokens=8, gamma=2, seed=5))
    jspec.generate(bundle, [4, 5], max_new_tokens=8, gamma=2, seed=2**32 - 1)
  compiled = [r.getMessage()[:80] for r in caplog.records if "Compiling" in r.getMessage()]
  assert compiled == []
  assert again == first  # greedy: the seed does not matter


@pytest.mark.slow
def test_every_prompt_length_in_a_buffer_width_shares_its_programs():
  bundle = tiny.pair(9)
  target = jspec.generate(bundle, tiny.prompt(3, 33), max_new_tokens=12, method="target")
  # Target-only has no drafts (G = 0): 17 + 12 + 2 tokens fit its width 32.
  target_17 = jspec.generate(bundle, tiny.prompt(4, 17), max_new_tokens=12, method="target")
  first = jspec.generate(bundle, tiny.prompt(3, 33), max_new_tokens=12, gamma=2)
  compiles = programs.PROGRAMS.compiles
  # Prompts of 40, 48 and 17 tokens: 17 and 33 had prompt buckets of their
  # own before, but prompt + 12 new + G + 2 fits the same width (64) for all.
  for length in (40, 48, 17):
    second = jspec.generate(bundle, tiny.prompt(4, length), max_new_tokens=12, gamma=2)
    assert programs.PROGRAMS.compiles == compiles and second.stats["compile_s"] == 0.0
  assert first.token_ids == target.token_ids
  assert second.token_ids == target_17.token_ids
  jspec.generate(bundle, tiny.prompt(4, 49), max_new_tokens=12, gamma=2)  # the next width
  assert programs.PROGRAMS.compiles == compiles + 2  # its prefill and its loop


@pytest.mark.slow
def test_stream_concatenates_to_generate_and_can_be_abandoned():
  bundle = tiny.pair(10)
  kw = dict(max_new_tokens=25, temperature=0.8, gamma=3, seed=2)
  full = jspec.generate(bundle, [3, 1, 4], **kw)
  pieces = list(jspec.stream(bundle, [3, 1, 4], rounds_per_dispatch=2, **kw))
  assert len(pieces) > 2
  assert sum((ids for _, ids in pieces), []) == full.token_ids
  abandoned = jspec.stream(bundle, [3, 1, 4], rounds_per_dispatch=1, **kw)
  next(abandoned)
  del abandoned
  assert jspec.generate(bundle, [3, 1, 4], **kw).token_ids == full.token_ids


@pytest.mark.slow
@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt=[]), "empty"),
    (dict(prompt=[[]]), "empty"),
    (dict(prompt="text"), "tokenizer"),
    (dict(prompt=[[1], 5]), "got int"),
    (dict(prompt=None), "None"),
    (dict(prompt=[[1]] * (options_lib.MAX_BATCH + 1)), "exceeds the maximum"),
    (dict(prompt=[1, tiny.VOCAB]), "outside the vocabulary"),
    (dict(prompt=[1, -1]), "outside the vocabulary"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=tiny.TARGET.max_position_embeddings), "context"),
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=1e-38), "temperature"),
    (dict(temperature=1e308), "temperature"),
    (dict(temperature="0.5"), "temperature"),
    (dict(seed=-1), "seed"),
    (dict(seed=2**64), "seed"),
    (dict(seed=1.5), "seed"),
    (dict(gamma=options_lib.MAX_GAMMA + 1), "gamma"),
    (dict(gamma_max=100000, policy="fixed"), "gamma_max"),
    (dict(method="prompt_lookup", ngram=100000), "ngram"),
    (dict(method="model", stop_at_eos=1), "stop_at_eos"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(gamma=0), "gamma"),
    (dict(gamma=3, gamma_max=2, policy="fixed"), "gamma"),
    (dict(method="prompt_lookup", ngram=0), "ngram"),
    (dict(method="bogus"), "method"),
    (dict(policy="bogus"), "policy"),
    (dict(min_confidence=1.5), "min_confidence"),
    (dict(min_confidence=float("nan")), "min_confidence"),
    (dict(min_confidence="high"), "min_confidence"),
])
def test_bad_input_is_a_clear_value_error(kwargs, message):
  bundle = tiny.pair(0)
  kwargs = {"prompt": [1, 2], **kwargs}
  before = programs.PROGRAMS.compiles
  with pytest.raises(ValueError, match=message):
    jspec.generate(bundle, kwargs.pop("prompt"), **kwargs)
  assert programs.PROGRAMS.compiles == before  # rejected before any compute


def test_unknown_options_are_a_type_error_and_stream_shares_the_checks():
  bundle = tiny.pair(0)
  with pytest.raises(TypeError, match="draft_vocab"):
    jspec.generate(bundle, [1, 2], draft_vocab=5)
  with pytest.raises(ValueError, match="temperature"):
    next(jspec.stream(bundle, [1, 2], temperature=-1.0))
  with pytest.raises(ValueError, match="a batch"):
    next(jspec.stream(bundle, [[1, 2], [3]]))


@pytest.mark.slow
def test_vocabulary_mismatch_is_refused_and_padding_is_masked():
  bundle = tiny.pair(0)
  big = tiny.pair(0, vocab=13)
  with pytest.raises(ValueError, match="vocabulary"):
    jspec.Bundle(bundle.target, big.draft)

  class Tok:  # 11 real tokens, the draft's table padded to 13 rows
    vocab_size = tiny.VOCAB
    eos_token_ids = ()

    def decode(self, ids):
      return " ".join(map(str, ids))
  padded = jspec.Bundle(bundle.target, big.draft, Tok())
  assert padded.vocab_limit == tiny.VOCAB
  out = jspec.generate(padded, [1, 2, 3], max_new_tokens=20, temperature=1.5, gamma=3)
  assert max(out.token_ids) < tiny.VOCAB


@pytest.mark.slow
def test_draft_catch_up_feeds_every_missing_token_in_chunks():
  """After prompt lookup rounds the draft lacks many tokens: it is fed them all, x_{n-1} last."""
  bundle = tiny.pair(12, draft_int8=False)
  cfg, params, arch = tiny.DRAFT, bundle.draft.params, bundle.draft.arch
  seq = tiny.prompt(12, 20)
  seq_len = jnp.asarray([20, 20, 17, 9])
  held = jnp.asarray([19, 18, 4, 1])  # lacking 1, 2, 13 and 8 tokens
  tokens = jnp.asarray([seq + [0] * 12] * 4)  # [4, 32]
  slots = 40
  _, dcache = model.forward(arch, params, tokens[:, :20], cache_lib.init(cfg, 4, slots))
  # What the draft held past `held` is stale: make it garbage.
  stale = jnp.arange(slots)[None, None, :, None, None] >= held[None, :, None, None, None]
  dcache = dcache.replace(k=jnp.where(stale, 9.0, dcache.k), v=jnp.where(stale, 9.0, dcache.v))
  widths = drafters.catch_up_widths(8, hybrid=True)
  assert widths == (1, 2, 9)
  assert drafters.catch_up_widths(16, hybrid=True) == (1, 2, 9, 17)
  assert drafters.catch_up_widths(4, hybrid=True) == (1, 2, 5)
  logits, dcache = drafters.catch_up(arch, params, dcache, tokens, seq_len, held, widths)
  for row in range(4):
    n = int(seq_len[row])
    fresh_logits, fresh = model.forward(arch, params, jnp.asarray([seq[:n]]),
                                        cache_lib.init(cfg, 1, slots))
    chex.assert_trees_all_close((logits[row], dcache.k[:, row, :n], dcache.v[:, row, :n]),
                                (fresh_logits[0, n - 1], fresh.k[:, 0, :n], fresh.v[:, 0, :n]),
                                atol=1e-5)
    assert int(dcache.lengths[row]) == n
