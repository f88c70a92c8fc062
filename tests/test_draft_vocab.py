"""A frequency-ranked draft vocabulary (`jspec.Settings(draft_vocab=K)`) keeps the output the target's.

The draft's head keeps K rows; its logits elsewhere are -inf, so q is zero
outside the subset. The rankings here are permutations, not the ids in
order, so a subset index taken for a token id (ids[argmax] forgotten) is a
different token and fails. Planted by hand, each failing here:
  - the subset's logits put at ids 0..K-1 instead of at their ids;
  - the fill outside the subset 0.0 instead of -inf (q nonzero outside it);
  - q reported nonzero outside the subset while drafts are drawn inside it
    (the chi-square test).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
import test_lossless
import tiny
from jspec import bundle as bundle_lib
from jspec import cache as cache_lib
from jspec import draft_vocab
from jspec import drafters
from jspec import model
from jspec import sampling

RANKING = [7, 2, 9, 4, 0, 10, 1, 3, 5, 6, 8]  # the tiny vocabulary, "most frequent" first
K = 5


def _close_pair(vocab: int = tiny.VOCAB, **settings) -> jspec.Bundle:
  """A target and a draft of its own shape, the draft the target plus noise: most drafts agree."""
  t_cfg, _ = tiny.configs(vocab)
  params = model.init_params(t_cfg, jax.random.key(3), scale=0.6)
  noise = model.init_params(t_cfg, jax.random.key(4), scale=0.05)
  draft = jax.tree.map(lambda a, b: a + b if a.dtype == jnp.float32 else a, params, noise)
  return bundle_lib.make((t_cfg, params), (t_cfg, draft), settings=jspec.Settings(**settings),
                         ranking=RANKING[:vocab] if vocab == tiny.VOCAB else None)


def _draft_logits(bundle: jspec.Bundle, params=None) -> np.ndarray:
  """The draft's logits [2, 7, V] on two tiny prompts (its own params, or `params`)."""
  tokens = jnp.asarray([tiny.prompt(5, 7), tiny.prompt(6, 7)], jnp.int32)
  cache = cache_lib.init(bundle.draft.cfg, 2, 8)
  step = jax.jit(lambda p, t, c: model.forward(bundle.draft.arch, p, t, c)[0])
  return np.asarray(step(bundle.draft.params if params is None else params, tokens, cache))


@pytest.mark.parametrize("bad", [-1, 2.5, "8", True, [4]])
def test_bad_setting_is_one_line(bad):
  with pytest.raises(ValueError) as err:
    jspec.Settings(draft_vocab=bad)
  assert "\n" not in str(err.value) and "draft_vocab" in str(err.value)
  assert "expected" in str(err.value)


def test_zero_means_the_full_vocabulary():
  assert jspec.Settings() == jspec.Settings(draft_vocab=None) != jspec.Settings(draft_vocab=0)
  bundle = tiny.pair(seed=1, draft_vocab=0)
  assert bundle.draft.params["vocab_head"] is None


def test_the_default_cuts_only_a_ranked_vocabulary_larger_than_it():
  big = draft_vocab.DEFAULT + 1000
  assert draft_vocab.resolve(None, big, ranked=True) == draft_vocab.DEFAULT
  assert draft_vocab.resolve(None, big, ranked=False) is None  # ids in plain order: the full head
  assert draft_vocab.resolve(None, draft_vocab.DEFAULT, ranked=True) is None
  assert draft_vocab.resolve(0, big, ranked=True) is None
  assert draft_vocab.resolve(7, big, ranked=False) == 7
  with pytest.raises(ValueError, match="at most the draft's vocabulary of 10"):
    draft_vocab.resolve(11, 10, ranked=True)
  # The tiny pair's vocabulary is below the default: its draft keeps its whole head.
  assert tiny.pair(seed=1).draft.params["vocab_head"] is None


def test_the_default_cuts_a_large_ranked_draft(monkeypatch):
  # A default K just under the tiny vocabulary stands in for 65536 under 151936.
  monkeypatch.setattr(draft_vocab, "DEFAULT", K)
  bundle = _close_pair()
  assert bundle.draft.params["vocab_ids"].tolist() == draft_vocab.subset(K, tiny.VOCAB, RANKING).tolist()
  t_cfg, _ = tiny.configs(tiny.VOCAB)
  params = model.init_params(t_cfg, jax.random.key(3))
  unranked = bundle_lib.make((t_cfg, params), (t_cfg, params))  # no tokenizer, no ranking
  assert unranked.draft.params["vocab_head"] is None


def test_past_the_vocabulary_is_one_line():
  with pytest.raises(ValueError) as err:
    tiny.pair(seed=1, draft_vocab=tiny.VOCAB + 1)
  assert "\n" not in str(err.value) and f"at most the draft's vocabulary of {tiny.VOCAB}" in str(
      err.value)


def test_subset_keeps_the_ranking_and_the_special_ids():
  assert draft_vocab.subset(3, 11, RANKING).tolist() == [2, 7, 9]
  assert draft_vocab.subset(3, 11, RANKING, always=[5]).tolist() == [2, 5, 7, 9]
  assert draft_vocab.subset(3, 11, None).tolist() == [0, 1, 2]  # no ranking: the first ids
  assert draft_vocab.subset(3, 11, [7, 7, 12, 2]).tolist() == [0, 2, 7]  # unranked: by id
  assert draft_vocab.subset(3, 64, RANKING, multiple=32).tolist()[:4] == [0, 1, 2, 3]
  assert len(draft_vocab.subset(3, 64, RANKING, multiple=32)) == 32
  assert draft_vocab.subset(11, 11, RANKING).tolist() == list(range(11))
  counts = np.array([3, 9, 9, 0, 1])
  assert draft_vocab.order_by_count(counts).tolist() == [1, 2, 0, 4, 3]  # ties by id


def test_eos_is_kept():
  t_cfg, d_cfg = tiny.configs()
  d_cfg = d_cfg.__class__(**{**d_cfg.to_dict(), "eos_token_ids": (8,)})
  bundle = bundle_lib.make((t_cfg, model.init_params(t_cfg, jax.random.key(0))),
                           (d_cfg, model.init_params(d_cfg, jax.random.key(1))),
                           settings=jspec.Settings(draft_vocab=K), ranking=RANKING)
  assert np.asarray(bundle.draft.params["vocab_ids"]).tolist() == [0, 2, 4, 7, 8, 9]


@pytest.mark.parametrize("settings", [dict(draft_int8=True), dict(kernels=False, draft_int8=False)],
                         ids=["int8", "float"])
def test_logits_are_the_full_heads_at_the_subset_and_minus_inf_elsewhere(settings):
  full = _close_pair(**settings)
  cut = _close_pair(draft_vocab=K, **settings)
  ids = np.asarray(cut.draft.params["vocab_ids"])
  assert ids.tolist() == sorted(RANKING[:K])
  want, got = _draft_logits(full), _draft_logits(cut)
  np.testing.assert_array_equal(got[..., ids], want[..., ids])
  outside = np.setdiff1d(np.arange(tiny.VOCAB), ids)
  assert np.all(got[..., outside] == -np.inf)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_draft_never_proposes_outside_the_subset(temperature):
  bundle = _close_pair(draft_vocab=K, draft_int8=True)
  ids = set(np.asarray(bundle.draft.params["vocab_ids"]).tolist())
  rows, g = 256, 4
  tokens = jnp.asarray(np.random.RandomState(0).randint(0, tiny.VOCAB, (rows, 8)), jnp.int32)
  seq_len = jnp.full((rows,), 6, jnp.int32)
  s = sampling.Sampling(temperature)
  dcache = cache_lib.init(bundle.draft.cfg, rows, 16)
  run = jax.jit(lambda p, c, key: drafters.draft_model(
      bundle.draft.arch, p, c, tokens, seq_len, jnp.full((rows,), g, jnp.int32), key, s, g,
      tiny.VOCAB, draft_len=jnp.zeros((rows,), jnp.int32))[:2])
  drafts, q = run(bundle.draft.params, dcache, jax.random.key(7))
  drafts, q = np.asarray(drafts), np.asarray(q)
  assert set(drafts.ravel().tolist()) <= ids
  outside = sorted(set(range(tiny.VOCAB)) - ids)
  assert np.all(q[..., outside] == 0.0)
  np.testing.assert_allclose(q.sum(-1), 1.0, rtol=1e-5)
  if temperature:  # sampling reaches more than one id of the subset
    assert len(set(drafts.ravel().tolist())) > 1


CASES = {
    "model-confidence": dict(method="model"),
    "model-fixed4": dict(method="model", policy="fixed", gamma=4),
    "model-heuristic": dict(method="model", policy="heuristic"),
    "lookup_model": dict(method="lookup_model", gamma=4, ngram=2),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if "model-" in n
                                               and n != "model-confidence" else [])
                                  for n in CASES])
def test_greedy_output_is_target_only(name):
  full = _close_pair(draft_int8=True)
  cut = _close_pair(draft_vocab=K, draft_int8=True)
  prompts = [tiny.prompt(s, n) for s, n in ((1, 6), (2, 9), (3, 4))]
  want = [r.token_ids for r in jspec.generate(full, prompts, max_new_tokens=16, method="target")]
  got = jspec.generate(cut, prompts, max_new_tokens=16, **CASES[name])
  assert [r.token_ids for r in got] == want
  assert sum(r.stats["drafted"] for r in got) > 0


def test_greedy_acceptance_is_full_where_the_target_stays_inside():
  """Draft = target, cut to a subset holding everything the target emits: every draft is accepted.

  A subset index taken for a token id would propose the wrong token here
  and be rejected.
  """
  t_cfg, _ = tiny.configs()
  params = model.init_params(t_cfg, jax.random.key(3), scale=0.6)
  full = bundle_lib.make((t_cfg, params), (t_cfg, params), settings=jspec.Settings(
      kernels=False, draft_int8=False))
  prompt = tiny.prompt(1, 6)
  want = jspec.generate(full, prompt, max_new_tokens=12, method="target").token_ids
  emitted = sorted(set(want))
  ranking = emitted[::-1] + [i for i in range(tiny.VOCAB) if i not in emitted]
  cut = bundle_lib.make((t_cfg, params), (t_cfg, params), settings=jspec.Settings(
      kernels=False, draft_int8=False, draft_vocab=len(emitted)), ranking=ranking)
  assert np.asarray(cut.draft.params["vocab_ids"]).tolist() == emitted
  got = jspec.generate(cut, prompt, max_new_tokens=12, policy="fixed", gamma=3)
  assert got.token_ids == want
  assert got.stats["acceptance_rate"] == 1.0


def test_sampling_follows_the_target_with_a_restricted_draft():
  """The chi-square test of `test_lossless`, one case: the draft cut to 5 of 11 ids."""
  bundle = _close_pair(draft_vocab=K, draft_int8=True)
  spec = jspec.Options(temperature=1.0, gamma=3, policy="fixed").spec(
      bundle.target.arch, bundle.draft.arch, bundle.vocab_limit)
  prompt = test_lossless.PROMPTS[0]
  got, = test_lossless.draw(bundle, [prompt], spec, 2, seed=11)
  test_lossless.assert_follows_target(bundle, prompt, got, spec.sampling, "restricted draft,")


def test_ranking_is_counted_once_and_cached(tmp_path, monkeypatch):
  tokenizers = pytest.importorskip("tokenizers")
  from jspec import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel
  vocab = {"a": 0, "b": 1, "c": 2, "d": 3, "<eos>": 4}
  backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="a"))
  backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  backend.add_special_tokens([tokenizers.AddedToken("<eos>", special=True)])
  tok = tokenizer_lib.Tokenizer(backend, [4])
  calls = []
  monkeypatch.setattr(draft_vocab, "corpus", lambda: calls.append(1) or ["c c b d c", "b"])
  first = draft_vocab.ranking(tok, cache=tmp_path)
  assert first.tolist() == [2, 1, 3, 0, 4]  # c x3, b x2, d x1, then a and <eos> by id
  again = draft_vocab.ranking(tok, cache=tmp_path)
  assert again.tolist() == first.tolist() and len(calls) == 1
  saved, = tmp_path.glob("draft_vocab/*.ranking.json")
  assert json.loads(saved.read_text())["tokenizer_sha256"] == draft_vocab.tokenizer_digest(tok)
  assert draft_vocab.special_ids(tok) == [4]
  assert not list(tmp_path.glob("draft_vocab/.*"))  # no temporary left behind


def test_a_tokenizer_still_being_read_is_waited_for_only_to_cut_the_head(monkeypatch):
  import concurrent.futures

  class Tok:
    eos_token_ids = [tiny.VOCAB - 1]
    backend = None

  class Unread(concurrent.futures.Future):
    def result(self, timeout=None):
      raise AssertionError("waited for a tokenizer the full head does not need")

  seen = []
  monkeypatch.setattr(draft_vocab, "ranking", lambda tok, cache=None: seen.append(tok) or RANKING)
  t_cfg, _ = tiny.configs(tiny.VOCAB)
  params = model.init_params(t_cfg, jax.random.key(3))
  full = bundle_lib.prepare(t_cfg, params, "draft", jspec.Settings(draft_vocab=0), tokenizer=Unread())
  assert full.params["vocab_head"] is None and not seen
  ready = concurrent.futures.Future()
  ready.set_result(Tok())
  cut = bundle_lib.prepare(t_cfg, params, "draft", jspec.Settings(draft_vocab=K), tokenizer=ready)
  assert len(seen) == 1 and isinstance(seen[0], Tok)
  assert cut.params["vocab_ids"].tolist() == draft_vocab.subset(K, tiny.VOCAB, RANKING,
                                                                Tok.eos_token_ids).tolist()


def test_with_prompt_ids_takes_the_prompts_ids_outside_the_subset_in_order():
  params = {"vocab_ids": np.asarray([0, 2, 4]), "vocab_extra": np.full((3,), 11, np.int32), "x": 1}
  got = draft_vocab.with_prompt_ids(params, 11, [[5, 2, 9, 5, 30, -1], [0, 1, 7]])
  assert got["vocab_extra"].tolist() == [5, 9, 1]  # first seen, distinct, capped at 3; 7 left out
  assert got["x"] == 1 and params["vocab_extra"].tolist() == [11, 11, 11]  # not edited in place
  assert draft_vocab.with_prompt_ids(params, 11, [[2, 4]])["vocab_extra"].tolist() == [11] * 3
  whole = {"vocab_ids": None, "vocab_extra": None}
  assert draft_vocab.with_prompt_ids(whole, 11, [[5]]) is whole


@pytest.mark.parametrize("settings", [dict(draft_int8=True), dict(kernels=False, draft_int8=False)],
                         ids=["int8", "float"])
def test_prompt_ids_outside_the_subset_are_scored_from_the_whole_head(settings):
  full = _close_pair(**settings)
  cut = _close_pair(draft_vocab=K, **settings)
  ids = np.asarray(cut.draft.params["vocab_ids"])
  extra = [i for i in range(tiny.VOCAB) if i not in ids][:2]
  params = draft_vocab.with_prompt_ids(cut.draft.params, tiny.VOCAB, [extra])
  want, got = _draft_logits(full), _draft_logits(cut, params)
  np.testing.assert_array_equal(got[..., ids], want[..., ids])
  # The rows are the whole head's; the int8 head's products run on activations
  # quantized to int8, the extra rows' in float.
  np.testing.assert_allclose(got[..., extra], want[..., extra], rtol=0.05, atol=0.05)
  outside = np.setdiff1d(np.arange(tiny.VOCAB), np.concatenate([ids, extra]))
  assert np.all(got[..., outside] == -np.inf)


def test_a_prompt_id_the_subset_lacks_is_still_proposed():
  """Draft = target, cut to what the target emits but one id that the prompt holds: all accepted."""
  t_cfg, _ = tiny.configs()
  params = model.init_params(t_cfg, jax.random.key(3), scale=0.6)
  full = bundle_lib.make((t_cfg, params), (t_cfg, params), settings=jspec.Settings(
      kernels=False, draft_int8=False))
  for seed in range(40):
    prompt = tiny.prompt(seed, 8)
    want = jspec.generate(full, prompt, max_new_tokens=12, method="target").token_ids
    shared = sorted(set(want) & set(prompt))
    if shared and len(set(want)) > 1:
      break
  else:
    pytest.fail("no tiny prompt whose continuation repeats one of its ids")
  kept = [i for i in sorted(set(want)) if i != shared[0]]
  ranking = kept + [i for i in range(tiny.VOCAB) if i not in kept]
  cut = bundle_lib.make((t_cfg, params), (t_cfg, params), settings=jspec.Settings(
      kernels=False, draft_int8=False, draft_vocab=len(kept)), ranking=ranking)
  assert shared[0] not in np.asarray(cut.draft.params["vocab_ids"]).tolist()
  got = jspec.generate(cut, prompt, max_new_tokens=12, policy="fixed", gamma=3)
  assert got.token_ids == want
  assert got.stats["acceptance_rate"] == 1.0


def test_the_prompt_ids_tool_compares_the_same_draft_without_them():
  from bench.tools import prompt_ids
  cut = _close_pair(draft_vocab=K, draft_int8=True)
  alone = prompt_ids.without_prompt_ids(cut)
  assert alone.draft.params["vocab_extra"] is None and cut.draft.params["vocab_extra"] is not None
  assert alone.draft.params["vocab_head"] is cut.draft.params["vocab_head"]
  prompt = [i for i in range(tiny.VOCAB) if i not in cut.draft.params["vocab_ids"].tolist()][:3]
  want = jspec.generate(cut, prompt, max_new_tokens=8, method="target").token_ids
  assert jspec.generate(alone, prompt, max_new_tokens=8).token_ids == want
  with pytest.raises(ValueError, match="the draft's head is whole"):
    prompt_ids.without_prompt_ids(_close_pair(draft_int8=True))
