"""Loading streams: a checkpoint's tensors are mapped and converted one at a time, never all held.

`jspec.load` maps a jspec file's tensors (`convert.store.load(mapped=True)`)
and `bundle.prepare(consume=True)` converts each and drops it, so the float32
draft (2.5 GB for the real pair) is never in memory whole before its int8
copy exists (docs/decisions-compact.md, "Peak memory of the real pair").
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from convert import config as config_lib
from convert import gguf_blocks
from convert import keys
from convert import store
from jspec import bundle as bundle_lib
from jspec import loading
from jspec import model as model_lib
from jspec import weights
from tests import tiny

# A draft of many equal layers, so that one matrix is a small part of the whole.
DRAFT = config_lib.Qwen2Config(
    vocab_size=tiny.PACKABLE_VOCAB, hidden_size=128, intermediate_size=256, num_layers=6,
    num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=1e4, eos_token_ids=(),
    tie_word_embeddings=True)


def _tensors(cfg, seed, dtype=np.float32):
  rng = np.random.default_rng(seed)
  return {name: (rng.normal(0.0, 0.1, shape) + (1.0 if "norm" in name else 0.0)).astype(dtype)
          for name, shape in keys.expected_shapes(cfg).items()}


def _float_bytes_live() -> int:
  return sum(a.nbytes for a in jax.live_arrays() if jnp.issubdtype(a.dtype, jnp.floating))


def test_the_draft_is_made_int8_one_float_matrix_at_a_time(tmp_path, monkeypatch):
  t_path = store.save(tmp_path / "t.safetensors", tiny.PACKABLE_TARGET,
                      _tensors(tiny.PACKABLE_TARGET, 0))
  d_tensors = _tensors(DRAFT, 1)
  d_path = store.save(tmp_path / "d.safetensors", DRAFT, d_tensors)
  matrices = [a.nbytes for a in d_tensors.values() if a.ndim == 2]
  total, largest = sum(a.nbytes for a in d_tensors.values()), max(matrices)
  assert total > 10 * largest

  baseline, held = [], []
  real_model, real_to_int8 = loading._model, weights.to_int8  # pylint: disable=protected-access

  def model(path, *args, **kwargs):
    if str(path) == str(d_path):  # the target is prepared: what the draft adds counts
      baseline.append(_float_bytes_live())
    return real_model(path, *args, **kwargs)

  def to_int8(w, *args, **kwargs):
    held.append(_float_bytes_live() - baseline[-1])
    return real_to_int8(w, *args, **kwargs)

  monkeypatch.setattr(loading, "_model", model)
  monkeypatch.setattr(weights, "to_int8", to_int8)
  bundle = jspec.load(t_path, d_path, progress=False, draft_int8=True)
  assert len(held) == len(matrices)  # every draft matrix went through the hook
  # What is on the heap as each matrix is quantized: its own float copy at
  # most, and the norms and scales made so far; all of it were the whole draft.
  assert max(held) < 3 * largest, (max(held), largest, total)
  assert {type(x).__name__ for x in jax.tree.leaves(
      bundle.draft.params["layers"], is_leaf=weights.is_leaf)} & {"Int8", "Int8Panels"}
  # The same values as a bundle made from the whole float draft at once.
  t_loaded = {k: jnp.asarray(v) for k, v in _tensors(tiny.PACKABLE_TARGET, 0).items()}
  whole = jspec.Bundle(*(
      bundle_lib.prepare(cfg, model_lib.params_from_tensors(cfg, t), role,
                         jspec.Settings(draft_int8=True))
      for cfg, t, role in ((tiny.PACKABLE_TARGET, t_loaded, "target"),
                           (DRAFT, {k: jnp.asarray(v) for k, v in d_tensors.items()}, "draft"))))
  for role in ("target", "draft"):
    (got, got_tree), (want, want_tree) = (jax.tree.flatten_with_path(getattr(b, role).params)
                                          for b in (bundle, whole))
    assert got_tree == want_tree
    for (p, a), (_, b) in zip(got, want):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{role} {p}")
  assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(bundle.draft.params))


def test_matrices_kept_as_they_are_become_device_arrays(tmp_path):
  # Without kernels and in float, no conversion makes a new array: each view
  # of the mapped file must still leave it, not travel into the bundle.
  t_path = store.save(tmp_path / "t.safetensors", tiny.PACKABLE_TARGET,
                      _tensors(tiny.PACKABLE_TARGET, 0))
  d_path = store.save(tmp_path / "d.safetensors", DRAFT, _tensors(DRAFT, 1))
  bundle = jspec.load(t_path, d_path, progress=False, kernels=False, draft_int8=False)
  for role in ("target", "draft"):
    leaves = jax.tree.leaves(getattr(bundle, role).params)
    assert leaves and all(isinstance(x, jax.Array) for x in leaves), role


def _with_blocks(cfg, seed):
  """Tensors of `cfg` with its first layer's up matrix as int8 blocks (offsets) and down's (none)."""
  tensors = _tensors(cfg, seed)
  rng = np.random.default_rng(seed + 1)
  hf = keys.hf_shapes(cfg)
  for name, offset in (("layers/0/mlp/up/w", True), ("layers/0/mlp/down/w", False)):
    assert name in tensors, sorted(tensors)
    out, inp = hf[name]
    tensors[name] = gguf_blocks.Blocks(
        rng.integers(-127, 128, (out, inp), dtype=np.int8),
        rng.random((out, inp // 32), np.float32),
        rng.random((out, inp // 32), np.float32) if offset else None, 32)
  return tensors


@pytest.mark.parametrize("dtype", [None, "float32", "bfloat16"])
def test_mapped_tensors_are_the_read_ones(tmp_path, dtype):
  cfg = tiny.PACKABLE_TARGET
  path = store.save(tmp_path / "m.safetensors", cfg, _with_blocks(cfg, 3))
  cfg_read, read = store.load(path, dtype)
  cfg_mapped, mapped = store.load(path, dtype, mapped=True)
  assert cfg_read == cfg_mapped == cfg
  assert list(mapped) == list(read) and len(mapped) == len(read)
  for name, want in read.items():
    got = mapped[name]
    if isinstance(want, gguf_blocks.Blocks):
      assert got.block == want.block
      pairs = [(got.q, want.q), (got.scale, want.scale), (got.offset, want.offset)]
    else:
      pairs = [(got, want)]
    for g, w in pairs:
      assert (g is None) == (w is None), name
      if w is not None:
        assert g.dtype == w.dtype and g.shape == w.shape, name
        np.testing.assert_array_equal(g, w, err_msg=name)
  with pytest.raises(KeyError):
    mapped["nope"]  # pylint: disable=pointless-statement


def test_a_truncated_file_fails_before_any_tensor_is_used(tmp_path):
  path = store.save(tmp_path / "m.safetensors", tiny.PACKABLE_TARGET,
                    _tensors(tiny.PACKABLE_TARGET, 4))
  path.write_bytes(path.read_bytes()[:-100])
  with pytest.raises(keys.ConvertError, match="truncated|corrupted"):
    store.load(path, None, mapped=True)


def test_a_view_survives_the_file_being_replaced(tmp_path):
  cfg = tiny.PACKABLE_TARGET
  first = _tensors(cfg, 5)
  path = store.save(tmp_path / "m.safetensors", cfg, first)
  _, mapped = store.load(path, None, mapped=True)
  store.save(path, cfg, _tensors(cfg, 6))  # renamed over it, as a rebuild does
  name = next(iter(mapped))
  np.testing.assert_array_equal(mapped[name], first[name])  # the file that was checked


def test_tall_matrices_are_quantized_and_packed_in_slices_to_the_same_bits(monkeypatch):
  """A vocabulary-sized table or head goes through int8 in slices of its rows, with the one-call bits.

  Loading the real draft quantized its 150k-row table and head whole: a
  float32 copy and temporaries of each beside its mapped pages, the load's
  peak (docs/decisions-compact.md, "Peak memory of a first run").
  """
  rng = np.random.default_rng(0)
  table = rng.normal(0.0, 0.1, (640, 48)).astype(np.float32)  # [V, D]
  table[7] = 0.0  # a zero row keeps scale 1
  calls = []
  real = weights._quantize_rows  # pylint: disable=protected-access
  monkeypatch.setattr(weights, "_quantize_rows", lambda m: calls.append(m.shape) or real(m))
  for leaf in (weights.Table(table), weights.Table(jnp.asarray(table)),
               weights.Dense(table.T.copy()), weights.Dense(jnp.asarray(table.T))):
    calls.clear()
    whole = weights._int8_rows(leaf, slice_bytes=1 << 30)  # pylint: disable=protected-access
    assert calls == [(640, 48)]
    calls.clear()
    sliced = weights._int8_rows(leaf, slice_bytes=100 * 4 * 48)  # pylint: disable=protected-access
    assert calls == [(100, 48)] * 6 + [(40, 48)]
    for a, b in zip(whole, sliced):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  q = whole[0]
  packed_whole = jspec.cpu_kernels.pack_int8(q)
  monkeypatch.setattr(jspec.cpu_kernels, "PACK_SLICE_BYTES", 96 * 48)  # 3 panels a slice
  packs = []
  real_pack = jspec.cpu_kernels._pack_int8  # pylint: disable=protected-access
  monkeypatch.setattr(jspec.cpu_kernels, "_pack_int8", lambda m: packs.append(m.shape) or real_pack(m))
  packed_sliced = jspec.cpu_kernels.pack_int8(q)
  assert packs == [(96, 48)] * 6 + [(64, 48)]
  for a, b in zip(packed_whole, packed_sliced):
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("tied", [True, False])
def test_a_cut_head_holds_no_float_rows_and_its_source_goes_first(monkeypatch, tied):
  """With a cut draft vocabulary, the kept rows are converted before the matrices, then their source.

  The lookup reads the source's mapped pages (the table, or an untied
  head): converting it next frees them before the other matrices are read,
  and no float copy of the kept rows stays alive while they are.
  """
  cfg = dataclasses.replace(DRAFT, tie_word_embeddings=tied)
  params = model_lib.params_from_tensors(cfg, {k: jnp.asarray(v) for k, v in
                                               _tensors(cfg, 1).items()})
  keep = 32
  source = params["embed"]["table"] if tied else params["head"]["w"]  # the leaf the rows come from
  seen = []
  real = weights.to_int8

  def to_int8(w, *args, **kwargs):
    rows_alive = any(a.shape == (keep, cfg.hidden_size) and jnp.issubdtype(a.dtype, jnp.floating)
                     for a in jax.live_arrays() if not a.is_deleted())
    seen.append((w.shape, w is source, rows_alive))
    return real(w, *args, **kwargs)

  monkeypatch.setattr(weights, "to_int8", to_int8)
  settings = jspec.Settings(draft_int8=True, draft_vocab=keep)
  prepared = bundle_lib.prepare(cfg, params, "draft", settings, consume=True,
                                ranking=list(range(cfg.vocab_size)))
  assert seen[0][:2] == ((cfg.hidden_size, keep), False)  # the kept rows
  assert seen[1][1]  # then the matrix they came from: the table, or the untied head
  assert not any(alive for _, _, alive in seen[1:]), seen
  assert np.asarray(prepared.params["vocab_ids"]).shape == (keep,)
