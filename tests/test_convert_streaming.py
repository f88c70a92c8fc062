"""Converting streams: `convert.convert_checkpoint` writes each tensor as it is made.

The file is laid out from the source's header first and each converted
tensor is written at its place and dropped, so the host holds a tensor or two
at a time (docs/decisions-compact.md, "Peak memory of the real pair"). The
file is the one the in-memory path (`convert.assemble` then `store.save`)
writes, and a conversion that fails leaves nothing behind.
"""

from __future__ import annotations

import json
import struct
import weakref

import numpy as np
import pytest

import convert
from convert import gguf_file
from convert import keys
from convert import store

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

# Rows of 64 and 96 values: whole blocks of 32. Symmetric and offset block
# types, BF16 (kept as it is in exact), F16 (widened) and plain float32.
QUANT = {"token_embd.weight": Q.Q4_1, "attn_q.weight": Q.Q8_0, "attn_k.weight": Q.Q5_0,
         "attn_v.weight": Q.Q5_1, "attn_output.weight": Q.BF16, "ffn_gate.weight": Q.Q4_0,
         "ffn_up.weight": Q.F16, "output.weight": Q.Q8_0}
SIZES = dict(hidden_size=64, head_dim=8, num_attention_heads=8, num_key_value_heads=2,
             intermediate_size=96, num_hidden_layers=4)


def _in_memory(src, out, dtype):
  """The file the eager path writes: every tensor converted and held, then saved."""
  source = convert.open_source(src)
  try:
    cfg, tensors = convert.assemble(source, dtype)
  finally:
    source.close()
  return store.save(out, cfg, tensors)


def _parts(path):
  """(header length, header, tensor names in header order, data bytes) of a safetensors file."""
  data = path.read_bytes()
  (n,) = struct.unpack("<Q", data[:8])
  header = json.loads(data[8:8 + n])
  return n, header, [k for k in header if k != "__metadata__"], data[8 + n:]


def _assert_same_file(a, b):
  """The same file but for the order of the metadata's keys, which safetensors itself varies."""
  assert _parts(a) == _parts(b)
  assert a.stat().st_size == b.stat().st_size


@pytest.fixture(scope="module")
def sources(tmp_path_factory, make_hf_model, write_gguf):
  """name -> checkpoint: GGUF files (quantized, tied), HF directories (float32, bfloat16, tied)."""
  import torch  # pylint: disable=import-outside-toplevel
  root = tmp_path_factory.mktemp("sources")
  hf = make_hf_model(seed=3, **SIZES)
  tied = make_hf_model(seed=4, tie_word_embeddings=True, **SIZES)
  out = {"gguf": write_gguf(root / "q.gguf", hf, quant=QUANT),
         "gguf-tied": write_gguf(root / "t.gguf", tied, quant=QUANT)}
  hf.save_pretrained(root / "hf", safe_serialization=True)
  hf.to(torch.bfloat16).save_pretrained(root / "hf-bf16", safe_serialization=True)
  tied.save_pretrained(root / "hf-tied", safe_serialization=True)  # writes no lm_head
  out.update(hf=root / "hf", **{"hf-bf16": root / "hf-bf16", "hf-tied": root / "hf-tied"})
  return out


@pytest.mark.parametrize("name,dtype", [
    ("gguf", "float32"), ("gguf", "exact"), ("gguf", "bfloat16"), ("gguf-tied", "exact"),
    ("hf", "float32"), ("hf", "exact"), ("hf-bf16", "exact"), ("hf-bf16", "float16"),
    ("hf-tied", "float32")])
def test_the_streamed_file_is_the_in_memory_one(sources, tmp_path, name, dtype):
  streamed = convert.convert_checkpoint(sources[name], tmp_path / "s.safetensors", dtype)
  eager = _in_memory(sources[name], tmp_path / "e.safetensors", dtype)
  _assert_same_file(streamed, eager)
  kinds = {v["dtype"] for k, v in _parts(streamed)[1].items() if k != "__metadata__"}
  if name.startswith("gguf") and dtype == "exact":
    assert kinds == {"F32", "BF16", "I8"}  # int8 blocks, offsets among them
    assert any(k.endswith(":offset") for k in _parts(streamed)[2])
  if name == "hf-bf16" and dtype == "exact":
    assert kinds == {"BF16"}
  store.load(streamed)  # and it reads back, checked against its config


def _with_head(src, dst, head_last, nudge=0.0):
  """A copy of a tied HF checkpoint that writes its head out too, in its file or a last shard."""
  import safetensors.numpy  # pylint: disable=import-outside-toplevel
  dst.mkdir()
  (dst / "config.json").write_bytes((src / "config.json").read_bytes())
  tensors = safetensors.numpy.load_file(src / "model.safetensors")
  head = {"lm_head.weight": tensors["model.embed_tokens.weight"] + np.float32(nudge)}
  if not head_last:  # one file: the head comes first, by name
    safetensors.numpy.save_file(dict(tensors, **head), dst / "model.safetensors")
    return dst
  safetensors.numpy.save_file(tensors, dst / "a.safetensors")
  safetensors.numpy.save_file(head, dst / "b.safetensors")
  weight_map = {name: "a.safetensors" for name in tensors}
  weight_map["lm_head.weight"] = "b.safetensors"
  (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
  return dst


@pytest.mark.parametrize("head_last", [False, True])
def test_a_tied_head_written_out_is_still_checked(sources, tmp_path, head_last):
  source = convert.open_source(_with_head(sources["hf-tied"], tmp_path / "ok", head_last))
  names = source.names
  source.close()
  assert (names.index("lm_head.weight") > names.index("model.embed_tokens.weight")) == head_last
  out = convert.convert_checkpoint(tmp_path / "ok", tmp_path / "ok.safetensors")
  _assert_same_file(out, _in_memory(sources["hf-tied"], tmp_path / "e.safetensors", "float32"))
  with pytest.raises(keys.ConvertError, match="lm_head.weight differs"):
    convert.convert_checkpoint(_with_head(sources["hf-tied"], tmp_path / "bad", head_last, 1.0),
                               tmp_path / "bad.safetensors")
  assert sorted(p.name for p in tmp_path.iterdir()) == ["bad", "e.safetensors", "ok",
                                                       "ok.safetensors"]


def _count_alive(monkeypatch):
  """Tracks every tensor `keys.convert_weight` makes; returns the most alive at once, as a list."""
  alive, most = [0], [0]
  real = keys.convert_weight

  def tracked(*args, **kwargs):
    most[0] = max(most[0], alive[0])  # those made before this one and still held
    path, value = real(*args, **kwargs)
    alive[0] += 1
    weakref.finalize(value, lambda: alive.__setitem__(0, alive[0] - 1))
    return path, value

  monkeypatch.setattr(keys, "convert_weight", tracked)
  return most


@pytest.mark.parametrize("name,dtype", [("gguf", "float32"), ("gguf", "exact"),
                                        ("hf", "float32")])
def test_converting_holds_a_tensor_at_a_time(sources, tmp_path, monkeypatch, name, dtype):
  source = convert.open_source(sources[name])
  count = len(source.names)
  source.close()
  assert count > 30  # the eager path would hold them all
  most = _count_alive(monkeypatch)
  convert.convert_checkpoint(sources[name], tmp_path / "s.safetensors", dtype)
  assert most[0] <= 1, f"{most[0]} converted tensors alive at once"
  eager = _count_alive(monkeypatch)  # the check itself sees the eager path hold them all
  _in_memory(sources[name], tmp_path / "e.safetensors", dtype)
  assert eager[0] >= count - 2


@pytest.mark.parametrize("error", [keys.ConvertError, KeyboardInterrupt])
def test_a_failure_midway_leaves_nothing_behind(sources, tmp_path, monkeypatch, error):
  real, calls = gguf_file.Source.read, []

  def dies_midway(self, name, exact=False):
    calls.append(name)
    if len(calls) == 20:
      raise error("killed midway")
    return real(self, name, exact)

  kept = tmp_path / "kept.safetensors"
  before = convert.convert_checkpoint(sources["gguf"], kept).read_bytes()
  monkeypatch.setattr(gguf_file.Source, "read", dies_midway)
  with pytest.raises(error, match="killed midway"):
    convert.convert_checkpoint(sources["gguf"], tmp_path / "new.safetensors")
  calls.clear()
  with pytest.raises(error, match="killed midway"):
    convert.convert_checkpoint(sources["gguf"], kept)  # over an older file: that one stays
  assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.safetensors"]
  assert kept.read_bytes() == before


def test_a_missing_tensor_fails_as_before_and_leaves_nothing(make_hf_model, write_gguf, tmp_path):
  hf = make_hf_model(seed=5, **SIZES)
  src = write_gguf(tmp_path / "d.gguf", hf, drop=("blk.3.ffn_down.weight",))
  out = tmp_path / "out"
  out.mkdir()
  with pytest.raises(keys.ConvertError, match=r"missing 1 tensor\(s\).*layers\.3\.mlp\.down_proj"):
    convert.convert_checkpoint(src, out)
  assert not list(out.iterdir())
