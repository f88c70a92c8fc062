"""jspec.model against transformers' Qwen2, through the HF -> safetensors -> convert path.

Tiny random models with odd sizes (head_dim != hidden/heads, GQA with 2 and 3
query heads per kv head, tied and untied heads), non-default rope_theta, and a
prompt of 301 positions so RoPE at large positions matters; fp32 logits must
agree to 1e-4. Layer-level checks compare each Flax module with its HF twin.
"""

import copy
import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.qwen2 import modeling_qwen2

import convert
import jspec
from bench import shapes
from convert import config as config_lib
from flax import nnx
from jspec import bundle as bundle_lib
from jspec import cache as cache_lib
from jspec import cpu_kernels
from jspec import model as model_lib
from jspec import modules
from jspec import weights

T = 301  # prompt length: positions up to 300 (prime)


def _tokens(vocab, batch=2, length=T, seed=0):
  return np.random.default_rng(seed).integers(0, vocab, size=(batch, length)).astype(np.int32)


def _hf_logits(model, tokens):
  with torch.no_grad():
    return model(torch.from_numpy(tokens.astype(np.int64))).logits.float().numpy()


def _jspec_logits(cfg, params, tokens):
  dtype = params["embed"]["table"].t.dtype
  cache = cache_lib.init(cfg, tokens.shape[0], tokens.shape[1], dtype)
  arch = model_lib.Arch(cfg, model_lib.Backend(dtype=jnp.dtype(dtype).name))
  logits, cache = model_lib.forward(arch, params, jnp.asarray(tokens), cache)
  assert list(np.asarray(cache.lengths)) == [tokens.shape[1]] * tokens.shape[0]
  return np.asarray(logits)


def _converted(model, tmp_path, dtype="float32", **save_kwargs):
  model.save_pretrained(tmp_path, safe_serialization=True, **save_kwargs)
  cfg, tensors = convert.load_checkpoint(tmp_path, dtype=dtype)
  return cfg, model_lib.params_from_tensors(cfg, tensors)


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    dict(),  # 6 query heads on 2 kv heads, head_dim 14 != 58 / 6, untied head
    dict(num_key_value_heads=3, tie_word_embeddings=True, rope_theta=1e6, num_hidden_layers=3),
    dict(hidden_size=30, head_dim=10, num_attention_heads=5, num_key_value_heads=1,
         intermediate_size=41),  # multi-query attention
], ids=["gqa3-untied", "gqa2-tied", "mqa"])
def test_logits_match_transformers(make_hf_model, tmp_path, overrides):
  hf = make_hf_model(**overrides)
  cfg, params = _converted(hf, tmp_path)
  assert cfg.tie_word_embeddings == hf.config.tie_word_embeddings
  assert ("head" in params) != cfg.tie_word_embeddings
  # The checkpoint fills exactly the tree the modules define.
  chex.assert_trees_all_equal_shapes_and_dtypes(params,
                                                model_lib.init_params(cfg, jax.random.key(0)))
  tokens = _tokens(cfg.vocab_size)
  ref = _hf_logits(hf, tokens)
  got = _jspec_logits(cfg, params, tokens)
  assert np.abs(ref).max() > 1.0  # the comparison means something
  np.testing.assert_allclose(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_sharded_checkpoint_matches(make_hf_model, tmp_path):
  hf = make_hf_model(seed=1)
  cfg, params = _converted(hf, tmp_path, max_shard_size="40KB")
  assert (tmp_path / "model.safetensors.index.json").is_file()
  tokens = _tokens(cfg.vocab_size, batch=1, length=37)
  np.testing.assert_allclose(_jspec_logits(cfg, params, tokens), _hf_logits(hf, tokens),
                             atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_bf16_checkpoint_loads_exactly(make_hf_model, tmp_path):
  # numpy has no bfloat16: a bf16 safetensors file must still load, and upcast exactly.
  hf = make_hf_model(seed=2)
  with torch.no_grad():
    for p in hf.parameters():
      p.copy_(p.bfloat16().float())  # fp32 reference holding bf16-exact weights
  # Only the weights go to bf16: `.to(bfloat16)` on the reference would round
  # RoPE's inv_freq buffer as well.
  cfg, params = _converted(copy.deepcopy(hf).to(torch.bfloat16), tmp_path, dtype="float32")
  assert (tmp_path / "config.json").read_text().count("bfloat16")
  embed = hf.model.embed_tokens.weight.detach().numpy()
  np.testing.assert_array_equal(np.asarray(params["embed"]["table"].t), embed)
  q = hf.model.layers[1].self_attn.q_proj.weight.detach().numpy()
  np.testing.assert_array_equal(np.asarray(params["layers"]["1"]["attn"]["q"]["w"].w), q.T)
  tokens = _tokens(cfg.vocab_size, batch=1, length=53)
  np.testing.assert_allclose(_jspec_logits(cfg, params, tokens), _hf_logits(hf, tokens),
                             atol=1e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_params_close_to_fp32(make_hf_model, tmp_path, dtype):
  hf = make_hf_model(seed=3)
  hf.save_pretrained(tmp_path, safe_serialization=True)
  cfg, params32 = _converted(hf, tmp_path, dtype="float32")
  _, params = _converted(hf, tmp_path, dtype=dtype)
  assert params["layers"]["0"]["mlp"]["up"]["w"].w.dtype == jnp.dtype(dtype)
  tokens = _tokens(cfg.vocab_size, batch=1, length=61)
  ref = _jspec_logits(cfg, params32, tokens)
  got = _jspec_logits(cfg, params, tokens)
  # Loose: bf16 keeps 8 bits of mantissa through two layers.
  assert np.abs(got - ref).max() < 0.1 * np.abs(ref).max()
  assert (got.argmax(-1) == ref.argmax(-1)).mean() > 0.9


# Layer-level checks: each Flax module against its HF twin, same weights.

def _cfg(hf):
  return config_lib.from_hf_dict(hf.config.to_dict())


def _np(t):
  return t.detach().float().numpy()


def _linear(linear):
  bias = None if linear.bias is None else jnp.asarray(_np(linear.bias))
  return modules.Linear(weights.Dense(jnp.asarray(_np(linear.weight).T)), bias)


def _random(cfg):
  return modules.RandomInit(nnx.Rngs(0), jnp.float32, 0.02)


def test_rmsnorm_matches(make_hf_model):
  hf = make_hf_model()
  norm = hf.model.layers[0].input_layernorm
  x = np.random.default_rng(0).normal(size=(2, 7, 58)).astype(np.float32) * 3
  with torch.no_grad():
    ref = _np(norm(torch.from_numpy(x)))
  got = modules.RMSNorm(jnp.asarray(_np(norm.weight)), hf.config.rms_norm_eps)(jnp.asarray(x))
  np.testing.assert_allclose(np.asarray(got), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_rope_matches(make_hf_model):
  hf = make_hf_model()
  cfg = _cfg(hf)
  rng = np.random.default_rng(1)
  q = rng.normal(size=(2, T, 6, 14)).astype(np.float32)  # [B, T, N, H]
  k = rng.normal(size=(2, T, 2, 14)).astype(np.float32)
  positions = np.stack([np.arange(T), np.arange(T) + 997]).astype(np.int32)  # row 2 offset
  with torch.no_grad():
    cos, sin = hf.model.rotary_emb(torch.from_numpy(q), torch.from_numpy(positions).long())
    ref_q, ref_k = modeling_qwen2.apply_rotary_pos_emb(
        torch.from_numpy(q).transpose(1, 2), torch.from_numpy(k).transpose(1, 2), cos, sin)
  got_q = model_lib.rope(jnp.asarray(q), jnp.asarray(positions), cfg.rope_theta)
  got_k = model_lib.rope(jnp.asarray(k), jnp.asarray(positions), cfg.rope_theta)
  # float32 angles at position ~1300 differ by an ulp (~1e-4 rad) between the
  # two ways of computing them; a wrong rotation is off by O(1).
  np.testing.assert_allclose(np.asarray(got_q), _np(ref_q.transpose(1, 2)), atol=1e-4)
  np.testing.assert_allclose(np.asarray(got_k), _np(ref_k.transpose(1, 2)), atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("kv_heads", [2, 3])
def test_attention_matches(make_hf_model, kv_heads):
  hf = make_hf_model(num_key_value_heads=kv_heads)
  hf.config._attn_implementation = "eager"  # pylint: disable=protected-access
  cfg = _cfg(hf)
  attn = hf.model.layers[0].self_attn
  t = 89
  x = np.random.default_rng(2).normal(size=(2, t, cfg.hidden_size)).astype(np.float32)
  positions = np.tile(np.arange(t), (2, 1))
  mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
  with torch.no_grad():
    cos_sin = hf.model.rotary_emb(torch.from_numpy(x), torch.from_numpy(positions).long())
    ref, _ = attn(torch.from_numpy(x), cos_sin, mask)
  module = modules.Attention(cfg, _random(cfg))
  for name in ("q", "k", "v", "o"):
    setattr(module, name, _linear(getattr(attn, f"{name}_proj")))
  cache = cache_lib.init(cfg, 2, t + 5)
  got, k_buf, _ = module(jnp.asarray(x), jnp.asarray(positions, jnp.int32), cache.k, cache.v, 0,
                         jnp.zeros((2,), jnp.int32))
  np.testing.assert_allclose(np.asarray(got), _np(ref), atol=1e-5, rtol=1e-4)
  assert np.abs(np.asarray(k_buf[0, :, :t])).sum() > 0  # keys were written to the cache


@pytest.mark.slow
def test_mlp_matches(make_hf_model):
  hf = make_hf_model()
  cfg = _cfg(hf)
  mlp = hf.model.layers[1].mlp
  assert isinstance(mlp, modeling_qwen2.Qwen2MLP)
  x = np.random.default_rng(3).normal(size=(2, 11, cfg.hidden_size)).astype(np.float32)
  with torch.no_grad():
    ref = _np(mlp(torch.from_numpy(x)))
  module = modules.MLP(cfg, _random(cfg))
  for name in ("gate", "up", "down"):
    setattr(module, name, _linear(getattr(mlp, f"{name}_proj")))
  got = module(jnp.asarray(x))
  np.testing.assert_allclose(np.asarray(got), ref, atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_a_tensor_of_the_wrong_shape_or_name_is_named():
  cfg = config_lib.Qwen2Config(vocab_size=13, hidden_size=8, intermediate_size=6, num_layers=2,
                               num_heads=2, num_kv_heads=1, head_dim=4)
  good = {model_lib.path_name(path): np.asarray(w.w if isinstance(w, weights.Dense) else
                                                w.t if isinstance(w, weights.Table) else w)
          for path, w in jax.tree_util.tree_flatten_with_path(
              model_lib.init_params(cfg, jax.random.key(0)), is_leaf=weights.is_leaf)[0]}
  assert "layers/1/attn/q/w" in good and good["layers/1/attn/q/w"].shape == (8, 8)
  model_lib.params_from_tensors(cfg, good)
  bad = {**good, "layers/1/mlp/up/w": np.zeros((6, 8), np.float32)}  # transposed
  with pytest.raises(ValueError, match=r"'layers/1/mlp/up/w' has shape \(6, 8\)"):
    model_lib.params_from_tensors(cfg, bad)
  with pytest.raises(ValueError, match="missing.*norm/scale"):
    model_lib.params_from_tensors(cfg, {k: v for k, v in good.items() if k != "norm/scale"})
  with pytest.raises(ValueError, match="unexpected.*layers/2"):
    model_lib.params_from_tensors(cfg, {**good, "layers/2/norm/scale": good["norm/scale"]})


@pytest.mark.parametrize("d", [896, 1536])
def test_rmsnorm_gives_a_row_the_same_bits_whatever_rows_share_the_call(d):
  # A one-row decode step and a several-row verify norm the same row: with
  # XLA's own reduction (jnp.mean) a row's sum depended on how many rows
  # were reduced together (an ulp apart in about a quarter of these rows at
  # the real widths), enough to flip a near tie between the two methods.
  rng = np.random.default_rng(d)
  norm = modules.RMSNorm(jnp.asarray(rng.standard_normal(d).astype(np.float32)), 1e-6)
  run = jax.jit(lambda x: norm(x))
  for trial in range(8):
    x = rng.standard_normal((17, d)).astype(np.float32)
    one = np.asarray(run(jnp.asarray(x[:1])))[0]
    for m in (2, 5, 9, 17):
      np.testing.assert_array_equal(np.asarray(run(jnp.asarray(x[:m])))[0], one)
  ref = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6)
  np.testing.assert_allclose(np.asarray(run(jnp.asarray(x))), ref * np.asarray(norm.scale[...]),
                             rtol=2e-6, atol=1e-6)


def test_row_sum_adds_every_element_once():
  for d in (1, 2, 3, 7, 64, 1536):
    x = np.arange(1, d + 1, dtype=np.float32)[None]  # exact sums below 2**24
    assert float(model_lib.row_sum(jnp.asarray(x))[0, 0]) == d * (d + 1) / 2


def test_a_verify_gives_the_one_row_steps_logits_bit_for_bit_at_a_real_width():
  # The 1.5B's width (1536) and its kernels' storage, two layers: five
  # one-token steps and one five-token verify from the same cache give the
  # same logits bit for bit, so greedy speculative output is target-only's
  # even at a near tie. (With jnp.mean in RMSNorm they were 7e-6 apart.)
  if not cpu_kernels.available():
    pytest.skip(f"kernel unavailable: {cpu_kernels.unavailable_reason()}")
  cfg = dataclasses.replace(shapes.KNOWN["qwen2.5-coder"][0], num_layers=2, vocab_size=4096)
  m = bundle_lib.prepare(cfg, model_lib.init_params(cfg, jax.random.key(0)), "target",
                         jspec.Settings(), consume=True)
  fwd = jax.jit(lambda p, t, c: model_lib.forward(m.arch, p, t, c))
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 4096, (1, 12)), jnp.int32)
  _, cache = fwd(m.params, tokens[:, :7], cache_lib.init(cfg, 1, 64))
  verify, _ = fwd(m.params, tokens[:, 7:], cache)  # [1, 5, V]
  steps = []
  for i in range(7, 12):
    logits, cache = fwd(m.params, tokens[:, i:i + 1], cache)
    steps.append(np.asarray(logits)[0, 0])
  np.testing.assert_array_equal(np.stack(steps), np.asarray(verify)[0])
