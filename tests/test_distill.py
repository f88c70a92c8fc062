"""Draft distillation on tiny models: it lowers the divergence, stays lossless, and resumes exactly.

What each test would catch (planted by hand when written; see the report of
issue 35):
  - a loss with the wrong sign: the held-out TVD rises (test_steps_lower_heldout_tvd);
  - a resume that restores the trained params but not the optimizer state
    (Adam's moments and step count): the resumed run's params differ
    (test_resume_is_bit_for_bit);
  - labels one position off: they are no longer the target's argmax
    (test_labels_are_the_targets_argmax);
  - LoRA merged without its alpha / R scale: the saved draft's logits are not
    the trained ones (test_saved_draft_is_the_trained_draft).
"""

from __future__ import annotations

import importlib
import json
import pathlib
import shutil

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors

import jspec
import test_lossless
import tiny
from bench import prompts as bench_prompts
from convert import store
from jspec import bundle as bundle_lib
from jspec import cache as cache_lib
from jspec import distill_data
from jspec import model

distill = importlib.import_module("jspec.distill")  # `jspec.distill` is the function

# Small and quick: 11 tokens, 8 generated per prompt, prompts of 4-7 tokens; the
# target's continuations made by target-only decoding of all prompts at once (one
# call; speculative decoding of one prompt at a time, the default, gives the same
# tokens and is run by test_command_line_distills).
QUICK = dict(gen_tokens=8, max_context=8, batch_size=4, learning_rate=1e-2, warmup_steps=2,
             eval_fraction=0.25, checkpoint_every=3, gen_batch=16, target_batch=32,
             label_batch=8)


def _pair(**settings):
  """The tiny pair, its draft in float (distillation trains float weights)."""
  return tiny.pair(seed=3, scale=0.6, draft_int8=False, **settings)


def _prompts(n=32, seed=0):
  """n token-id prompts of 4 to 7 tokens."""
  return [tiny.prompt(seed + i, 4 + i % 4) for i in range(n)]


def _tensors(path):
  """A safetensors file's tensors by name."""
  with safetensors.safe_open(str(path), framework="numpy") as f:
    return {k: f.get_tensor(k) for k in f.keys()}


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
  """One distilled tiny draft (LoRA, TVD, target data), shared by the tests that only read it."""
  out = tmp_path_factory.mktemp("distilled") / "draft.jspec.safetensors"
  bundle = _pair()
  report = distill.distill(bundle, _prompts(), out, steps=24, progress=False, **QUICK)
  return bundle, report


def test_default_recipe_lowers_heldout_tvd(distilled):
  """LoRA, TVD, the target's greedy output: a few steps lower the held-out TVD."""
  _, report = distilled
  before, after = report.evals[0], report.evals[-1]
  assert after["step"] == 24
  assert after["tvd"] < before["tvd"] - 0.02, (before, after)
  assert after["agree"] >= before["agree"]
  assert [c["step"] for c in report.curve] == list(range(1, 25))  # the curve, per step


@pytest.mark.slow
@pytest.mark.parametrize("train,loss,data,temperature,lr", [("last", "fkl", "mixed", 0.0, 1e-2),
                                                            ("full", "jsd", "draft", 1.0, 3e-2)])
def test_other_recipes_lower_heldout_tvd(tmp_path, train, loss, data, temperature, lr):
  """The last layers or all params, the other divergences, the draft's samples, soft labels."""
  bundle = _pair()
  out = tmp_path / "d.jspec.safetensors"
  report = distill.distill(bundle, _prompts(), out, train=train, loss=loss, data=data,
                           temperature=temperature, top_k=4, steps=24, progress=False,
                           **{**QUICK, "learning_rate": lr})
  before, after = report.evals[0], report.evals[-1]
  assert after["tvd"] < before["tvd"] - 0.02, (before, after)
  saved = distill.Data.load(out.with_name(out.name + ".work") / "data.safetensors")
  assert set(saved.sources.tolist()) == ({0, 1} if data == "mixed" else {0})
  if temperature:  # soft labels: the target's top 4 at the temperature, sorted
    assert saved.label_ids.shape[-1] == 4
    p = np.exp(saved.label_logp)[saved.mask]
    assert np.all(p.sum(-1) <= 1 + 1e-5) and np.all(np.diff(p, axis=-1) <= 1e-6)


def test_labels_are_the_targets_argmax(distilled):
  """Free labels (the target's own greedy tokens) equal the target's argmax from its forward."""
  bundle, report = distilled
  data = distill.Data.load(report.path.with_name(report.path.name + ".work") / "data.safetensors")
  assert (data.sources == 1).all()
  ids, _ = distill._target_labels(bundle.target.arch, bundle.target.params,  # pylint: disable=protected-access
                                  jnp.asarray(data.tokens), jnp.asarray(data.at), k=1,
                                  temperature=0.0, vocab_limit=None)
  ids = np.asarray(ids)[..., 0]
  np.testing.assert_array_equal(np.where(data.mask, ids, 0), data.label_ids[..., 0])
  # And the target's greedy output really is what generate returns.
  first = int(np.flatnonzero(data.mask[0])[0])
  prompt = data.tokens[0, :data.at[0, first] + 1].tolist()
  out = jspec.generate(bundle, prompt, method="target", max_new_tokens=int(data.mask[0].sum()))
  assert out.token_ids == data.tokens[0, len(prompt):len(prompt) + len(out.token_ids)].tolist()


def test_saved_draft_is_the_trained_draft(tmp_path, distilled):
  """The file's draft (adapters merged) computes the trained draft's logits, and loads as a draft."""
  bundle, report = distilled
  cfg, tensors = store.load(report.path)
  assert cfg == bundle.draft.cfg
  assert all(t.dtype == np.float32 for t in tensors.values())
  # The file is what `store.save` writes, plus the distillation record.
  plain = store.save(tmp_path / "plain.jspec.safetensors", cfg, tensors)
  with safetensors.safe_open(str(report.path), framework="numpy") as f:
    meta = dict(f.metadata())
  with safetensors.safe_open(str(plain), framework="numpy") as f:
    assert {k: v for k, v in meta.items() if k != distill_data.METADATA_KEY} == f.metadata()
  params = model.params_from_tensors(cfg, tensors)
  tokens = jnp.asarray([tiny.prompt(99, 9)], jnp.int32)
  logits, _ = model.forward(model.Arch(cfg), params, tokens, cache_lib.init(cfg, 1, 9), fresh=True)
  base, _ = model.forward(model.Arch(cfg), distill.float_params(bundle.draft), tokens,
                          cache_lib.init(cfg, 1, 9), fresh=True)
  assert float(jnp.max(jnp.abs(logits - base))) > 1e-3  # training changed it
  # Rebuild the adapters from the checkpoint and run the training forward.
  recipe = distill.make_recipe(steps=24, **QUICK)
  template = distill.init_trainable(cfg, distill.float_params(bundle.draft), recipe)
  tx = distill.optimizer(recipe, 24)
  work = report.path.with_name(report.path.name + ".work")
  _, trainable, _, _ = _load_any(work, template, tx)
  at = jnp.arange(9, dtype=jnp.int32)[None]
  trained = distill.draft_logits(cfg, distill.float_params(bundle.draft), trainable, recipe,
                                 tokens, at)
  np.testing.assert_allclose(np.asarray(trained), np.asarray(logits), atol=2e-5)


def _load_any(work, template, tx):
  """A checkpoint's state whatever run made it (the test reads it, it does not resume)."""
  path = work / "checkpoint.safetensors"
  with safetensors.safe_open(str(path), framework="numpy") as f:
    meta = json.loads(f.metadata()["meta"])
  return distill.load_checkpoint(path, template, tx.init(template), meta)


def test_distilled_draft_greedy_equals_target(tmp_path, distilled):
  """Loaded by `jspec.load` from files (int8, as on CPU by default), greedy output is the target's."""
  bundle, report = distilled
  target_path = store.save(tmp_path / "target.jspec.safetensors", bundle.target.cfg,
                           distill.draft_tensors(distill.float_params(bundle.target)))
  pair = jspec.load(str(target_path), draft=str(report.path), progress=False)
  assert distill_data.read_record(report.path)["steps"] == 24
  for seed in range(3):
    prompt = tiny.prompt(200 + seed, 5 + seed)
    spec = jspec.generate(pair, prompt, max_new_tokens=20, gamma=4, policy="fixed")
    alone = jspec.generate(pair, prompt, max_new_tokens=20, method="target")
    assert spec.token_ids == alone.token_ids
    assert spec.stats["accepted"] > 0


@pytest.mark.slow
def test_distilled_draft_sampling_follows_target(distilled):
  """Sampling with the distilled draft still follows the target's exact distribution (chi-square)."""
  bundle, report = distilled
  cfg, tensors = store.load(report.path)
  tuned = bundle_lib.make((bundle.target.cfg, distill.float_params(bundle.target)),
                          (cfg, model.params_from_tensors(cfg, tensors)),
                          settings=jspec.Settings(draft_int8=False))
  spec = test_lossless._spec(tuned, temperature=1.0, gamma=3)  # pylint: disable=protected-access
  prompt = test_lossless.PROMPTS[0]
  (got,) = test_lossless.draw(tuned, [prompt], spec, 3, seed=21)
  probs = test_lossless.exact_joint(tuned, prompt, 3, spec.sampling)
  p_value = test_lossless.chi_square_p(got, probs)
  assert p_value > test_lossless.ALPHA, f"chi-square p = {p_value:.2e}"


def test_resume_is_bit_for_bit(tmp_path, distilled):
  """Stopped at step 5 and resumed, a run ends with exactly the uninterrupted run's draft."""
  bundle, report = distilled
  prompts = _prompts()
  data = report.path.with_name(report.path.name + ".work") / "data.safetensors"
  for name in ("a", "b"):  # the same data (same prompts, models and data recipe): reused
    (tmp_path / f"{name}.jspec.safetensors.work").mkdir()
    shutil.copy(data, tmp_path / f"{name}.jspec.safetensors.work" / "data.safetensors")
  whole = distill.distill(bundle, prompts, tmp_path / "a.jspec.safetensors", steps=10,
                          progress=False, **QUICK)
  part = distill.distill(bundle, prompts, tmp_path / "b.jspec.safetensors", steps=10,
                         max_steps=5, progress=False, **QUICK)
  assert part.stopped_early and part.steps == 5
  rest = distill.distill(bundle, prompts, tmp_path / "b.jspec.safetensors", steps=10,
                         progress=False, **QUICK)
  assert rest.resumed_from == 5 and rest.steps == 10 and not rest.stopped_early
  assert [c["step"] for c in rest.curve] == list(range(1, 11))
  a, b = _tensors(whole.path), _tensors(rest.path)
  assert a.keys() == b.keys()
  for name in a:
    np.testing.assert_array_equal(a[name], b[name], err_msg=name)
  # Another recipe in the same work directory is refused, in one line.
  with pytest.raises(distill.DistillError, match="another run") as err:
    distill.distill(bundle, prompts, tmp_path / "b.jspec.safetensors", steps=10,
                    progress=False, **{**QUICK, "learning_rate": 2e-2})
  assert "\n" not in str(err.value)


def test_step_checks_shapes_and_compiles_once():
  """The jitted step compiles once for one batch shape, and chex refuses mismatched labels or mask."""
  bundle = _pair()
  cfg = bundle.draft.cfg
  params = distill.float_params(bundle.draft)
  recipe = distill.make_recipe(**QUICK)
  tx = distill.optimizer(recipe, 10)
  step = distill.make_step(cfg, recipe, tx)
  b, t, g = 2, 12, 5
  batch = {"tokens": jnp.ones((b, t), jnp.int32), "at": jnp.zeros((b, g), jnp.int32),
           "mask": jnp.ones((b, g), bool), "label_ids": jnp.zeros((b, g, 1), jnp.int32),
           "label_logp": jnp.zeros((b, g, 1), jnp.float32)}
  trainable = distill.init_trainable(cfg, params, recipe)
  state = tx.init(trainable)
  for _ in range(3):
    trainable, state, metrics = step(trainable, state, params, batch)
  chex.assert_shape(metrics["loss"], ())
  assert step._cache_size() == 1  # pylint: disable=protected-access
  bad = dict(batch, label_ids=jnp.zeros((b, g + 1, 1), jnp.int32))
  with pytest.raises(AssertionError):
    step(trainable, state, params, bad)
  bad = dict(batch, mask=jnp.ones((b, g - 1), bool))
  with pytest.raises(AssertionError):
    step(trainable, state, params, bad)


def test_losses_match_their_definitions():
  """TVD, forward KL and JSD against numpy written from their definitions, hard and soft labels."""
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(2, 3, 7)).astype(np.float32) * 2
  q = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  a = rng.integers(0, 7, size=(2, 3, 1)).astype(np.int32)
  out = {k: np.asarray(v) for k, v in distill.losses(jnp.asarray(logits), jnp.asarray(a),
                                                     jnp.zeros(a.shape), 0.0).items()}
  p = np.eye(7)[a[..., 0]]
  m = (p + q) / 2
  kl = lambda x, y: np.sum(np.where(x > 0, x * np.log(np.where(x > 0, x, 1) / y), 0), -1)
  np.testing.assert_allclose(out["tvd"], 0.5 * np.abs(p - q).sum(-1), rtol=1e-5)
  np.testing.assert_allclose(out["fkl"], kl(p, q), rtol=1e-5)
  np.testing.assert_allclose(out["jsd"], 0.5 * kl(p, m) + 0.5 * kl(q, m), rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(out["agree"], (np.argmax(logits, -1) == a[..., 0]))
  # Soft labels at temperature 2: the target's top 3 and the rest in one bucket.
  t_logits = rng.normal(size=(2, 3, 7)) * 2
  t_logp = np.log(np.exp(t_logits / 2) / np.exp(t_logits / 2).sum(-1, keepdims=True))
  ids = np.argsort(-t_logp, -1)[..., :3]
  top = np.take_along_axis(t_logp, ids, -1)
  out = {k: np.asarray(v) for k, v in distill.losses(
      jnp.asarray(logits), jnp.asarray(ids, jnp.int32), jnp.asarray(top, jnp.float32),
      2.0).items()}
  q2 = np.exp(logits / 2) / np.exp(logits / 2).sum(-1, keepdims=True)
  pb = np.concatenate([np.exp(top), 1 - np.exp(top).sum(-1, keepdims=True)], -1)
  qk = np.take_along_axis(q2, ids, -1)
  qb = np.concatenate([qk, 1 - qk.sum(-1, keepdims=True)], -1)
  mb = (pb + qb) / 2
  np.testing.assert_allclose(out["tvd"], 0.5 * np.abs(pb - qb).sum(-1), rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(out["fkl"], kl(pb, qb), rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(out["jsd"], 0.5 * kl(pb, mb) + 0.5 * kl(qb, mb), rtol=1e-4,
                             atol=1e-6)


def test_margin_loss_penalises_a_confident_wrong_token():
  """margin = 1 - (q(a*) - the draft's largest q on another token), a* the largest or not."""
  # Row 0: a* = 0 holds the largest probability; row 1: token 1 holds more than a* = 0;
  # row 2: a* = 3, the least likely, behind token 2.
  logits = np.array([[[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 1.0, 0.0], [1.0, 0.5, 2.5, 0.2]]],
                    np.float32)  # [B=1, G=3, V=4]
  a = np.array([[[0], [0], [3]]], np.int32)  # [1, 3, 1]
  q = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  out = {k: np.asarray(v) for k, v in distill.losses(jnp.asarray(logits), jnp.asarray(a),
                                                     jnp.zeros(a.shape), 0.0).items()}
  q_a = np.take_along_axis(q, a, -1)[..., 0]
  q_second = np.array([[q[0, 0, 1], q[0, 1, 1], q[0, 2, 2]]])  # the largest other token, by hand
  chex.assert_shape(out["margin"], (1, 3))
  np.testing.assert_allclose(out["margin"], 1 - (q_a - q_second), rtol=1e-5)
  np.testing.assert_allclose(out["margin"] - out["tvd"], q_second, rtol=1e-5)  # TVD + q_second
  assert out["margin"][0, 0] < 1 < out["margin"][0, 1]  # a* ahead: below 1; behind: above


def test_margin_loss_is_greedy_only():
  """The margin loss with a sampling temperature is refused: one line, in the API and the CLI."""
  distill.make_recipe(loss="margin")  # greedy: accepted
  with pytest.raises(distill.DistillError, match="loss='margin'.*greedy") as err:
    distill.make_recipe(loss="margin", temperature=0.7)
  assert "\n" not in str(err.value)
  with pytest.raises(distill.DistillError, match="^--loss: loss='margin'") as err:
    distill._recipe_from(distill.build_parser().parse_args(["--loss", "margin",
                                                            "--temperature", "0.7"]))
  assert "\n" not in str(err.value)


def test_simulated_rounds_follow_the_confidence_policy():
  """The acceptance estimate replays the engine's confidence rounds, with the library's policy by default."""
  # Positions 0..9 (0 is the prefill's token): agree, confidence.
  agree = np.array([[1, 1, 1, 0, 1, 1, 1, 1, 1, 1]], bool)
  conf = np.array([[1, 0.9, 0.9, 0.9, 0.2, 0.9, 0.9, 0.9, 0.9, 0.9]])
  mask = np.ones_like(agree)
  # Threshold 0.7, cap 5 (the defaults). Round at 1: drafts 1, 2, 3 sure; 1, 2
  # accepted, 3 wrong -> 3 tokens. Round at 4: its first draft is unsure, so
  # it stops there (whatever 5 says) and is accepted -> 2 tokens. Round at 6:
  # sure to the end -> the last 4 tokens.
  assert jspec.options.DEFAULT_MIN_CONFIDENCE == 0.7
  assert jspec.options.DEFAULT_GAMMA["confidence"] == 5
  assert distill.simulate_rounds(agree, conf, mask) == pytest.approx(9 / 3)
  # At 0.1 nothing stops before the cap of 5: rounds at 1 (1, 2 right, 3
  # wrong: 3 tokens), then at 4 (4..8 right, the cap: 6 tokens, clipped to
  # the 6 left).
  assert distill.simulate_rounds(agree, conf, mask, 0.1, 5) == pytest.approx(9 / 2)
  # A masked tail is not part of the path: 0..4 only (rounds at 1 and 4).
  short = np.array([[1, 1, 1, 1, 1, 0, 0, 0, 0, 0]], bool)
  assert distill.simulate_rounds(agree, conf, short) == pytest.approx(4 / 2)


@pytest.mark.slow  # parses the whole standard library
def test_training_prompts_are_not_evaluation_prompts():
  """No built-in training prompt equals, contains or lies in a bench prompt; the set is deterministic."""
  held = distill_data.eval_texts()
  assert any(name.startswith("HumanEval/") for name in held)  # the bench extra is installed
  assert len(distill_data.CHAT) >= 200 and len(set(distill_data.CHAT)) == len(distill_data.CHAT)
  for pool in (distill_data.training_prompts(), distill_data.chat_prompts(),
               distill_data.code_prompts(limit=2000)):
    assert distill_data.disjoint(pool, held) == pool  # none equals, contains or lies in one
  code = distill_data.training_prompts(n_code=50, n_chat=20)
  assert code == distill_data.training_prompts(n_code=50, n_chat=20)  # deterministic
  assert sum(p.chat for p in code) == 20 and all(p.text.strip() for p in code)
  # A training set that contains an evaluation prompt loses it.
  suite = {p.name: p.text for p in bench_prompts.SUITE}
  kept = distill_data.disjoint([distill_data.Prompt("code", "# x\n" + suite["quicksort"]),
                                distill_data.Prompt("chat", "Write a limerick about tea.")], suite)
  assert [p.text for p in kept] == ["Write a limerick about tea."]


def test_a_prefix_of_the_training_set_holds_out_its_fraction():
  """The built-in prompts are ordered by hash; a prefix's held-out share is still the fraction."""
  prompts = distill_data.training_prompts(n_code=120, n_chat=40)
  hashes = [distill_data.prompt_hash(p.text) for p in prompts]

  class Hashes:  # what `_split` reads of a `Data`
    def __init__(self, hashes):
      self.hashes = hashes

    def __len__(self):
      return len(self.hashes)

  train, held = distill._split(Hashes(hashes), 0.05)
  assert len(train) + len(held) == len(prompts)
  assert 1 <= len(held) <= 20, len(held)  # 8 expected; by the raw hash all 160 were below 0.05
  again_train, again_held = distill._split(Hashes(hashes), 0.05)
  np.testing.assert_array_equal(held, again_held)  # stable: resume sees the same split


def test_bench_refuses_a_draft_trained_on_its_prompts(tmp_path, distilled):
  """A draft whose record holds a suite prompt's hash is refused (exit 2); a held-out one is not."""
  bundle, report = distilled
  suite = bench_prompts.SUITE
  record = {"prompt_hashes": [distill_data.prompt_hash(suite[0].text)]}
  path = distill.save_draft(tmp_path / "leaky.jspec.safetensors", bundle.draft.cfg,
                            distill.float_params(bundle.draft), record)
  with pytest.raises(ValueError, match="distilled on 1 of the prompts"):
    distill_data.check_held_out(path, {p.name: p.text for p in suite})
  distill_data.check_held_out(report.path, {p.name: p.text for p in suite})  # held out: fine
  target = store.save(tmp_path / "t.jspec.safetensors", bundle.target.cfg,
                      distill.draft_tensors(distill.float_params(bundle.target)))
  from bench import __main__ as bench_main  # pylint: disable=import-outside-toplevel
  with pytest.raises(SystemExit) as exit_info:
    bench_main.main(["--target", str(target), "--draft", str(path), "--prompts", suite[0].name,
                     "--modes", "target", "--no-hf", "--out", str(tmp_path / "r.json")])
  assert exit_info.value.code == 2


def test_bad_inputs_are_one_line_errors(tmp_path, capsys):
  """Bad prompts, recipe values, drafts and flags: one-line errors (exit 2 on the command line)."""
  bundle = _pair()
  cases = [
      (dict(prompts=[]), "no training prompts"),
      (dict(prompts="def f():"), "not one string"),
      (dict(prompts=[[1, 2], 3]), "training prompt 1"),
      (dict(prompts=_prompts(4), learning_rate="fast"), "learning_rate='fast'"),
      (dict(prompts=_prompts(4), learning_rate=float("nan")), "learning_rate=nan"),
      (dict(prompts=_prompts(4), loss="kl"), "loss='kl'"),
      (dict(prompts=_prompts(4), batch="4"), "unknown recipe fields"),
  ]
  for kwargs, message in cases:
    with pytest.raises(distill.DistillError, match=message) as err:
      distill.distill(bundle, out=tmp_path / "x.jspec.safetensors", progress=False, **kwargs)
    assert "\n" not in str(err.value)
  int8 = tiny.pair(seed=3, scale=0.6, draft_int8=True)
  with pytest.raises(distill.DistillError, match="draft_int8=False"):
    distill.distill(int8, _prompts(4), tmp_path / "x.jspec.safetensors", progress=False)
  alone = jspec.Bundle(bundle.target)
  with pytest.raises(distill.DistillError, match="no draft"):
    distill.distill(alone, _prompts(4), tmp_path / "x.jspec.safetensors", progress=False)
  # The command line: exit 2 and one line on stderr, before anything loads.
  from jspec import cli  # pylint: disable=import-outside-toplevel
  t_cfg, d_cfg = tiny.configs(13)
  target = store.save(tmp_path / "t.jspec.safetensors", t_cfg,
                      distill.draft_tensors(model.init_params(t_cfg, jax.random.key(1))))
  draft = store.save(tmp_path / "d.jspec.safetensors", tiny.DRAFT,
                     distill.draft_tensors(model.init_params(tiny.DRAFT, jax.random.key(2))))
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text('"def f(x):"\n{"text": "Say hi", "chat": true}\n')
  empty = tmp_path / "empty.jsonl"
  empty.write_text("\n")
  argv_cases = [
      (["--learning-rate", "abc"], "'abc' is not a number"),
      (["--prompts", str(empty)], "no prompts"),
      (["--prompts", str(tmp_path / "missing.jsonl")], "cannot read"),
      (["--loss", "kl"], "invalid choice"),
      (["--target", str(target)], "--target needs --draft-model"),
      (["--target", str(target), "--draft-model", str(draft), "--prompts", str(prompts),
        "--out", str(tmp_path / "o.jspec.safetensors")], "vocabulary"),
  ]
  for argv, message in argv_cases:
    assert cli.main(["distill", *argv]) == 2, argv
    err = capsys.readouterr().err
    assert err.startswith("jspec: error: ") and message in err, (argv, err)
    assert err.count("\n") == 1, err


@pytest.mark.slow
def test_command_line_distills(tmp_path, capsys):
  """`jspec distill` on checkpoint files: exit 0, a draft file that loads, held-out figures."""
  from jspec import cli  # pylint: disable=import-outside-toplevel
  bundle = _pair()
  target = store.save(tmp_path / "t.jspec.safetensors", bundle.target.cfg,
                      distill.draft_tensors(distill.float_params(bundle.target)))
  draft = store.save(tmp_path / "d.jspec.safetensors", bundle.draft.cfg,
                     distill.draft_tensors(distill.float_params(bundle.draft)))
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text("".join(json.dumps({"ids": p}) + "\n" for p in _prompts(12)))
  out = tmp_path / "o.jspec.safetensors"
  argv = ["distill", "--target", str(target), "--draft-model", str(draft), "--prompts",
          str(prompts), "--out", str(out), "--steps", "3", "--gen-tokens", "6",
          "--max-context", "8", "--batch-size", "4", "--eval-fraction", "0.25", "--json"]
  assert cli.main(argv) == 0
  report = json.loads(capsys.readouterr().out)
  assert report["steps"] == 3 and report["path"] == str(out)
  assert distill_data.read_record(out)["recipe"]["steps"] == 3
  pair = jspec.load(str(target), draft=str(out), progress=False)
  assert pair.draft.cfg == bundle.draft.cfg


def test_progress_into_a_log_is_a_line_per_update(monkeypatch, capsys):
  # Not a terminal (a log file): each redraw ends with a newline, no \r, so
  # a long run shows its progress in the log while it runs.
  monkeypatch.setattr(distill, "LOG_PROGRESS_INTERVAL_S", 0.0)
  bar = distill._bar(total=3, desc="distill: training", unit="step")
  for _ in range(3):
    bar.update(1)
  bar.close()
  err = capsys.readouterr().err
  lines = err.splitlines()
  assert "\r" not in err
  assert len(lines) >= 3 and all(line.startswith("distill: training") for line in lines)
  assert "3/3" in lines[-1]


def test_distill_eval_runs_each_threshold(tmp_path, monkeypatch, capsys):
  """bench.tools.distill_eval --min-confidence: both drafts at every threshold, each as generate runs it.

  The tiny pair (a byte vocabulary: tokenizer-less suite prompts are their
  UTF-8 bytes) stands in for the known pair; the "distilled" draft is another
  random draft in a file. Every mode's counters and ids must be those of
  `jspec.generate` with that mode's draft and threshold; the default run
  keeps the tool's old output shape; bad thresholds are argparse errors
  before anything loads.
  """
  from bench import models  # pylint: disable=import-outside-toplevel
  from bench.tools import distill_eval  # pylint: disable=import-outside-toplevel
  assert distill_eval.DEFAULT_MIN_CONFIDENCE == jspec.Options().min_confidence
  assert distill_eval.MODE_KWARGS["gamma"] == jspec.Options().gammas()[0]
  # The int8 draft: its two thresholds draft differently on the prompt below.
  bundle = tiny.pair(seed=3, scale=1.0, vocab=256, draft_int4=False)
  d_cfg = bundle.draft.cfg
  draft = distill.save_draft(tmp_path / "d.jspec.safetensors", d_cfg,
                             model.init_params(d_cfg, jax.random.key(7), scale=1.0),
                             {"prompt_hashes": [distill_data.prompt_hash("not a bench prompt")]})
  tuned = jspec.Bundle(bundle.target, models.prepare_checkpoint(str(draft), "draft",
                                                                 bundle_lib.Settings()))
  loads = []

  def fake_load(*args, **kwargs):
    loads.append(args)
    return models.Loaded(bundle, None, "tiny", {"target": models._describe(bundle.target)})

  monkeypatch.setattr(models, "load", fake_load)
  for bad, message in (("0", "not in (0, 1]"), ("1.5", "not in (0, 1]"), ("nan", "not in (0, 1]"),
                       ("abc", "'abc' is not a number"), ("0.5,,0.7", "comma-separated"),
                       ("0.5,0.50", "given twice"), ("", "comma-separated")):
    with pytest.raises(SystemExit) as exit_info:
      distill_eval.main(["--draft", str(draft), "--min-confidence", bad])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("python -m bench.tools.distill_eval: error: --min-confidence"), err
    assert message in err, (bad, err)
  assert not loads  # refused before loading

  names = "chat_email"  # one prompt: the default run below takes a code one
  out = tmp_path / "r.json"
  assert distill_eval.main(["--draft", str(draft), "--suites", "suite", "--prompts", names,
                            "--min-confidence", "0.9,0.7", "--max-new-tokens", "8",
                            "--out", str(out)]) == 0
  doc = json.loads(out.read_text())
  assert doc["settings"]["min_confidence"] == [0.7, 0.9]
  runs = {"confidence": (bundle, 0.7), "confidence_distilled": (tuned, 0.7),
          "confidence_p0.9": (bundle, 0.9), "confidence_distilled_p0.9": (tuned, 0.9)}
  drafted = {}
  for q in bench_prompts.select(bench_prompts.SUITE, names):
    entry = doc["prompts"][q.name]
    assert set(entry["modes"]) == {"target", *runs}, entry["modes"].keys()
    ids = bench_prompts.encode(q, None)
    for name, (pair, threshold) in runs.items():
      want = jspec.generate(pair, ids, max_new_tokens=8, temperature=0.0, stop_at_eos=False,
                            **dict(distill_eval.MODE_KWARGS, min_confidence=threshold))
      got = entry["modes"][name]
      for k in ("drafted", "accepted", "rounds", "mean_tokens_per_round"):
        assert got[k] == want.stats[k], (q.name, name, k, got[k], want.stats[k])
      assert got["ids_equal_target"]
      drafted[q.name, name] = got["drafted"]
  # The check bites: the thresholds, and the drafts, draft differently here.
  assert drafted["chat_email", "confidence"] != drafted["chat_email", "confidence_p0.9"]
  assert drafted["chat_email", "confidence"] != drafted["chat_email", "confidence_distilled"]
  chat = doc["summary"]["chat"]
  assert chat["prompts"] == 1
  assert chat["confidence_distilled_p0.9"]["mean_tokens_per_round"] == (
      doc["prompts"]["chat_email"]["modes"]["confidence_distilled_p0.9"]["mean_tokens_per_round"])
  per = chat["thresholds"]
  assert set(per) == {"0.7", "0.9"}
  assert per["0.9"]["original"] == "confidence_p0.9"
  assert per["0.9"]["distilled"] == "confidence_distilled_p0.9"
  a, b = (chat[m]["mean_tokens_per_round"] for m in ("confidence_p0.9", "confidence_distilled_p0.9"))
  assert per["0.9"]["tokens_per_round_gain"] == pytest.approx(b / a - 1)
  assert per["0.9"]["targets"]["speedup"] == 2.3
  assert chat["tokens_per_round_gain"] == per["0.7"]["tokens_per_round_gain"]
  assert pathlib.Path(doc["plot"]).is_file()

  # The default: the shape the tool always wrote (one threshold, the old mode names and keys).
  out = tmp_path / "default.json"
  assert distill_eval.main(["--draft", str(draft), "--suites", "suite", "--prompts", "quicksort",
                            "--max-new-tokens", "4", "--out", str(out)]) == 0
  doc = json.loads(out.read_text())
  assert "min_confidence" not in doc["settings"]
  assert doc["settings"]["mode"]["min_confidence"] == jspec.Options().min_confidence
  assert set(doc["prompts"]["quicksort"]["modes"]) == {"target", "confidence",
                                                      "confidence_distilled"}
  assert set(doc["summary"]["code"]) == {"prompts", "confidence", "confidence_distilled",
                                         "tokens_per_round_gain", "targets"}
