"""Speculative sampling is lossless: samples follow the target's exact distribution.

Each test draws tens of thousands of generations at once (one batch row per
sample, all rows in one compiled program) from a tiny target/draft pair with a
small vocabulary, computes the target's exact joint distribution of the first
new tokens by enumerating every prefix, and compares the two with a
chi-square test (cells with expected count < 5 pooled).

False-alarm rate: every comparison rejects at p < ALPHA = 1e-6; this file
makes fewer than 30 comparisons, so a correct sampler fails it with
probability below 3e-5 (and the seeds are fixed, so a run is reproducible).

Power, checked by planting each bug by hand once (see the commit that added
this file for the chi-square p-values seen):
  - residual p instead of norm(max(0, p - q));
  - drafting by argmax while the ratio uses the softmax q;
  - an off-by-one in the accepted count (n + 1 or n - 1);
  - temperature / top-k / top-p applied to the draft only, not the target;
  - a missing bonus token is caught in test_engine (draft == target must
    emit gamma + 1 tokens per round).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

import jspec
import tiny
from jspec import cache as cache_lib
from jspec import decode
from jspec import model
from jspec import sampling

ALPHA = 1e-6
N_ROWS = 24_000  # samples per prompt


def reference_probs(logits: np.ndarray, s: sampling.Sampling) -> np.ndarray:
  """An independent numpy version of temperature -> top-k -> top-p (as HF's warpers)."""
  logits = np.asarray(logits, np.float64)
  if s.greedy:
    return np.eye(logits.shape[-1])[np.argmax(logits, -1)]
  z = logits / s.temperature
  if s.top_k:
    kth = np.sort(z, axis=-1)[..., -s.top_k][..., None]
    z = np.where(z < kth, -np.inf, z)
  p = np.exp(z - z.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  if s.top_p < 1:
    order = np.argsort(-p, axis=-1, kind="stable")
    sorted_p = np.take_along_axis(p, order, -1)
    keep_sorted = (np.cumsum(sorted_p, -1) - sorted_p) < s.top_p
    keep = np.zeros_like(keep_sorted)
    np.put_along_axis(keep, order, keep_sorted, -1)
    p = np.where(keep, p, 0.0)
    p /= p.sum(-1, keepdims=True)
  return p


def exact_joint(bundle, prompt: list[int], k: int, s: sampling.Sampling) -> np.ndarray:
  """The target's exact distribution of the first k new tokens.

  Args:
    bundle: the pair (only the target is used).
    prompt: prompt token ids.
    k: number of new tokens.
    s: sampling settings.

  Returns:
    [V] * k array of joint probabilities.
  """
  cfg, params, arch = bundle.target.cfg, bundle.target.params, bundle.target.arch
  v = cfg.vocab_size
  prefixes = np.array(list(itertools.product(range(v), repeat=k - 1)), np.int32)
  prefixes = prefixes.reshape(len(prefixes), k - 1)  # [V^(k-1), k-1]
  seqs = np.concatenate([np.tile(prompt, (len(prefixes), 1)), prefixes], axis=1)
  cache = cache_lib.init(cfg, len(seqs), seqs.shape[1] + 1)
  logits, _ = jax.jit(lambda p, t, c: model.forward(arch, p, t, c))(params, jnp.asarray(seqs), cache)
  cond = reference_probs(np.asarray(logits)[:, len(prompt) - 1:], s)  # [V^(k-1), k, V]
  joint = np.ones([v] * k)
  for i in range(k):
    # cond[row, i] is p(t_{i+1} | prompt, prefix[row, :i]); rows vary over later tokens too.
    step = cond[:, i].reshape([v] * (k - 1) + [v])  # indexed by (t_1..t_{k-1}), t_{i+1}
    step = step[tuple([slice(None)] * i + [0] * (k - 1 - i))]  # drop the unused later tokens
    shape = [v] * (i + 1) + [1] * (k - 1 - i)
    joint = joint * step.reshape(shape)
  return joint


def chi_square_p(samples: np.ndarray, probs: np.ndarray) -> float:
  """p-value of the samples ([N, k] token ids) under the exact joint `probs`."""
  v, k = probs.shape[0], probs.ndim
  idx = np.ravel_multi_index(samples.T, [v] * k)
  observed = np.bincount(idx, minlength=probs.size).astype(np.float64)
  expected = probs.ravel() * len(samples)
  if np.any(observed[expected == 0] > 0):
    return 0.0  # a token the target can never produce
  small = expected < 5
  obs = np.append(observed[~small], observed[small].sum())
  exp = np.append(expected[~small], expected[small].sum())
  keep = exp > 0
  if keep.sum() == 1:  # one possible outcome (top-p kept one token): it must be every sample
    return 1.0 if obs[keep].sum() == len(samples) else 0.0
  return float(scipy.stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)


def draw(bundle, prompts: list[list[int]], spec: decode.Spec, n_new: int,
         seed: int) -> list[np.ndarray]:
  """Samples N_ROWS generations of each prompt, all prompts mixed in one batch.

  Returns:
    Per prompt, [N_ROWS, n_new] new token ids.
  """
  p_width = max(len(p) for p in prompts)
  rows = np.zeros((len(prompts) * N_ROWS, p_width), np.int32)
  lengths = np.zeros(len(rows), np.int32)
  for i, p in enumerate(prompts):
    rows[i::len(prompts), :len(p)] = p  # interleave so prompts share rounds
    lengths[i::len(prompts)] = len(p)
  width = decode.buffer_width(p_width, n_new, spec.gamma_max)
  dparams = bundle.draft.params if spec.method in decode.DRAFT_METHODS else None
  state = decode.prefill(bundle.target.params, dparams, jnp.asarray(rows), jnp.asarray(lengths),
                         jnp.full((len(rows),), n_new, jnp.int32), jnp.zeros((0,), jnp.int32),
                         jax.random.key(seed),
                         spec=spec, width=width)
  state = decode.run(bundle.target.params, dparams, state, jnp.int32(1 << 30), spec=spec)
  tokens = np.asarray(state.tokens)
  assert np.all(np.asarray(state.seq_len) == lengths + n_new)
  out = []
  for i, p in enumerate(prompts):
    out.append(tokens[i::len(prompts)][:, len(p):len(p) + n_new])
  return out


def assert_follows_target(bundle, prompt: list[int], got: np.ndarray, s: sampling.Sampling,
                          what: str = "") -> None:
  """Asserts samples of one prompt follow the target's exact joint, and each position its marginal.

  Args:
    bundle: the pair that drew them.
    prompt: the prompt's ids.
    got: [N, k] the new token ids drawn (`draw`).
    s: the sampling settings they were drawn with.
    what: a label for the failure messages.
  """
  k = got.shape[1]
  probs = exact_joint(bundle, prompt, k, s)
  p_value = chi_square_p(got, probs)
  assert p_value > ALPHA, f"{what} prompt {prompt}: chi-square p = {p_value:.2e}"
  # Each single position too, where a bug at one position stands out.
  for i in range(k):
    marginal = probs.sum(axis=tuple(j for j in range(k) if j != i))
    p_i = chi_square_p(got[:, i:i + 1], marginal)
    assert p_i > ALPHA, f"{what} prompt {prompt}, token {i + 1}: p = {p_i:.2e}"


PROMPTS = [[3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8, 1, 8]]

CASES = {
    "t1.0-g3": dict(temperature=1.0, gamma=3),
    "t0.7-topk4-g2": dict(temperature=0.7, top_k=4, gamma=2),
    "t1.3-topp0.8-heuristic": dict(temperature=1.3, top_p=0.8, gamma=2, gamma_max=4,
                                   policy="heuristic"),
    "t1.0-confidence": dict(temperature=1.0, gamma=4, policy="confidence", min_confidence=0.4),
    # Up to 2-grams: rows draft 4 after a 2-gram match, 2 after a 1-gram one.
    "lookup-t1.0": dict(temperature=1.0, gamma=4, method="prompt_lookup", ngram=2),
    # The second prompt's last 2-gram occurred before (lookup drafts), the
    # first's did not (the draft model drafts): both kinds of q in one batch.
    "lookup_model-t1.0": dict(temperature=1.0, gamma=3, method="lookup_model", ngram=2),
    # The int8 draft (the CPU default): q is its own distribution, so the
    # output is still the target's.
    "t1.0-g3-int8": dict(temperature=1.0, gamma=3, draft_int8=True),
    "t0.8-confidence-int8": dict(temperature=0.8, gamma=4, policy="confidence",
                                 min_confidence=0.4, draft_int8=True),
}


def _spec(bundle, **options) -> decode.Spec:
  options.setdefault("policy", "fixed")
  return jspec.Options(**options).spec(bundle.target.arch, bundle.draft.arch, bundle.vocab_limit)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_first_three_tokens_follow_target(name):
  case = dict(CASES[name])
  bundle = tiny.pair(seed=3, scale=0.6, draft_int8=case.pop("draft_int8", False))
  spec = _spec(bundle, **case)
  samples = draw(bundle, PROMPTS, spec, 3, seed=11)
  for prompt, got in zip(PROMPTS, samples):
    assert_follows_target(bundle, prompt, got, spec.sampling, f"{name},")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["model", "lookup_model"])
def test_later_rounds_follow_target(method):
  """Tokens 4-6 come from the second and later rounds, after rollbacks.

  With "lookup_model" and 1-grams over 5 ids, rounds switch between lookup
  and the draft model, which then catches up on what lookup emitted.
  """
  v = 5
  bundle = tiny.pair(seed=5, scale=0.6, vocab=v, draft_int8=False)
  spec = _spec(bundle, temperature=1.0, method=method, gamma=2, ngram=1)
  prompts = [[1, 2, 3], [4, 0, 4, 0, 1]]
  samples = draw(bundle, prompts, spec, 6, seed=12)
  for prompt, got in zip(prompts, samples):
    probs = exact_joint(bundle, prompt, 6, spec.sampling)
    tail = probs.sum(axis=(0, 1, 2))  # joint of tokens 4, 5, 6
    p_value = chi_square_p(got[:, 3:], tail)
    assert p_value > ALPHA, f"prompt {prompt}: tokens 4-6 chi-square p = {p_value:.2e}"


@pytest.mark.slow
def test_chi_square_rejects_a_wrong_distribution():
  """The statistic itself has power: samples from q are rejected as samples of p."""
  bundle = tiny.pair(seed=3, scale=0.6)
  samp = sampling.Sampling(1.0)
  p = exact_joint(bundle, PROMPTS[0], 1, samp)
  q = np.roll(p, 1) * 0.2 + p * 0.8  # 20% of the mass moved
  rng = np.random.default_rng(0)
  samples = rng.choice(len(q), size=(N_ROWS, 1), p=q / q.sum())
  assert chi_square_p(samples, p) < ALPHA
  assert chi_square_p(rng.choice(len(p), size=(N_ROWS, 1), p=p), p) > ALPHA
