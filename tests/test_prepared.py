"""The prepared store (`jspec.prepared`): a prepared model written once and mapped back as it was."""

from __future__ import annotations

import json
import struct

import jax
import numpy as np
import pytest
import safetensors

import jspec
from jspec import cpu_kernels
from jspec import prepared
from jspec import weights
from tests import tiny

KEY = "k" * 64


def _leaves(model):
  return jax.tree.flatten_with_path(model.params)


@pytest.fixture(scope="module")
def bundle():
  return tiny.packable_pair(seed=3)


@pytest.mark.parametrize("role", ["target", "draft"])
def test_round_trip_is_the_same_tree_and_bytes(bundle, tmp_path, role):
  model = getattr(bundle, role)
  path = prepared.save(tmp_path / "m.safetensors", model, KEY)
  back = prepared.load(path, KEY)
  assert back.cfg == model.cfg and back.backend == model.backend
  (want, want_tree), (got, got_tree) = _leaves(model), _leaves(back)
  assert got_tree == want_tree  # the same typed leaves, static fields included
  for (p, a), (_, b) in zip(want, got):
    assert a.dtype == b.dtype and a.shape == b.shape, p
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(p))
  if cpu_kernels.available():  # the forms the kernels read were stored, not rebuilt
    kinds = {type(x).__name__ for x in jax.tree.leaves(back.params, is_leaf=weights.is_leaf)}
    assert kinds & {"Panels", "Int8Panels", "Int4Panels"}, kinds


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="aliasing host memory is CPU's")
@pytest.mark.parametrize("make", [tiny.packable_pair, tiny.pair], ids=["packable", "odd-sizes"])
def test_arrays_are_the_mapped_pages_not_copies(tmp_path, make):
  model = make(seed=2).target  # odd sizes: arrays whose bytes are no multiple of ALIGN
  path = prepared.save(tmp_path / "m.safetensors", model, KEY)
  back = prepared.load(path, KEY)
  _, n, header = _header(path)
  start = {name: 8 + n + entry["data_offsets"][0] for name, entry in header.items()
           if name != "__metadata__"}
  leaves, _ = jax.tree.flatten_with_path(back.params)
  # Each array's address minus its offset in the file is one number, the
  # mapping's base, only if none of them was copied.
  bases = set()
  for path_, x in leaves:
    name = "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path_)
    name = name.rsplit("/", 1)[0] + ":" + name.rsplit("/", 1)[1] if name not in start else name
    bases.add(x.unsafe_buffer_pointer() - start[name])
  assert len(bases) == 1, sorted(bases)[:4]


def test_a_safetensors_reader_sees_every_array(bundle, tmp_path):
  path = prepared.save(tmp_path / "m.safetensors", bundle.draft, KEY)
  with safetensors.safe_open(str(path), framework="numpy") as f:
    names = [n for n in f.keys() if not n.startswith("__pad__/")]
    assert f.metadata()["key"] == KEY
  assert "embed/table:panels" in names or "embed/table:q" in names, names


def test_generation_from_the_mapped_file_is_identical(bundle, tmp_path):
  t = prepared.load(prepared.save(tmp_path / "t.safetensors", bundle.target, KEY), KEY)
  d = prepared.load(prepared.save(tmp_path / "d.safetensors", bundle.draft, KEY), KEY)
  mapped = jspec.Bundle(t, d, None)
  for temperature in (0.0, 1.0):
    want = jspec.generate(bundle, tiny.prompt(1, 7, tiny.PACKABLE_VOCAB), max_new_tokens=12,
                          temperature=temperature, seed=5)
    got = jspec.generate(mapped, tiny.prompt(1, 7, tiny.PACKABLE_VOCAB), max_new_tokens=12,
                         temperature=temperature, seed=5)
    assert got.token_ids == want.token_ids


def _header(path):
  data = path.read_bytes()
  (n,) = struct.unpack("<Q", data[:8])
  return data, n, json.loads(data[8:8 + n])


def _rewrite(path, data, n, header):
  text = json.dumps(header, separators=(",", ":")).encode()
  assert len(text) <= n
  path.write_bytes(data[:8] + text.ljust(n, b" ") + data[8 + n:])


@pytest.mark.parametrize("damage", ["other-key", "truncated", "garbled-length", "unknown-leaf",
                                    "moved-tensor", "not-json", "other-format"])
def test_damaged_or_foreign_files_are_refused(bundle, tmp_path, damage):
  path = prepared.save(tmp_path / "m.safetensors", bundle.target, KEY)
  key = KEY
  data, n, header = _header(path)
  if damage == "other-key":
    key = "x" * 64
  elif damage == "truncated":
    path.write_bytes(data[:len(data) - 100])
  elif damage == "garbled-length":
    path.write_bytes(struct.pack("<Q", 10**12) + data[8:])
  elif damage == "unknown-leaf":  # a tree that names any other class is refused, never built
    header["__metadata__"]["tree"] = header["__metadata__"]["tree"].replace(
        '"leaf": "Panels"', '"leaf": "Popen"')
    assert "Popen" in header["__metadata__"]["tree"]
    _rewrite(path, data, n, header)
  elif damage == "moved-tensor":
    name = next(k for k in header if k != "__metadata__" and not k.startswith("__pad__"))
    start, stop = header[name]["data_offsets"]
    header[name]["data_offsets"] = [start + 4, stop + 4]
    _rewrite(path, data, n, header)
  elif damage == "not-json":
    path.write_bytes(data[:8] + b"{" * n + data[8 + n:])
  elif damage == "other-format":
    header["__metadata__"]["format"] = "jspec"
    _rewrite(path, data, n, header)
  with pytest.raises(prepared.PreparedError, match=str(path)):
    prepared.load(path, key)


def test_key_changes_with_what_the_model_is_made_from():
  base = prepared.key("a" * 64, "target", "exact", jspec.Settings())
  assert base == prepared.key("a" * 64, "target", "exact", jspec.Settings())
  for other in (prepared.key("b" * 64, "target", "exact", jspec.Settings()),
                prepared.key("a" * 64, "draft", "exact", jspec.Settings()),
                prepared.key("a" * 64, "target", "float32", jspec.Settings()),
                prepared.key("a" * 64, "target", "exact", jspec.Settings(draft_int8=False))):
    assert other != base


def test_an_interrupted_save_leaves_no_file_and_no_temporary(bundle, tmp_path, monkeypatch):
  path = tmp_path / "m.safetensors"
  calls = []
  real = np.ascontiguousarray

  def dies_midway(a, *args, **kwargs):
    calls.append(1)
    if len(calls) == 3:  # some arrays written, the rest not
      raise KeyboardInterrupt
    return real(a, *args, **kwargs)

  monkeypatch.setattr(np, "ascontiguousarray", dies_midway)
  with pytest.raises(KeyboardInterrupt):
    prepared.save(path, bundle.target, KEY)
  assert len(calls) == 3 and list(tmp_path.iterdir()) == []
