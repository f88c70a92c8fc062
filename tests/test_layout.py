"""jspec.layout: dense weights stored [out, in] compute what [in, out] ones do, and generate picks the layout."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
import tiny
from jspec import api
from jspec import cache as cache_lib
from jspec import config as config_lib
from jspec import cpu_kernels
from jspec import layout
from jspec import model
from jspec import quant


def _copy(params):
  return jax.tree.map(lambda x: x, params)  # new dicts, the same arrays


def _forward(params, tokens):
  cache = cache_lib.init(tiny.TARGET, tokens.shape[0], 32)
  return model.forward(params, tiny.TARGET, jnp.asarray(tokens), cache)


@pytest.mark.parametrize("t", [1, 5, 17])
def test_rows_layout_gives_the_same_logits_and_cache(t):
  params = model.init_params(tiny.TARGET, jax.random.key(0), scale=0.5)
  tokens = np.random.RandomState(t).randint(0, tiny.VOCAB, size=(2, t)).astype(np.int32)
  cols_logits, cols_cache = _forward(params, tokens)
  rows = layout.convert(_copy(params), "rows")
  assert layout.of(rows) == "rows" and layout.of(params) == "cols"
  rows_logits, rows_cache = _forward(rows, tokens)
  np.testing.assert_allclose(rows_logits, cols_logits, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(rows_cache.k, cols_cache.k, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(rows_cache.v, cols_cache.v, rtol=1e-5, atol=1e-5)


def test_convert_works_in_place_and_round_trips_exactly():
  params = model.init_params(tiny.TARGET, jax.random.key(1))
  before = _copy(params)
  same = layout.convert(params, "rows")
  assert same is params  # in place: whoever holds the dict sees the new layout
  gate = params["layers_1"]["mlp"]["gate_proj"]
  assert set(gate) == {"weight"} and gate["weight"].shape == (tiny.TARGET.intermediate_size,
                                                              tiny.TARGET.hidden_size)
  np.testing.assert_array_equal(gate["weight"], before["layers_1"]["mlp"]["gate_proj"]["kernel"].T)
  q = params["layers_0"]["self_attn"]["q_proj"]
  assert set(q) == {"weight", "bias"}
  # Norm weights are 1-D `weight`s already: left alone.
  np.testing.assert_array_equal(params["layers_0"]["input_layernorm"]["weight"],
                                before["layers_0"]["input_layernorm"]["weight"])
  layout.convert(params, "cols")
  assert jax.tree.structure(params) == jax.tree.structure(before)
  jax.tree.map(np.testing.assert_array_equal, params, before)


def test_unknown_layout_is_refused():
  params = model.init_params(tiny.TARGET, jax.random.key(2))
  with pytest.raises(ValueError, match="unknown layout 'transposed': expected one of"):
    layout.convert(params, "transposed")


def test_generate_lays_the_target_out_for_its_method_without_the_kernel(monkeypatch):
  monkeypatch.setattr(cpu_kernels, "available", lambda: False)
  bundle = tiny.pair(3)
  prompt = tiny.prompt(3, 6)
  first = jspec.generate(bundle, prompt, max_new_tokens=12, method="target")
  assert layout.of(bundle.target.params) == "rows" and first.stats["relayout_s"] > 0
  again = jspec.generate(bundle, prompt, max_new_tokens=12, method="target")
  assert again.stats["relayout_s"] == 0.0 and again.token_ids == first.token_ids
  spec = jspec.generate(bundle, prompt, max_new_tokens=12, gamma=3)
  assert layout.of(bundle.target.params) == "cols" and spec.stats["relayout_s"] > 0
  assert spec.token_ids == first.token_ids
  # A batch multiplies several rows per step: [in, out] even for the target alone.
  batch = jspec.generate(bundle, [prompt, prompt[:3]], max_new_tokens=12, method="target")
  assert layout.of(bundle.target.params) == "cols"
  assert batch[0].token_ids == first.token_ids


def test_without_the_kernel_only_a_single_target_only_prompt_is_laid_out_by_rows(monkeypatch):
  monkeypatch.setattr(cpu_kernels, "available", lambda: False)
  assert api.target_layout("target", 1, "cpu") == "rows"
  assert api.target_layout("target", 2, "cpu") == "cols"
  assert api.target_layout("model", 1, "cpu") == "cols"
  assert api.target_layout("prompt_lookup", 1, "cpu") == "cols"
  assert api.target_layout("target", 1, "gpu") == "cols"  # measured on XLA CPU only


def test_with_the_kernel_every_cpu_method_is_packed(monkeypatch):
  monkeypatch.setattr(cpu_kernels, "available", lambda: True)
  for method, batch in (("target", 1), ("target", 2), ("model", 1), ("prompt_lookup", 1)):
    assert api.target_layout(method, batch, "cpu") == "packed"
  assert api.target_layout("model", 1, "gpu") == "cols"


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("t", [1, 9])
def test_packed_layout_gives_the_same_logits_and_round_trips_exactly(tied, t):
  cfg = config_lib.Qwen2Config(**{**tiny.PACKABLE_TARGET.to_dict(), "tie_word_embeddings": tied})
  params = model.init_params(cfg, jax.random.key(t), scale=0.3)
  before = _copy(params)
  tokens = jnp.asarray(np.random.RandomState(t).randint(0, cfg.vocab_size, size=(2, t)), jnp.int32)
  cols_logits, cols_cache = model.forward(params, cfg, tokens, cache_lib.init(cfg, 2, 32))
  packed = layout.convert(params, "packed")
  assert layout.of(packed) == "packed"
  assert set(packed["layers_1"]["self_attn"]["k_proj"]) == {"panels", "bias"}
  assert ("panels" in packed["embed_tokens"]) == tied and ("lm_head_panels" in packed) != tied
  packed_logits, packed_cache = model.forward(packed, cfg, tokens, cache_lib.init(cfg, 2, 32))
  np.testing.assert_allclose(packed_logits, cols_logits, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(packed_cache.k, cols_cache.k, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(packed_cache.v, cols_cache.v, rtol=1e-5, atol=1e-5)
  layout.convert(packed, "rows")
  layout.convert(packed, "cols")
  assert jax.tree.structure(packed) == jax.tree.structure(before)
  jax.tree.map(np.testing.assert_array_equal, packed, before)


def test_generate_packs_the_target_and_every_method_agrees_with_xla_layouts(monkeypatch):
  if not cpu_kernels.available():
    pytest.skip(f"no CPU kernel here: {cpu_kernels.unavailable_reason()}")
  bundle = tiny.packable_pair(4)
  prompt = np.random.RandomState(4).randint(0, tiny.PACKABLE_VOCAB, size=7).tolist()
  first = jspec.generate(bundle, prompt, max_new_tokens=16, method="target")
  assert layout.of(bundle.target.params) == "packed" and first.stats["relayout_s"] > 0
  spec = jspec.generate(bundle, prompt, max_new_tokens=16, gamma=4)
  lookup = jspec.generate(bundle, prompt, max_new_tokens=16, method="prompt_lookup")
  assert spec.stats["relayout_s"] == 0.0
  assert spec.token_ids == lookup.token_ids == first.token_ids
  monkeypatch.setattr(cpu_kernels, "available", lambda: False)
  xla = jspec.generate(bundle, prompt, max_new_tokens=16, gamma=4)
  assert layout.of(bundle.target.params) == "cols" and xla.token_ids == first.token_ids


@pytest.mark.parametrize("int8", [False, True])
def test_packed_layers_run_as_one_loop_with_the_unrolled_results(int8, monkeypatch):
  # Kernel-packed layers compile one layer per forward (`model._scan_layers`,
  # the kernels picking each layer's weights by index): the logits and cache
  # must be the unrolled layers' (fp32: bit for bit), after a chunk and after
  # a second one that reads the first from the cache.
  if not cpu_kernels.available() or (int8 and cpu_kernels.int8_kind() is None):
    pytest.skip("no CPU kernel for this here")
  cfg = config_lib.Qwen2Config(**{**tiny.PACKABLE_TARGET.to_dict(), "num_layers": 3})
  params = model.init_params(cfg, jax.random.key(3), scale=0.3)
  params = quant.pack(quant.quantize(params)) if int8 else layout.convert(params, "packed")
  tokens = jnp.asarray(np.random.RandomState(3).randint(0, cfg.vocab_size, size=(2, 6)), jnp.int32)

  def run(first, second, cache):
    logits, cache = model.forward(params, cfg, first, cache)
    more, cache = model.forward(params, cfg, second, cache)
    return logits, more, cache

  # XLA's attention in both, so fp32 can be compared bit for bit: the loop's
  # own attention kernel is checked against it in test_cpu_attention.
  monkeypatch.setattr(model, "FUSED_ATTENTION", False)
  results = {}
  for scan in (False, True):
    monkeypatch.setattr(model, "SCAN_LAYERS", scan)
    fn = jax.jit(lambda *args: run(*args))  # a new function: jit's cache would keep the first trace
    args = (tokens[:, :4], tokens[:, 4:], cache_lib.init(cfg, 2, 16))
    text = fn.lower(*args).as_text()
    kernel = {"avx2": cpu_kernels.TARGET_S8, "vnni": cpu_kernels.TARGET_INT8}.get(
        cpu_kernels.int8_kind()) if int8 else cpu_kernels.TARGET
    assert (cpu_kernels.LAYER_TARGETS[kernel] in text) == scan
    results[scan] = fn(*args)
  if int8:  # XLA compiles the elementwise work around the int8 kernel differently in the loop
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5),
                 results[False], results[True])
  else:
    jax.tree.map(np.testing.assert_array_equal, results[False], results[True])


@pytest.mark.parametrize("form", ["cols", "packed", "int8"])
def test_a_fresh_prefill_attends_to_its_chunk_with_the_same_results(form):
  # `fresh` (prefill: every cache empty) attends over the chunk alone, not
  # every slot: the logits and cache must be the plain forward's (to float
  # rounding: XLA sums the softmax over fewer slots), whether the layers are
  # unrolled (cols) or one loop (packed, int8). 60
  # tokens: past FUSED_MAX_T, where the loop attends with XLA, not the kernel.
  if form != "cols" and (not cpu_kernels.available() or
                         (form == "int8" and cpu_kernels.int8_kind() is None)):
    pytest.skip("no CPU kernel for this here")
  cfg = config_lib.Qwen2Config(**{**tiny.PACKABLE_TARGET.to_dict(), "num_layers": 3})
  params = model.init_params(cfg, jax.random.key(5), scale=0.3)
  if form == "packed":
    params = layout.convert(params, "packed")
  elif form == "int8":
    params = quant.pack(quant.quantize(params))
  tokens = jnp.asarray(np.random.RandomState(5).randint(0, cfg.vocab_size, size=(2, 60)), jnp.int32)
  results = {}
  for fresh in (False, True):
    fn = jax.jit(lambda p, x, c, fresh=fresh: model.forward(p, cfg, x, c, fresh=fresh))
    results[fresh] = fn(params, tokens, cache_lib.init(cfg, 2, 96))
  # int8: that rounding can move an activation across an int8 step, which
  # moves a position's logits by a few hundredths (0.04 seen).
  atol = 0.1 if form == "int8" else 1e-4
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=atol),
               results[False], results[True])
