"""The 4-bit draft (`jspec.Settings(draft_int4=True)`) keeps the output the target's.

`weights.to_int4_blocks` stores each output's block of 32 inputs as
scale * q + offset, q in [0, 15] two to a byte; `weights.to_int4_panels`
holds the same numbers with scale and offset in float16 for the int4
kernel (int8 activations, AVX-512 VNNI hosts), which `bundle.prepare`
picks where it runs. The draft only proposes, so its rounding changes
acceptance, never the output. The pairs here are kernel-sized (outputs and
inputs multiples of 32, the table tied as in the real drafts), so the
draft really runs on `jspec_gemm_i4` or `jspec_gemm_blk4`; the engine tests
run both forms (the float one forced by `int4_available` patched off).
Kernel-level tests of `jspec_gemm_i4`: `test_int4_kernel.py`. Planted by
hand, each failing here:
  - the offset dropped (W = scale * q), q off by one (round(...) + 1,
    clipped), the scale the range / 16 instead of / 15: the quantization
    tests (7 of them each);
  - the setting ignored in `bundle.prepare`: the storage tests;
  - `bundle.prepare` taking the float form where the int4 kernel runs:
    the storage test's int4 case.
Greedy output and sampling stay the target's with any of the first three
(the draft only proposes), so the engine tests check losslessness with the
4-bit draft, not its rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
import test_lossless
import tiny
from convert import config as config_lib
from jspec import bundle as bundle_lib
from jspec import cli
from jspec import cpu_kernels
from jspec import loading
from jspec import model
from jspec import weights

needs_kernels = pytest.mark.skipif(not cpu_kernels.available(),
                                   reason="jspec's CPU kernels do not build here")

# Tied like the real drafts (the token table is the head); every matrix but
# k and v (16 outputs) fills whole kernel panels.
CFG = config_lib.Qwen2Config(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
    num_kv_heads=1, head_dim=16, rope_theta=1e4, eos_token_ids=(), tie_word_embeddings=True)


def _close_pair(**settings) -> jspec.Bundle:
  """A target and a draft of its shape, the draft the target plus noise: most drafts agree."""
  params, draft = _pair_params()
  return bundle_lib.make((CFG, params), (CFG, draft), settings=jspec.Settings(**settings))


def _pair_params():
  """(target, draft) float params of `CFG`: the draft is the target plus a little noise."""
  params = model.init_params(CFG, jax.random.key(3), scale=0.6)
  noise = model.init_params(CFG, jax.random.key(4), scale=0.05)
  return params, jax.tree.map(lambda a, b: a + b if a.dtype == jnp.float32 else a, params, noise)


def _blocks_of(rows: np.ndarray, size: int = weights.INT8_BLOCK):
  """Per element of [O, I] rows, its block's min and step ((max - min) / 15), independently."""
  o, i = rows.shape
  blocked = rows.reshape(o, i // size, size).astype(np.float64)
  low, high = blocked.min(axis=2, keepdims=True), blocked.max(axis=2, keepdims=True)
  step = (high - low) / 15
  return (np.broadcast_to(low, blocked.shape).reshape(o, i),
          np.broadcast_to(step, blocked.shape).reshape(o, i))


@pytest.mark.parametrize("shape,form,kind", [
    ((96, 64), "dense", weights.Blocks),  # [I, O]: three blocks of 32 per output
    ((64, 96), "table", weights.Blocks),  # a [V, D] token table, read by rows and as the head
    ((40, 64), "dense", weights.Blocks),  # inputs not a multiple of 32: one block a row
    ((64, 48), "dense", weights.Dense),  # outputs not a multiple of 32: widened
    ((64, 48), "table", weights.Table),
])
def test_widens_within_half_a_step(shape, form, kind):
  w = np.array(jax.random.normal(jax.random.key(0), shape), np.float32)
  w[:, 3] = 0.25  # one output whose every input is equal (max == min): exactly kept
  leaf = weights.Dense(jnp.asarray(w)) if form == "dense" else weights.Table(jnp.asarray(w.T))
  got = weights.to_int4_blocks(leaf)
  assert type(got) is kind
  rows = w.T  # [O, I]
  size = weights.INT8_BLOCK if rows.shape[1] % weights.INT8_BLOCK == 0 else rows.shape[1]
  if kind is weights.Blocks:
    assert got.block == size and got.offset is not None
    assert cpu_kernels.is_nibbles(got.q)  # two q to a byte
  widened = np.asarray(weights.matrix(got)).T  # [O, I]
  low, step = _blocks_of(rows, size)
  err = np.abs(widened - rows)
  assert np.all(err <= step / 2 * (1 + 1e-5) + 1e-6), err.max()
  np.testing.assert_array_equal(widened[3], rows[3])
  # The block's min and max are levels 0 and 15: kept up to float32 rounding.
  for b in range(rows.shape[1] // size):
    cols = slice(b * size, (b + 1) * size)
    np.testing.assert_allclose(widened[:, cols].min(1), rows[:, cols].min(1), atol=1e-6)
    np.testing.assert_allclose(widened[:, cols].max(1), rows[:, cols].max(1), atol=1e-5)
  assert err.max() > 0  # random weights are not 4-bit: the test would pass an identity


@pytest.mark.parametrize("form", ["dense", "table"])
def test_reproduces_a_4_bit_matrix_exactly(form):
  """W = s * q + m per block with powers of two and q spanning 0..15: every value comes back."""
  rng = np.random.default_rng(1)
  o, i = 64, 96
  q = rng.integers(0, 16, (o, i))
  q[:, 0::32], q[:, 1::32] = 0, 15  # each block reaches both ends, so min = m, max = m + 15 s
  s = 2.0 ** rng.integers(-8, -2, (o, i // 32))
  m = rng.integers(-64, 64, (o, i // 32)) * 2.0 ** -6
  rows = (np.repeat(s, 32, 1) * q + np.repeat(m, 32, 1)).astype(np.float32)  # [O, I]
  leaf = weights.Dense(jnp.asarray(rows.T)) if form == "dense" else weights.Table(jnp.asarray(rows))
  got = weights.to_int4_blocks(leaf)
  np.testing.assert_array_equal(np.asarray(weights.matrix(got)).T, rows)
  if form == "table":
    ids = jnp.asarray([0, 5, 63])
    np.testing.assert_array_equal(np.asarray(weights.lookup(got, ids)), rows[[0, 5, 63]])


needs_int4 = pytest.mark.skipif(not cpu_kernels.int4_available(),
                                reason="the int4 kernel needs AVX-512 VNNI")
FORMS = [pytest.param("int4", marks=needs_int4), "blocks"]


@pytest.fixture
def form(request, monkeypatch):
  """The 4-bit draft's stored form under test: "blocks" turns the int4 kernel off first."""
  if request.param == "blocks":
    monkeypatch.setattr(cpu_kernels, "int4_available", lambda: False)
  return {"int4": weights.Int4Panels, "blocks": weights.Blocks}[request.param]


@needs_kernels
@pytest.mark.parametrize("form", FORMS, indirect=True)
def test_the_draft_is_stored_in_4_bits_and_the_target_is_not(form):
  bundle = _close_pair(draft_int4=True)
  draft = [l for l in jax.tree.leaves(bundle.draft.params, is_leaf=weights.is_leaf)
           if weights.is_leaf(l)]
  blocks = [l for l in draft if isinstance(l, form)]
  # q, o, gate, up and down of both layers and the tied table; k and v (16 outputs) stay Dense.
  assert len(blocks) == 5 * CFG.num_layers + 1
  assert isinstance(model.head_of(model.merge(CFG, bundle.draft.params)), form)
  target = _close_pair()
  t_leaves = jax.tree.leaves(bundle.target.params, is_leaf=weights.is_leaf)
  for a, b in zip(t_leaves, jax.tree.leaves(target.target.params, is_leaf=weights.is_leaf)):
    assert type(a) is type(b)  # the setting is the draft's alone
  for l in blocks:
    if form is weights.Blocks:  # half a byte a weight, a float32 scale and offset per 32
      assert cpu_kernels.is_nibbles(l.q) and l.offset is not None and l.block == weights.INT8_BLOCK
      assert l.q.size * 2 == l.shape[0] * l.shape[1] == l.scale.size * 32 == l.offset.size * 32
    else:  # half a byte a weight, a float16 scale and offset per 32: 640 bytes per 1024
      assert l.panels.dtype == jnp.uint8 and l.panels.size * 1024 == l.shape[0] * l.shape[1] * 640


CASES = {
    "model-confidence": dict(method="model"),
    "model-fixed4": dict(method="model", policy="fixed", gamma=4),
    "lookup_model": dict(method="lookup_model", gamma=4, ngram=2),
}


@needs_kernels
@pytest.mark.parametrize("form", FORMS, indirect=True)
@pytest.mark.parametrize("name", list(CASES))
def test_greedy_output_is_target_only(name, form):
  int8 = _close_pair()
  int4 = _close_pair(draft_int4=True)
  prompts = [tiny.prompt(s, n, CFG.vocab_size) for s, n in ((1, 6), (2, 9), (3, 4))]
  want = [r.token_ids for r in jspec.generate(int8, prompts, max_new_tokens=16, method="target")]
  got = jspec.generate(int4, prompts, max_new_tokens=16, **CASES[name])
  assert [r.token_ids for r in got] == want
  drafted = sum(r.stats["drafted"] for r in got)
  assert drafted > 0
  assert isinstance(int4.draft.params["layers"]["0"]["mlp"]["down"]["w"], form)
  if name == "model-fixed4":  # a draft close to the target stays close in 4 bits
    ref = jspec.generate(int8, prompts, max_new_tokens=16, **CASES[name])
    rate = lambda rs: sum(r.stats["accepted"] for r in rs) / sum(r.stats["drafted"] for r in rs)
    assert rate(got) >= rate(ref) - 0.15, (rate(got), rate(ref))


@needs_kernels
@pytest.mark.parametrize("form", FORMS, indirect=True)
def test_greedy_with_a_cut_vocabulary(form):
  """draft_int4 with draft_vocab: the subset's head rows in 4 bits, the output still the target's."""
  full = _close_pair(draft_int4=True)
  cut = bundle_lib.make(*[(CFG, p) for p in _pair_params()], settings=jspec.Settings(
      draft_int4=True, draft_vocab=5), ranking=list(range(63, -1, -1)))
  assert isinstance(cut.draft.params["vocab_head"], form)
  ids = np.asarray(cut.draft.params["vocab_ids"])
  assert ids.tolist() == list(range(32, 64))  # 5 rounded up to a whole panel
  np.testing.assert_array_equal(
      np.asarray(weights.matrix(cut.draft.params["vocab_head"])),
      np.asarray(weights.matrix(full.draft.params["embed"]["table"]))[:, ids])
  prompts = [tiny.prompt(s, n, CFG.vocab_size) for s, n in ((1, 6), (2, 9))]
  want = [r.token_ids for r in jspec.generate(full, prompts, max_new_tokens=12, method="target")]
  got = jspec.generate(cut, prompts, max_new_tokens=12, policy="fixed", gamma=3)
  assert [r.token_ids for r in got] == want


@needs_kernels
@pytest.mark.parametrize("form", FORMS, indirect=True)
def test_sampling_follows_the_target_with_a_4_bit_draft(form):
  """The chi-square test of `test_lossless` over the first two tokens, the 4-bit draft's q."""
  bundle = _close_pair(draft_int4=True)
  spec = jspec.Options(temperature=1.0, gamma=3, policy="fixed").spec(
      bundle.target.arch, bundle.draft.arch, bundle.vocab_limit)
  prompt = test_lossless.PROMPTS[0]
  got, = test_lossless.draw(bundle, [prompt], spec, 2, seed=11)
  test_lossless.assert_follows_target(bundle, prompt, got, spec.sampling, "4-bit draft,")


@pytest.mark.parametrize("settings,words", [
    (dict(draft_int4=1), ("draft_int4=1", "expected True, False or None")),
    (dict(draft_int4="yes"), ("draft_int4='yes'", "expected True, False or None")),
    (dict(draft_int4=True, draft_int8=True), ("draft_int8=True", "expected draft_int8 None")),
    (dict(draft_int4=True, draft_int8=False), ("draft_int8=False", "expected draft_int8 None")),
    (dict(draft_int4=True, kernels=False), ("kernels=False", "expected kernels True or None")),
], ids=["int", "str", "with-int8", "with-float", "no-kernels"])
def test_bad_settings_are_one_line(settings, words):
  with pytest.raises(ValueError) as err:
    jspec.Settings(**settings)
  assert "\n" not in str(err.value) and "draft_int4" in str(err.value)
  for word in words:
    assert word in str(err.value)


def test_without_kernels_preparing_is_one_line(monkeypatch):
  monkeypatch.setattr(cpu_kernels, "available", lambda: False)
  with pytest.raises(ValueError) as err:
    tiny.pair(seed=1, draft_int4=True)
  assert "\n" not in str(err.value)
  assert "draft_int4=True" in str(err.value) and "expected a CPU" in str(err.value)


def test_the_setting_is_part_of_the_keys(tmp_path):
  """Its own prepared draft file and key; the target's file is the one other loads share."""
  from jspec import prepared  # pylint: disable=import-outside-toplevel
  gguf = tmp_path / "m.gguf"
  int4 = jspec.Settings(draft_int4=True)
  assert loading.prepared_path(gguf, "exact", "draft", int4) != loading.prepared_path(
      gguf, "exact", "draft")
  assert prepared.key("s", "draft", "exact", int4) != prepared.key(
      "s", "draft", "exact", jspec.Settings())
  assert prepared.key("s", "draft", "exact", jspec.Settings(draft_int4=False)) != prepared.key(
      "s", "draft", "exact", jspec.Settings())


@pytest.mark.parametrize("available", [True, False], ids=["vnni", "no-vnni"])
def test_the_default_is_4_bit_where_the_int4_kernel_runs(monkeypatch, available):
  monkeypatch.setattr(cpu_kernels, "int4_available", lambda: available)
  on = bundle_lib.draft_int4
  assert on(jspec.Settings(), kernels=True) is available
  assert on(jspec.Settings(), kernels=False) is False  # the float block form is no gain
  assert on(jspec.Settings(draft_int8=True), kernels=True) is False  # int8 asked for by name
  assert on(jspec.Settings(draft_int8=False), kernels=True) is False  # the float draft
  assert on(jspec.Settings(draft_int4=False), kernels=True) is False
  assert on(jspec.Settings(draft_int4=True), kernels=True) is True


@pytest.mark.parametrize("argv,words", [
    (["--draft-int4", "--float-draft"], ("--draft-int4", "--float-draft", "pass one")),
    (["--draft-int4", "--method", "target"], ("--draft-int4", "--method target")),
    (["--draft-int4", "--method", "prompt_lookup"], ("--draft-int4", "prompt_lookup")),
], ids=["with-float-draft", "target", "prompt_lookup"])
def test_bad_flags_are_one_line(capsys, monkeypatch, argv, words):
  monkeypatch.setattr(loading, "load", lambda *a, **k: pytest.fail("loaded"))
  assert cli.main(["generate", "hi", *argv]) == 2
  out = capsys.readouterr()
  assert out.out == "" and out.err.startswith("jspec: error: ") and out.err.count("\n") == 1
  for word in words:
    assert word in out.err, out.err


def test_the_flag_reaches_the_settings(capsys, monkeypatch):
  seen = []

  def load(*args, **kwargs):
    seen.append(kwargs["settings"])
    raise ValueError("recorded")

  monkeypatch.setattr(loading, "load", load)
  assert cli.main(["generate", "hi", "--draft-int4"]) == 2
  assert cli.main(["generate", "hi", "--draft-int4", "--method", "lookup_model"]) == 2
  assert cli.main(["generate", "hi", "--no-draft-int4"]) == 2
  assert cli.main(["generate", "hi", "--no-draft-int4", "--float-draft"]) == 2
  assert cli.main(["generate", "hi"]) == 2
  assert seen == [jspec.Settings(draft_int4=True)] * 2 + [
      jspec.Settings(draft_int4=False), jspec.Settings(draft_int4=False, draft_int8=False),
      jspec.Settings()]
  assert "recorded" in capsys.readouterr().err
