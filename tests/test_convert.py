"""convert: GGUF parity with transformers, bad inputs, the jspec file format and the CLI."""

import json
import os

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers

import convert
from convert import cli
from convert import gguf_file
from convert import keys
from convert import store
from jspec import cache as cache_lib
from convert import config as config_lib
from jspec import model as model_lib

Q = gguf.GGMLQuantizationType
# Every tensor type the writer can make, on tensors whose rows are whole blocks.
QUANT = {"token_embd.weight": Q.Q8_0, "attn_q.weight": Q.Q8_0, "attn_k.weight": Q.Q5_0,
         "attn_v.weight": Q.F16, "attn_output.weight": Q.BF16, "ffn_gate.weight": Q.Q4_0,
         "ffn_up.weight": Q.Q5_0, "ffn_down.weight": Q.Q8_0, "output.weight": Q.F16}
# Rows of 64 and 96 values: whole Q8_0/Q5_0/Q4_0 blocks of 32. 8 query heads on 2 kv heads.
GGUF_SIZES = dict(hidden_size=64, head_dim=8, num_attention_heads=8, num_key_value_heads=2,
                  intermediate_size=96)


def _logits(cfg, tensors, tokens):
  cache = cache_lib.init(cfg, tokens.shape[0], tokens.shape[1])
  params = model_lib.params_from_tensors(cfg, tensors)
  return np.asarray(model_lib.forward(model_lib.Arch(cfg), params, jnp.asarray(tokens), cache)[0])


def _hf_logits(model, tokens):
  with torch.no_grad():
    return model(torch.from_numpy(tokens.astype(np.int64))).logits.float().numpy()


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_gguf_matches_transformers(make_hf_model, write_gguf, tmp_path, monkeypatch, tied):
  monkeypatch.setattr(gguf_file, "_ROWS_PER_CHUNK", 7)  # several chunks per tensor
  hf = make_hf_model(seed=4, tie_word_embeddings=tied, **GGUF_SIZES)
  path = write_gguf(tmp_path / "tiny.gguf", hf, quant=QUANT,
                    drop=("output.weight",) if tied else ())
  cfg, params = convert.load_checkpoint(path)
  assert cfg.tie_word_embeddings == tied
  assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (8, 2, 8)
  assert cfg.eos_token_ids == (261,)  # <|im_end|> in the tiny vocab
  try:
    import accelerate  # pylint: disable=import-outside-toplevel,unused-import
  except ImportError:
    pytest.fail("transformers needs `accelerate` to load GGUF files; install the test extra")
  ref_model = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 211)).astype(np.int32)
  ref = _hf_logits(ref_model, tokens)
  got = _logits(cfg, params, tokens)
  np.testing.assert_allclose(got, ref, atol=1e-4, rtol=1e-4)
  # And quantization changed the weights (so the quantized paths were exercised).
  assert np.abs(got - _hf_logits(hf, tokens)).max() > 1e-3


def test_gguf_tensors_dequantize_to_hf_orientation(make_hf_model, write_gguf, tmp_path):
  hf = make_hf_model(seed=5, **GGUF_SIZES)
  path = write_gguf(tmp_path / "f32.gguf", hf)  # all F32: exact
  _, params = convert.load_checkpoint(path)
  sd = {k: v.numpy() for k, v in hf.state_dict().items()}
  for name in ("q", "k", "v", "o"):
    np.testing.assert_array_equal(np.asarray(params[f"layers/1/attn/{name}/w"]),
                                  sd[f"model.layers.1.self_attn.{name}_proj.weight"].T)
  np.testing.assert_array_equal(np.asarray(params["head/w"]), sd["lm_head.weight"])


# Bad inputs. Each must fail with ConvertError/ConfigError naming the problem.

@pytest.fixture(scope="module")
def good_dir(tmp_path_factory, make_hf_model):
  path = tmp_path_factory.mktemp("good")
  make_hf_model(seed=6).save_pretrained(path, safe_serialization=True)
  return path


def _copy_dir(src, dst, edit_config=None, edit_tensors=None):
  """Copies an HF checkpoint, optionally editing config.json and the tensors."""
  dst.mkdir(parents=True, exist_ok=True)
  config = json.loads((src / "config.json").read_text())
  if edit_config:
    edit_config(config)
  (dst / "config.json").write_text(json.dumps(config))
  tensors = safetensors.numpy.load_file(src / "model.safetensors")
  if edit_tensors:
    edit_tensors(tensors)
  safetensors.numpy.save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
  return dst


def _raises(path, *words, error=keys.ConvertError):
  with pytest.raises(error) as info:
    convert.load_checkpoint(path)
  message = str(info.value)
  for word in words:
    assert word in message, message
  return message


def test_truncated_safetensors(good_dir, tmp_path):
  bad = _copy_dir(good_dir, tmp_path / "bad")
  data = (bad / "model.safetensors").read_bytes()
  (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
  _raises(bad, "model.safetensors", "truncated")


@pytest.mark.parametrize("cut", [3, 100, 0.5, -50])
def test_corrupted_gguf(make_hf_model, write_gguf, tmp_path, cut):
  path = write_gguf(tmp_path / "m.gguf", make_hf_model(seed=7, **GGUF_SIZES))
  data = path.read_bytes()
  n = int(len(data) * cut) if isinstance(cut, float) else cut % len(data)
  path.write_bytes(data[:n])
  if n < 4:
    _raises(path, "m.gguf")
  else:
    _raises(path, "m.gguf", "truncated or corrupted")


def test_garbled_gguf_header(make_hf_model, write_gguf, tmp_path):
  path = write_gguf(tmp_path / "m.gguf", make_hf_model(seed=7, **GGUF_SIZES))
  data = bytearray(path.read_bytes())
  data[24:64] = b"\xff" * 40  # inside the first metadata key
  path.write_bytes(bytes(data))
  _raises(path, "m.gguf", "truncated or corrupted")


def test_not_gguf_magic(tmp_path):
  path = tmp_path / "x.gguf"
  path.write_bytes(b"GGML" + b"\0" * 100)
  _raises(path, "x.gguf")


@pytest.mark.parametrize("edit,words", [
    (lambda c: c.update(model_type="llama", architectures=["LlamaForCausalLM"]),
     ("model_type", "llama")),
    (lambda c: c.update(use_sliding_window=True, sliding_window=64), ("use_sliding_window",)),
    (lambda c: c.update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
     ("rope_type", "yarn")),
    (lambda c: c.update(rope_scaling={"type": "yarn", "factor": 4.0}), ("yarn",)),
    # Numbers float32 cannot compute with: a negative eps makes RMSNorm's
    # rsqrt NaN, and every logit with it (token 0 everywhere).
    (lambda c: c.update(rms_norm_eps=-1), ("rms_norm_eps=-1", "(0, 1)")),
    (lambda c: c.update(rms_norm_eps=0), ("rms_norm_eps=0",)),
    (lambda c: c.update(rope_parameters={"rope_type": "default", "rope_theta": -5.0}),
     ("rope_theta=-5.0",)),
], ids=["llama", "sliding-window", "yarn", "yarn-legacy", "eps-negative", "eps-zero",
        "theta-negative"])
def test_unsupported_config(good_dir, tmp_path, edit, words):
  bad = _copy_dir(good_dir, tmp_path / "bad", edit_config=edit)
  _raises(bad, *words, error=config_lib.ConfigError)


def test_gguf_other_architecture(write_gguf, tmp_path):
  path = tmp_path / "llama.gguf"
  writer = gguf.GGUFWriter(str(path), "llama")
  writer.add_tensor("token_embd.weight", np.zeros((7, 4), np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  _raises(path, "general.architecture", "llama", error=config_lib.ConfigError)


def _drop(name):
  return lambda t: t.pop(name)


@pytest.mark.parametrize("edit,words", [
    (_drop("model.layers.1.mlp.up_proj.weight"), ("missing", "model.layers.1.mlp.up_proj.weight")),
    (lambda t: t.update({"model.layers.0.self_attn.qkv_proj.weight": np.ones((3, 3), np.float32)}),
     ("model.layers.0.self_attn.qkv_proj.weight", "not a Qwen2ForCausalLM weight")),
    (lambda t: t.update({"model.layers.2.mlp.up_proj.weight": np.ones((37, 58), np.float32)}),
     ("model.layers.2.mlp.up_proj.weight", "num_layers=2")),
    (lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": np.ones((28, 57), np.float32)}),
     ("model.layers.0.self_attn.k_proj.weight", "(28, 57)", "(28, 58)")),
    (lambda t: t.update({"model.layers.0.self_attn.o_proj.weight": np.ones((84, 58), np.float32)}),
     ("o_proj", "(84, 58)", "(58, 84)")),  # transposed in the file
    (lambda t: t["model.norm.weight"].__setitem__(3, np.nan), ("model.norm.weight", "NaN")),
], ids=["missing", "unmapped", "layer-out-of-range", "misshapen", "transposed", "nan"])
def test_bad_tensors(good_dir, tmp_path, edit, words):
  bad = _copy_dir(good_dir, tmp_path / "bad", edit_tensors=edit)
  _raises(bad, *words)


def test_rope_buffer_ignored_and_tied_head_checked(make_hf_model, tmp_path):
  hf = make_hf_model(seed=8, tie_word_embeddings=True)
  hf.save_pretrained(tmp_path / "src", safe_serialization=True)
  embed = hf.model.embed_tokens.weight.detach().numpy()

  def add(tensors, head):
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(7, np.float32)
    tensors["lm_head.weight"] = head

  ok = _copy_dir(tmp_path / "src", tmp_path / "ok", edit_tensors=lambda t: add(t, embed.copy()))
  cfg, params = convert.load_checkpoint(ok)
  assert cfg.tie_word_embeddings and "head/w" not in params
  bad = _copy_dir(tmp_path / "src", tmp_path / "bad", edit_tensors=lambda t: add(t, embed + 1))
  _raises(bad, "lm_head.weight", "tie_word_embeddings")


def test_duplicate_key_across_shards(make_hf_model, tmp_path):
  make_hf_model(seed=9).save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB")
  index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
  shards = sorted(set(index["weight_map"].values()))
  assert len(shards) >= 2
  first = safetensors.numpy.load_file(tmp_path / shards[0])
  name = next(iter(first))
  second = safetensors.numpy.load_file(tmp_path / shards[1])
  second[name] = first[name]
  safetensors.numpy.save_file(second, tmp_path / shards[1], metadata={"format": "pt"})
  _raises(tmp_path, name, "twice", shards[0], shards[1])


def test_missing_shard(make_hf_model, tmp_path):
  make_hf_model(seed=9).save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB")
  shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
  shard.unlink()
  _raises(tmp_path, shard.name, "not in")


def test_pickle_only_dir_refused(good_dir, tmp_path):
  bad = tmp_path / "pickle"
  bad.mkdir()
  (bad / "config.json").write_text((good_dir / "config.json").read_text())
  (bad / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
  message = _raises(bad, "pytorch_model.bin", "pickle", "safetensors")
  _raises(bad / "pytorch_model.bin", "pickle")
  assert "Traceback" not in message


def test_gguf_bad_tensors(make_hf_model, write_gguf, tmp_path):
  hf = make_hf_model(seed=10, **GGUF_SIZES)
  extra = write_gguf(tmp_path / "extra.gguf", hf, extra={"rope_freqs.weight": np.ones(4)})
  _raises(extra, "rope_freqs.weight")
  missing = write_gguf(tmp_path / "missing.gguf", hf, drop=("blk.1.attn_v.bias",))
  _raises(missing, "missing", "model.layers.1.self_attn.v_proj.bias")
  # Wrong metadata: 4 kv heads make the k/v shapes disagree with the tensors.
  wrong = write_gguf(tmp_path / "wrong.gguf", hf, meta={"qwen2.attention.head_count_kv": 4},
                     drop=())
  _raises(wrong, "k_proj.weight", "(16, 64)", "(32, 64)", "blk.0.attn_k.weight")


# The jspec file: round trip, atomic save, corruption on load.

@pytest.fixture(scope="module")
def converted(good_dir):
  return convert.load_checkpoint(good_dir)


def test_save_load_round_trip_exact(converted, tmp_path):
  cfg, params = converted
  path = store.save(tmp_path / "m.safetensors", cfg, params)
  cfg2, params2 = convert.load_checkpoint(path)
  assert cfg2 == cfg
  assert list(params2) == list(params)
  for name in params:
    np.testing.assert_array_equal(np.asarray(params2[name]), np.asarray(params[name]),
                                  err_msg=name)
  _, params16 = store.load(path, dtype="bfloat16")
  assert params16["norm/scale"].dtype == jnp.bfloat16


def test_interrupted_save_keeps_previous_file(converted, tmp_path, monkeypatch):
  cfg, params = converted
  path = store.save(tmp_path / "m.safetensors", cfg, params)
  before = path.read_bytes()
  real_save = safetensors.numpy.save_file

  def dies_midway(tensors, filename, metadata=None):
    real_save(tensors, filename, metadata=metadata)
    with open(filename, "r+b") as f:  # half written, as if killed
      f.truncate(os.path.getsize(filename) // 2)
    raise KeyboardInterrupt

  monkeypatch.setattr(safetensors.numpy, "save_file", dies_midway)
  with pytest.raises(KeyboardInterrupt):
    store.save(path, cfg, {name: x + 1 for name, x in params.items()})
  with pytest.raises(KeyboardInterrupt):
    store.save(tmp_path / "new.safetensors", cfg, params)
  assert path.read_bytes() == before
  assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]


def test_corrupted_jspec_file(converted, tmp_path):
  cfg, params = converted
  path = store.save(tmp_path / "m.safetensors", cfg, params)
  data = path.read_bytes()
  path.write_bytes(data[: len(data) - 1000])
  _raises(path, "m.safetensors", "truncated")
  # A config that does not match the tensors.
  wrong = config_lib.Qwen2Config(**{**cfg.to_dict(), "num_layers": 3})
  with pytest.raises(keys.ConvertError, match="do not match the config"):
    store.save(tmp_path / "w.safetensors", wrong, params)
  assert not (tmp_path / "w.safetensors").exists()


def test_cli_converts_and_reports_errors(good_dir, tmp_path, capsys):
  out = tmp_path / "out.safetensors"
  assert cli.main([str(good_dir), str(out), "--dtype", "bfloat16"]) == 0
  cfg, params = store.load(out)  # dtype None: as stored
  assert cfg == config_lib.from_hf_json(good_dir)
  assert params["embed/table"].dtype == jnp.bfloat16
  _, direct = convert.load_checkpoint(good_dir, dtype="bfloat16")
  assert list(direct) == list(params)
  for name, value in direct.items():
    np.testing.assert_array_equal(params[name], np.asarray(value), err_msg=name)
  capsys.readouterr()
  assert cli.main([str(tmp_path / "nope"), str(tmp_path / "x.safetensors")]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "nope" in err and "Traceback" not in err
  assert not (tmp_path / "x.safetensors").exists()


def _output_at_the_input(kind, root, good_dir, gguf):
  """(source, output) where the output resolves to a file the conversion reads."""
  if kind == "same-path":
    return gguf, gguf
  if kind == "dot-path":
    return gguf, gguf.parent / "." / gguf.name
  if kind == "symlink":
    (root / "link.gguf").symlink_to(gguf)
    return gguf, root / "link.gguf"
  if kind == "symlinked-source":
    (root / "link.gguf").symlink_to(gguf)
    return root / "link.gguf", gguf
  if kind == "hard-link":
    os.link(gguf, root / "hard.gguf")
    return gguf, root / "hard.gguf"
  if kind == "directory":  # OUT/jspec.safetensors (store.resolve_path) is the input
    (root / "out").mkdir()
    (root / "out" / store.DEFAULT_NAME).symlink_to(gguf)
    return gguf, root / "out"
  hf_dir = _copy_dir(good_dir, root / "hf")
  return hf_dir, hf_dir / {"hf-weights": "model.safetensors", "hf-config": "config.json"}[kind]


@pytest.mark.parametrize("kind", ["same-path", "dot-path", "symlink", "symlinked-source",
                                  "hard-link", "directory", "hf-weights", "hf-config"])
def test_convert_refuses_an_output_that_is_its_input(kind, good_dir, make_hf_model, write_gguf,
                                                     tmp_path, capsys, monkeypatch):
  gguf_path = write_gguf(tmp_path / "m.gguf", make_hf_model(seed=7, **GGUF_SIZES))
  src, out = _output_at_the_input(kind, tmp_path, good_dir, gguf_path)
  before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}

  def no_read(path):
    raise AssertionError(f"read {path} before refusing the output")

  monkeypatch.setattr(convert, "open_source", no_read)
  assert cli.main([str(src), str(out)], prog="jspec convert") == 2
  err = capsys.readouterr().err
  assert err.startswith("jspec convert: error: output ") and err.count("\n") == 1, err
  assert "is the input" in err and "choose another output" in err
  assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
  with pytest.raises(keys.ConvertError, match="is the input"):
    convert.convert_checkpoint(src, out)


def test_convert_writes_beside_its_input(good_dir, tmp_path):
  # The refusal is about the input's own files: a new file in its directory is fine.
  hf_dir = _copy_dir(good_dir, tmp_path / "hf")
  weights = (hf_dir / "model.safetensors").read_bytes()
  assert convert.convert_checkpoint(hf_dir, hf_dir) == hf_dir / store.DEFAULT_NAME
  assert store.is_jspec_file(hf_dir / store.DEFAULT_NAME)
  assert (hf_dir / "model.safetensors").read_bytes() == weights


@pytest.mark.parametrize("text,kind", [("[1, 2]", "array"), ('"qwen2"', "string"),
                                       ("7", "number"), ("null", "null")])
def test_a_config_json_that_is_not_an_object_is_one_line(good_dir, tmp_path, capsys, text, kind):
  bad = _copy_dir(good_dir, tmp_path / "bad")
  (bad / "config.json").write_text(text)
  _raises(bad, "config.json", "expected a JSON object", f"got a JSON {kind}",
          error=config_lib.ConfigError)
  assert cli.main([str(bad), str(tmp_path / "out.safetensors")]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "expected a JSON object" in err and "Traceback" not in err
