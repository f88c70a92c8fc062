"""The exact compact target: a checkpoint's own numbers (int8 blocks, bfloat16) compute the float32 model.

A GGUF file's quantized matrices load as int8 blocks (`weights.Blocks`) that
widen to exactly what gguf's dequantizer gives, through the converted file
and into the model; the model's logits are the float32 conversion's to
summation rounding, greedy output is the same, and sampling with a compact
target is still exactly the (compact) target's distribution.
"""

from __future__ import annotations


import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

import convert
import jspec
import test_lossless
import tiny
from convert import gguf_blocks
from convert import store
from jspec import bundle as bundle_lib
from jspec import cache as cache_lib
from jspec import cpu_kernels
from jspec import model
from jspec import modules
from jspec import weights

# Every matrix type gguf can write that int8 blocks hold, F16 and BF16 beside them.
# Layer 1's ffn_down is affine where layer 0's is symmetric, as Q4_K_M mixes Q4_K
# and Q6_K in one role (the first matching suffix wins).
QUANT = {"blk.1.ffn_down.weight": Q.Q5_1, "token_embd.weight": Q.Q5_1, "attn_q.weight": Q.Q8_0, "attn_k.weight": Q.Q5_0,
         "attn_v.weight": Q.Q4_1, "attn_output.weight": Q.BF16, "ffn_gate.weight": Q.Q4_0,
         "ffn_up.weight": Q.Q5_1, "ffn_down.weight": Q.Q5_0, "output.weight": Q.F16}
# Rows of 64 and 96 values (whole blocks of 32); outputs multiples of 32 but k and v (16).
SIZES = dict(hidden_size=64, head_dim=8, num_attention_heads=8, num_key_value_heads=2,
             intermediate_size=96, vocab_size=288)

needs_kernels = pytest.mark.skipif(not cpu_kernels.available(),
                                   reason=f"no CPU kernels: {cpu_kernels.unavailable_reason()}")


def _leaves(params):
  return [w for w in jax.tree.leaves(params, is_leaf=weights.is_leaf) if weights.is_leaf(w)]


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory, make_hf_model, write_gguf):
  hf = make_hf_model(seed=21, **SIZES)
  return write_gguf(tmp_path_factory.mktemp("compact") / "q.gguf", hf, quant=QUANT)


@pytest.fixture(scope="module")
def checkpoints(gguf_path, tmp_path_factory):
  """(cfg, exact tensors read back from a converted file, float32 tensors) of the GGUF."""
  out = convert.convert_checkpoint(gguf_path, tmp_path_factory.mktemp("c") / "q.jspec.safetensors",
                                   dtype="exact")
  cfg, exact = convert.load_checkpoint(out, dtype="exact")
  _, floats = convert.load_checkpoint(gguf_path, dtype="float32")
  return cfg, exact, floats


def test_quantized_matrices_widen_to_exactly_the_dequantized_checkpoint(checkpoints):
  cfg, exact, floats = checkpoints
  kinds = {path: type(value).__name__ for path, value in exact.items()}
  assert kinds["layers/0/attn/q/w"] == kinds["layers/0/mlp/up/w"] == "Blocks"
  assert exact["layers/0/attn/o/w"].dtype == jnp.bfloat16  # BF16 kept as it is
  assert exact["head/w"].dtype == jnp.float32  # F16 widened exactly
  params = model.params_from_tensors(cfg, exact)
  reference = model.params_from_tensors(cfg, floats)
  for path, (got, want) in _paired(params, reference):
    if isinstance(got, (weights.Blocks, weights.Dense, weights.Table)):
      np.testing.assert_array_equal(np.asarray(weights.matrix(got), np.float32),
                                    np.asarray(weights.matrix(want), np.float32), err_msg=path)
  assert isinstance(params["layers"]["0"]["attn"]["k"]["w"], weights.Dense)  # 16 outputs: widened
  # The token table's rows, read as blocks, are the dequantized embedding's.
  ids = jnp.asarray([[0, 5, 287], [31, 32, 100]])
  np.testing.assert_array_equal(weights.lookup(params["embed"]["table"], ids),
                                weights.lookup(reference["embed"]["table"], ids))


def _paired(a, b):
  la = jax.tree_util.tree_flatten_with_path(a, is_leaf=weights.is_leaf)[0]
  lb = jax.tree.leaves(b, is_leaf=weights.is_leaf)
  return [(model.path_name(path), pair) for (path, _), pair in zip(la, zip((x for _, x in la), lb))]


@needs_kernels
def test_a_compact_target_gives_the_float32_logits_and_tokens(checkpoints):
  cfg, exact, floats = checkpoints
  compact = bundle_lib.prepare(cfg, model.params_from_tensors(cfg, exact))
  plain = bundle_lib.prepare(cfg, model.params_from_tensors(cfg, floats))
  kinds = {type(w) for w in _leaves(compact.params)}
  assert weights.Blocks in kinds and weights.BF16Panels in kinds
  assert compact.backend.dtype == "float32"
  # The head is F16 in the file, float32 here: it gets the greedy head as a float32 one does.
  assert isinstance(compact.params["head"]["w"], weights.Panels)
  tokens = jnp.asarray(np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 37)), jnp.int32)
  run = lambda m: model.forward(m.arch, m.params, tokens, cache_lib.init(cfg, 2, 48))
  # The same weights: only the order of the float32 sums differs.
  chex.assert_trees_all_close(run(compact), run(plain), atol=2e-4, rtol=1e-4)
  base = jspec.generate(jspec.Bundle(plain), [1, 2, 3], max_new_tokens=16, method="target")
  for method in ("target", "prompt_lookup"):
    got = jspec.generate(jspec.Bundle(compact), [1, 2, 3], max_new_tokens=16, method=method)
    assert got.token_ids == base.token_ids


def test_int8_blocks_round_trip_the_converted_file(checkpoints, tmp_path):
  cfg, exact, _ = checkpoints
  path = store.save(tmp_path / "again.safetensors", cfg, exact)
  _, back = store.load(path)
  for name, value in exact.items():
    if isinstance(value, gguf_blocks.Blocks):
      assert isinstance(back[name], gguf_blocks.Blocks) and back[name].block == value.block
      for field in ("q", "scale", "offset"):
        a, b = getattr(value, field), getattr(back[name], field)
        assert (a is None) == (b is None), name
        if a is not None:
          np.testing.assert_array_equal(a, b, err_msg=f"{name}.{field}")
    else:
      np.testing.assert_array_equal(np.asarray(back[name]), np.asarray(value), err_msg=name)
  _, widened = store.load(path, dtype="float32")  # a float dtype asked of a compact file
  np.testing.assert_array_equal(widened["layers/1/mlp/down/w"],
                                exact["layers/1/mlp/down/w"].widen().T)


def _compact_pair(seed: int) -> jspec.Bundle:
  """The packable tiny pair with its target's matrices as int8 blocks (affine, B = 32)."""
  bundle = tiny.packable_pair(seed, draft_int8=False)

  def to_blocks(w):
    if not weights.is_leaf(w):
      return w  # norm scales, biases
    m = np.asarray(weights.matrix(w)).T  # [out, in]
    if m.shape[0] % 32:
      return w
    lo = m.reshape(m.shape[0], -1, 32).min(-1)
    hi = m.reshape(m.shape[0], -1, 32).max(-1)
    scale = ((hi - lo) / 15).astype(np.float32)
    q = np.clip(np.round((m.reshape(m.shape[0], -1, 32) - lo[..., None]) / scale[..., None]),
                0, 15).astype(np.int8).reshape(m.shape)
    return weights.blocks(q, scale, lo.astype(np.float32))

  params = jax.tree.map(to_blocks, model.init_params(tiny.PACKABLE_TARGET, jax.random.key(seed),
                                                     scale=0.3), is_leaf=weights.is_leaf)
  target = bundle_lib.prepare(tiny.PACKABLE_TARGET, params)
  return jspec.Bundle(target, bundle.draft)


@needs_kernels
def test_sampling_with_a_compact_target_is_the_compact_targets_distribution():
  bundle = _compact_pair(5)
  assert weights.Blocks in {type(w) for w in _leaves(bundle.target.params)}
  spec = jspec.Options(temperature=1.0, gamma=3, policy="fixed").spec(
      bundle.target.arch, bundle.draft.arch, bundle.vocab_limit)
  prompts = [[3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8, 1, 8]]
  samples = test_lossless.draw(bundle, prompts, spec, 2, seed=13)
  for prompt, got in zip(prompts, samples):
    probs = test_lossless.exact_joint(bundle, prompt, 2, spec.sampling)
    p_value = test_lossless.chi_square_p(got, probs)
    assert p_value > test_lossless.ALPHA, f"prompt {prompt}: chi-square p = {p_value:.2e}"
  greedy = jspec.generate(bundle, prompts[1], max_new_tokens=20, gamma=4, policy="fixed")
  assert greedy.token_ids == jspec.generate(bundle, prompts[1], max_new_tokens=20,
                                            method="target").token_ids


def _random_blocks(out, inputs, size, affine, seed):
  rng = np.random.default_rng(seed)
  q = rng.integers(-128, 128, (out, inputs), dtype=np.int8)
  scale = rng.standard_normal((out, inputs // size)).astype(np.float32)
  offset = rng.standard_normal(scale.shape).astype(np.float32) if affine else None
  return weights.blocks(q, scale, offset)


@needs_kernels
def test_mixed_k_quants_across_layers_keep_their_forms_and_numbers_in_the_layer_loop():
  # Q4_K (affine, blocks of 32) in one layer, Q6_K (symmetric, 16) in the
  # next, symmetric blocks of 32 in the last: three groups.
  mixed = [_random_blocks(64, 128, 32, True, 0), _random_blocks(64, 128, 16, False, 1),
           _random_blocks(64, 128, 32, False, 2)]
  with pytest.raises(ValueError, match="differ in shape"):
    cpu_kernels.LayerPick(tuple(w.scale for w in mixed), jnp.int32(0))
  assert weights.uniform(mixed) == mixed
  x = jnp.asarray(np.random.default_rng(3).standard_normal((3, 128)), jnp.float32)
  picked = jax.jit(lambda x, i: weights.dot(x, weights.pick([{"w": w} for w in mixed], i)["w"]))
  for i, before in enumerate(mixed):
    chex.assert_trees_all_close(picked(x, jnp.int32(i)), x @ weights.matrix(before),
                                rtol=1e-5, atol=1e-4)
  widened = [weights.Dense(jnp.zeros((128, 64), jnp.float32)), mixed[0]]  # not all blocks
  assert all(isinstance(w, weights.Panels) for w in weights.uniform(widened))


@needs_kernels
def test_a_compact_target_in_one_layer_loop_with_mixed_k_quants(make_hf_model, write_gguf,
                                                                 tmp_path):
  # Every layer matrix a kernel leaf (k and v 32 outputs): the layers run as one
  # loop whose kernel reads all layers' buffers with one shape.
  sizes = dict(SIZES, head_dim=16, num_attention_heads=4)
  path = write_gguf(tmp_path / "mixed.gguf", make_hf_model(seed=22, **sizes), quant=QUANT)
  cfg, exact = convert.load_checkpoint(path, dtype="exact")
  _, floats = convert.load_checkpoint(path, dtype="float32")
  assert exact["layers/0/mlp/down/w"].offset is None is not exact["layers/1/mlp/down/w"].offset
  compact = bundle_lib.prepare(cfg, model.params_from_tensors(cfg, exact))
  plain = bundle_lib.prepare(cfg, model.params_from_tensors(cfg, floats))
  assert modules.scannable(model.merge(cfg, compact.params), compact.backend)
  downs = [compact.params["layers"][i]["mlp"]["down"]["w"] for i in ("0", "1")]
  assert downs[0].offset is None is not downs[1].offset  # each layer in the file's own form
  tokens = jnp.asarray(np.random.RandomState(1).randint(0, cfg.vocab_size, (2, 29)), jnp.int32)
  run = lambda m: model.forward(m.arch, m.params, tokens, cache_lib.init(cfg, 2, 32))
  chex.assert_trees_all_close(run(compact), run(plain), atol=2e-4, rtol=1e-4)
  base = jspec.generate(jspec.Bundle(plain), [1, 2, 3], max_new_tokens=16, method="target")
  got = jspec.generate(jspec.Bundle(compact), [1, 2, 3], max_new_tokens=16, method="target")
  assert got.token_ids == base.token_ids
