"""jspec.load on tiny checkpoints: mixed formats, vocabulary checks, bad paths, and the
known-pair path on fake chunk packages (assemble, convert once, reuse, rebuild).

The helpers at the top (`write_hf`, `write_pair`) are shared with test_cli.py.
"""

import hashlib
import importlib
import json
import os
import pathlib

import numpy as np
import pytest

import convert
import jspec
from convert import keys
from convert import store
from convert import config as config_lib
from jspec import bundle as bundle_lib
from jspec import cli
from jspec import fetch
from jspec import loading
from jspec import prepared
from jspec import tokenizer as tokenizer_lib

# A one-layer draft unlike the target in every size, over the same 263-id vocab
# (head_dim = hidden / heads: GGUF metadata has no separate head size here).
TARGET_SIZES = dict(hidden_size=48, head_dim=8, num_attention_heads=6, num_key_value_heads=2)
DRAFT_SIZES = dict(hidden_size=20, head_dim=10, num_attention_heads=2, num_key_value_heads=1,
                   intermediate_size=19, num_hidden_layers=1)
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")
PROMPT = "def f(x):"  # the tiny target does not end it at once (it does "the thin...")


def write_hf(path, model, tiny_vocab, swap=None):
  """Saves an HF checkpoint directory with a tokenizer.json of the tiny vocab.

  Args:
    path: the directory.
    model: a transformers Qwen2ForCausalLM.
    tiny_vocab: (tokens, merges, types) from conftest.
    swap: a pair of token ids whose strings trade places (a different vocabulary).

  Returns:
    The directory.
  """
  tokens, merges, types = tiny_vocab
  tokens = list(tokens)
  if swap:
    a, b = swap
    tokens[a], tokens[b] = tokens[b], tokens[a]
  model.save_pretrained(path, safe_serialization=True)
  tokenizer_lib.from_vocab(tokens, merges, types).save(str(path / "tokenizer.json"))
  (path / "tokenizer_config.json").write_text(json.dumps(
      {"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": None}))
  return path


def write_pair(root, make_hf_model, write_gguf, tiny_vocab):
  """A tiny target as an HF directory and a tiny draft as a GGUF file.

  Returns:
    (target directory, draft GGUF path).
  """
  root.mkdir(parents=True, exist_ok=True)
  target = write_hf(root / "target", make_hf_model(seed=1, **TARGET_SIZES), tiny_vocab)
  draft = write_gguf(root / "draft.gguf", make_hf_model(seed=2, **DRAFT_SIZES))
  return target, draft


@pytest.fixture(scope="module")
def pair(tmp_path_factory, make_hf_model, write_gguf, tiny_vocab):
  return write_pair(tmp_path_factory.mktemp("pair"), make_hf_model, write_gguf, tiny_vocab)


@pytest.mark.slow
def test_mixed_hf_target_gguf_draft_generates(pair):
  target, draft = pair
  bundle = jspec.load(target, draft, progress=False)
  assert bundle.draft is not None and bundle.draft.cfg.num_layers == 1
  assert bundle.tokenizer.chat_template == CHAT_TEMPLATE  # from the target
  spec = jspec.generate(bundle, PROMPT, max_new_tokens=12)
  base = jspec.generate(bundle, PROMPT, max_new_tokens=12, method="target")
  assert spec.token_ids == base.token_ids and spec.text == base.text
  assert spec.stats["drafted"] > 0


@pytest.mark.slow
def test_gguf_target_hf_draft(pair, tmp_path, make_hf_model, write_gguf):
  target_dir, _ = pair
  gguf_target = write_gguf(tmp_path / "t.gguf", make_hf_model(seed=1, **TARGET_SIZES))
  bundle = jspec.load(gguf_target, target_dir, progress=False)
  assert bundle.tokenizer.encode(PROMPT) == jspec.load(target_dir).tokenizer.encode(PROMPT)


def test_different_vocabularies_refused(pair, tmp_path, make_hf_model, tiny_vocab):
  target, _ = pair
  other = write_hf(tmp_path / "other", make_hf_model(seed=3, **DRAFT_SIZES), tiny_vocab,
                   swap=(100, 101))
  with pytest.raises(ValueError, match="different vocabularies.*token id 100"):
    jspec.load(target, other, progress=False)


def test_vocabulary_rows_mismatch_refused(pair, tmp_path, make_hf_model):
  target, _ = pair
  short = tmp_path / "short"
  make_hf_model(seed=3, vocab_size=200, **DRAFT_SIZES).save_pretrained(short)  # no tokenizer
  with pytest.raises(ValueError, match="200 rows"):
    jspec.load(target, short, progress=False)


@pytest.mark.slow
def test_jspec_file_target_needs_a_tokenizer_for_text(pair, tmp_path):
  target, draft = pair
  out = convert.convert_checkpoint(target, tmp_path / "t.jspec.safetensors")
  bundle = jspec.load(out, draft, progress=False)
  assert bundle.tokenizer is None
  with pytest.raises(ValueError, match="needs a tokenizer"):
    jspec.generate(bundle, PROMPT, max_new_tokens=4)
  ids = jspec.load(target).tokenizer.encode(PROMPT)
  by_ids = jspec.generate(bundle, ids, max_new_tokens=6)
  with_tok = jspec.load(out, draft, progress=False, tokenizer=target)
  assert jspec.generate(with_tok, PROMPT, max_new_tokens=6).token_ids == by_ids.token_ids


def _bad_path(root, kind):
  """A path jspec.load must refuse: missing, an empty directory, a pickle, a text file."""
  if kind == "missing":
    return root / "missing.gguf"
  if kind == "not-a-checkpoint":
    (root / "empty").mkdir()
    return root / "empty"
  path = root / {"pickle": "m.bin", "text-file": "x.txt"}[kind]
  path.write_bytes(b"\x80\x04junk" if kind == "pickle" else b"hello")
  return path


@pytest.mark.parametrize("kind,words", [
    ("missing", ("missing.gguf", "no such file")),
    ("not-a-checkpoint", ("empty", "config.json")),
    ("pickle", ("pickle", "safetensors")),
    ("text-file", ("x.txt", "not a GGUF")),
])
def test_bad_paths(tmp_path, kind, words):
  with pytest.raises(convert.ConvertError) as err:
    jspec.load(_bad_path(tmp_path, kind), progress=False)
  for word in words:
    assert word in str(err.value)


def test_pickle_directory_refused_before_tokenizer(pair, tmp_path):
  target, _ = pair
  bad = tmp_path / "pickle"
  bad.mkdir()
  for name in ("config.json", "tokenizer.json"):
    (bad / name).write_text((target / name).read_text())
  (bad / "pytorch_model.bin").write_bytes(b"\x80\x04junk")
  with pytest.raises(convert.ConvertError, match="pickle.*safetensors"):
    jspec.load(bad, progress=False)


def test_unknown_name_and_other_architecture(pair, tmp_path):
  with pytest.raises(fetch.FetchError, match="qwen2.5-coder"):
    jspec.load("llama-7b", progress=False)
  target, _ = pair
  llama = tmp_path / "llama"
  llama.mkdir()
  config = json.loads((target / "config.json").read_text())
  config.update(model_type="llama", architectures=["LlamaForCausalLM"])
  (llama / "config.json").write_text(json.dumps(config))
  (llama / "model.safetensors").write_bytes((target / "model.safetensors").read_bytes())
  with pytest.raises(config_lib.ConfigError, match="llama"):
    jspec.load(llama, progress=False)
  with pytest.raises(ValueError, match="pair"):
    jspec.load("qwen2.5-coder", draft=target)
  with pytest.raises(convert.ConvertError, match="dtype"):
    jspec.load(target, dtype="int4")


# The known-pair path on fake chunk packages.

def _chunk_package(site, module, data):
  """One fake chunk package holding `data` as data/part01.bin; importing it fails."""
  pkg = site / module
  (pkg / "data").mkdir(parents=True)
  (pkg / "__init__.py").write_text('raise RuntimeError("must not import")\n')
  (pkg / "data" / "part01.bin").write_bytes(data)


def _fake_source(site, name, gguf_path, parts=3):
  """Splits a GGUF file into `parts` chunk packages and returns its ModelSource."""
  data = gguf_path.read_bytes()
  cuts = np.linspace(0, len(data), parts + 1).astype(int)
  prefix = f"fakechunk_{site.parent.name.replace('-', '_')}_{name.replace('-', '_')}_"
  modules = []
  for k in range(parts):
    modules.append(f"{prefix}{k}")
    _chunk_package(site, modules[-1], data[cuts[k]:cuts[k + 1]])
  return fetch.ModelSource(
      name=name, modules=tuple(modules), part_files=("data/part01.bin",) * parts,
      sha256=hashlib.sha256(data).hexdigest(), size=len(data), filename=f"{name}.gguf",
      pip_names=tuple(m.replace("_", "-") for m in modules), version="1.0")


@pytest.fixture(scope="module")
def fake_ggufs(tmp_path_factory, make_hf_model, write_gguf):
  root = tmp_path_factory.mktemp("ggufs")
  return (write_gguf(root / "t.gguf", make_hf_model(seed=4, **TARGET_SIZES)),
          write_gguf(root / "d.gguf", make_hf_model(seed=5, **DRAFT_SIZES)))


@pytest.fixture
def fake_pair(tmp_path, monkeypatch, fake_ggufs):
  """A known pair "fake-pair" served from chunk packages, with JSPEC_CACHE in tmp_path."""
  site = tmp_path / "site"
  site.mkdir()
  t_src = _fake_source(site, "fake-target", fake_ggufs[0])
  d_src = _fake_source(site, "fake-draft", fake_ggufs[1])
  monkeypatch.syspath_prepend(str(site))
  importlib.invalidate_caches()
  monkeypatch.setattr(fetch, "MODELS", {"fake-target": t_src, "fake-draft": d_src})
  monkeypatch.setattr(fetch, "ALIASES", {"fake-t": "fake-target"})
  monkeypatch.setattr(fetch, "PAIRS", {"fake-pair": ("fake-target", "fake-draft")})
  monkeypatch.setenv("JSPEC_CACHE", str(tmp_path / "cache"))
  return tmp_path / "cache"


def _count_conversions(monkeypatch):
  calls = []
  real = convert.convert_checkpoint

  def counting(src, out, *args, **kwargs):
    calls.append(pathlib.Path(src).name)
    return real(src, out, *args, **kwargs)

  monkeypatch.setattr(convert, "convert_checkpoint", counting)
  return calls


def _no_conversion(monkeypatch):
  def fail(*a, **k):
    raise AssertionError("converted again instead of using the cache")

  monkeypatch.setattr(convert, "convert_checkpoint", fail)


def _no_gguf_tokenizer(monkeypatch):
  def fail(*a, **k):
    raise AssertionError("read the tokenizer from the GGUF instead of its cache")

  monkeypatch.setattr(tokenizer_lib, "from_gguf", fail)


def _converted(cache, name):
  # On CPU the target is stored exactly (int8 blocks where the GGUF is quantized),
  # the draft as float32 (its int8 copy is made at load).
  dtype = "exact" if name.endswith("target") else "float32"
  return loading.converted_path(cache / f"{name}.gguf", dtype)


def _ids(bundle):
  return jspec.generate(bundle, PROMPT, max_new_tokens=8).token_ids


@pytest.mark.slow
def test_known_pair_assembles_converts_once_then_reuses(fake_pair, monkeypatch, fake_ggufs):
  calls = _count_conversions(monkeypatch)
  first = jspec.load("fake-pair", progress=False)
  assert sorted(calls) == ["fake-draft.gguf", "fake-target.gguf"]
  for name, gguf in zip(("fake-target", "fake-draft"), fake_ggufs):
    assert (fake_pair / f"{name}.gguf").read_bytes() == gguf.read_bytes()
    assert _converted(fake_pair, name).is_file()
  assert first.tokenizer is not None and first.draft.cfg.num_layers == 1
  direct = jspec.load(fake_ggufs[0], fake_ggufs[1], progress=False)
  assert _ids(first) == _ids(direct)
  _no_conversion(monkeypatch)
  _no_gguf_tokenizer(monkeypatch)
  second = jspec.load("fake-pair", progress=False)
  assert _ids(second) == _ids(first)
  # A float draft is a load setting: read from the converted file, no conversion
  # (patched to fail above).
  floats = jspec.load("fake-pair", progress=False, draft_int8=False)
  assert jspec.generate(floats, PROMPT, max_new_tokens=8).token_ids == _ids(first)
  for attr in ("eos_token_ids", "chat_template", "bos_token", "eos_token", "vocab_size"):
    assert getattr(second.tokenizer, attr) == getattr(first.tokenizer, attr)
  # A single known model (and its alias) uses the same cache.
  assert jspec.load("fake-t", progress=False).draft is None


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncate", "garble-same-size"])
def test_corrupted_converted_file_is_rebuilt(fake_pair, monkeypatch, capsys, damage):
  expected = _ids(jspec.load("fake-pair", progress=False))
  out = _converted(fake_pair, "fake-target")
  data = bytearray(out.read_bytes())
  if damage == "truncate":
    out.write_bytes(bytes(data[: len(data) // 2]))
  else:  # a flipped weight byte keeps the size and still loads: only the stamp notices
    data[-5] ^= 0xFF
    out.write_bytes(bytes(data))
    st = out.stat()
    os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns + 10_000_000))
  calls = _count_conversions(monkeypatch)
  assert _ids(jspec.load("fake-pair", progress=False)) == expected
  assert calls == ["fake-target.gguf"]
  assert "rebuilding" in capsys.readouterr().err
  _no_conversion(monkeypatch)
  jspec.load("fake-pair", progress=False)


def test_stamped_but_unreadable_file_is_rebuilt(fake_pair, monkeypatch, capsys):
  expected = _ids(jspec.load("fake-pair", progress=False))
  out = _converted(fake_pair, "fake-draft")
  with open(out, "r+b") as f:  # garble the header without touching size or mtime
    st = os.fstat(f.fileno())
    f.seek(9)
    f.write(b"\xff" * 16)
  os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns))
  # A stamp that vouches for it anyway (as one written over a bad file would):
  # loading it is what fails.
  loading._write_stamp(out, fetch.MODELS["fake-draft"].sha256, "float32")
  calls = _count_conversions(monkeypatch)
  assert _ids(jspec.load("fake-pair", progress=False)) == expected
  assert calls == ["fake-draft.gguf"]
  assert "unusable" in capsys.readouterr().err


def test_interrupted_conversion_leaves_cache_usable(fake_pair, monkeypatch):
  real_convert, calls = keys.convert_weight, []

  def dies_midway(*args, **kwargs):  # half the file written, as if killed
    calls.append(args[0])
    if len(calls) == 5:
      raise KeyboardInterrupt
    return real_convert(*args, **kwargs)

  with monkeypatch.context() as m:
    m.setattr(keys, "convert_weight", dies_midway)
    with pytest.raises(KeyboardInterrupt):
      jspec.load("fake-pair", progress=False)
  assert not _converted(fake_pair, "fake-target").exists()
  # What a SIGKILL would leave instead: the temporary, which nothing trusts.
  leftover = fake_pair / f".{_converted(fake_pair, 'fake-target').name}.abc123.tmp"
  leftover.write_bytes(b"half a file")
  bundle = jspec.load("fake-pair", progress=False)
  assert len(_ids(bundle)) == 8
  assert not leftover.exists() and not list(fake_pair.glob("*.tmp"))


def _flip_middle(path, count=64):
  """Inverts `count` bytes in the middle of a file, keeping its size and mtime."""
  st = path.stat()
  with open(path, "r+b") as f:
    f.seek(st.st_size // 2)
    data = f.read(count)
    f.seek(st.st_size // 2)
    f.write(bytes(b ^ 0xFF for b in data))
  os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_an_unstamped_file_is_never_adopted(fake_pair, monkeypatch, capsys):
  expected = _ids(jspec.load("fake-pair", progress=False))
  out = _converted(fake_pair, "fake-target")
  stamp = out.with_name(out.name + ".stamp")
  stamp.unlink()  # killed between the rename and the stamp, or never converted by jspec
  calls = _count_conversions(monkeypatch)
  assert _ids(jspec.load("fake-pair", progress=False)) == expected
  assert calls == ["fake-target.gguf"] and stamp.is_file()
  assert "rebuilding" in capsys.readouterr().err
  # The target's converted file as a symlink to the draft's, unstamped and
  # newer than the target's GGUF: it was loaded as the target, then stamped.
  draft_file = _converted(fake_pair, "fake-draft")
  draft_bytes = draft_file.read_bytes()
  out.unlink()
  stamp.unlink()
  out.symlink_to(draft_file.name)
  calls.clear()
  assert _ids(jspec.load("fake-pair", progress=False)) == expected
  assert calls == ["fake-target.gguf"]
  assert not out.is_symlink() and draft_file.read_bytes() == draft_bytes


def _settle(out):
  """Dates the stamp of `out` long after the file's change time, so that only that ctime vouches.

  A stamp is written seconds after the file at most; this one is as if the
  clock had run far ahead since, so the check that a later write (which
  sets a ctime later than the stamp) fails the 2 s rule cannot be what
  catches a change: only the recorded ctime and inode can.
  """
  stamp = out.with_name(out.name + ".stamp")
  record = json.loads(stamp.read_text())
  stamp.write_text(json.dumps({**record, "stamped_ns": record["ctime_ns"] + 10**15}))
  return record


@pytest.mark.parametrize("settled", [False, True], ids=["fresh-stamp", "settled-stamp"])
def test_flipped_weight_bytes_with_size_and_mtime_kept_are_rebuilt(fake_pair, monkeypatch,
                                                                   capsys, settled):
  expected = _ids(jspec.load("fake-pair", progress=False))
  out = _converted(fake_pair, "fake-target")
  if settled:
    _settle(out)
  before = out.stat()
  _flip_middle(out)  # inside the tensor data: the file still loads, with other weights
  assert (out.stat().st_size, out.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
  calls = _count_conversions(monkeypatch)
  assert _ids(jspec.load("fake-pair", progress=False)) == expected
  assert calls == ["fake-target.gguf"]
  err = capsys.readouterr().err
  assert f"converted cache {out} is stale, modified or unstamped" in err
  assert len([line for line in err.splitlines() if "rebuilding" in line]) == 1


def test_a_settled_stamp_is_trusted_without_hashing_until_the_file_changes(fake_pair,
                                                                          monkeypatch):
  jspec.load("fake-pair", progress=False)
  out = _converted(fake_pair, "fake-target")
  record = _settle(out)
  assert record["content_sha256"] == hashlib.sha256(out.read_bytes()).hexdigest()
  hashed = []
  real = loading._content_sha256
  monkeypatch.setattr(loading, "_content_sha256", lambda path: hashed.append(path) or real(path))
  _no_conversion(monkeypatch)
  jspec.load("fake-pair", progress=False)
  assert out not in hashed  # the file's inode and change time vouch that nothing wrote it
  st = out.stat()
  os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns))  # a new change time, the same bytes
  jspec.load("fake-pair", progress=False)
  assert out in hashed  # hashed, matched, and not rebuilt (conversion is patched to fail)


def _no_prepare(monkeypatch):
  def fail(*a, **k):
    raise AssertionError("prepared again instead of mapping the prepared file")

  monkeypatch.setattr(bundle_lib, "prepare", fail)
  monkeypatch.setattr(loading, "_load_cached", fail)


def test_a_second_load_maps_the_prepared_file(fake_pair, monkeypatch):
  expected = _ids(jspec.load("fake-pair", progress=False))
  for role, name, dtype in (("target", "fake-target", "exact"), ("draft", "fake-draft", "float32")):
    assert loading.prepared_path(fake_pair / f"{name}.gguf", dtype, role).is_file()
  with monkeypatch.context() as m:
    _no_prepare(m)
    _no_conversion(m)
    again = jspec.load("fake-pair", progress=False)
    assert _ids(again) == expected
    # Other settings are another prepared model: made, not mapped.
    with pytest.raises(AssertionError, match="prepared again"):
      jspec.load("fake-pair", progress=False, draft_int8=False)
  # ... kept in a file of its own: the default's stays.
  jspec.load("fake-pair", progress=False, draft_int8=False)
  floats = loading.prepared_path(fake_pair / "fake-draft.gguf", "float32", "draft",
                                 jspec.Settings(draft_int8=False))
  default = loading.prepared_path(fake_pair / "fake-draft.gguf", "float32", "draft")
  assert floats != default and floats.is_file() and default.is_file()


def test_a_first_load_maps_back_the_prepared_file_it_wrote(fake_pair, monkeypatch):
  # A model made in this process is dropped for the file it was written to, so
  # that the next one is made beside mapped pages, not beside a copy of it all.
  maps = []
  real = prepared.load

  def load(path, key):
    maps.append(real(path, key))
    return maps[-1]

  monkeypatch.setattr(prepared, "load", load)
  first = jspec.load("fake-pair", progress=False)
  assert len(maps) == 2 and first.target is maps[0] and first.draft is maps[1]
  maps.clear()
  assert _ids(jspec.load("fake-pair", progress=False)) == _ids(first)
  assert len(maps) == 2  # the warm load maps the same files


@pytest.mark.parametrize("damage", ["flipped-bytes", "garbled-header-restamped"])
def test_a_damaged_prepared_file_is_rebuilt(fake_pair, monkeypatch, capsys, damage):
  expected = _ids(jspec.load("fake-pair", progress=False))
  out = loading.prepared_path(fake_pair / "fake-target.gguf", "exact", "target")
  if damage == "flipped-bytes":  # inside the weights: only the stamp notices
    _flip_middle(out)
  else:
    stamp = json.loads(out.with_name(out.name + ".stamp").read_text())
    with open(out, "r+b") as f:
      f.seek(9)
      f.write(b"\xff" * 16)
    loading._write_stamp(out, fetch.MODELS["fake-target"].sha256, stamp["dtype"])
  _no_conversion(monkeypatch)
  assert _ids(jspec.load("fake-pair", progress=False)) == expected
  if damage != "flipped-bytes":
    assert "prepared cache" in capsys.readouterr().err
  with monkeypatch.context() as m:
    _no_prepare(m)
    assert _ids(jspec.load("fake-pair", progress=False)) == expected  # rebuilt and kept


def test_a_rebuilt_converted_file_rebuilds_the_prepared_one(fake_pair, monkeypatch):
  expected = _ids(jspec.load("fake-pair", progress=False))
  out = loading.prepared_path(fake_pair / "fake-target.gguf", "exact", "target")
  before = json.loads(out.with_name(out.name + ".stamp").read_text())["dtype"]
  converted = _converted(fake_pair, "fake-target")
  before_stamp = converted.with_name(converted.name + ".stamp").read_text()
  _flip_middle(converted)
  assert _ids(jspec.load("fake-pair", progress=False)) == expected
  after = json.loads(out.with_name(out.name + ".stamp").read_text())["dtype"]
  # Its key names the converted file as it is now, whatever bytes the
  # conversion wrote this time.
  content = loading._stamped_content(_converted(fake_pair, "fake-target"))
  assert after == "prepared:" + prepared.key(content, "target", "exact", jspec.Settings())
  assert content != json.loads(before_stamp)["content_sha256"] or after == before


def test_stale_conversion_of_another_gguf_is_rebuilt(fake_pair, monkeypatch):
  jspec.load("fake-pair", progress=False)
  out = _converted(fake_pair, "fake-target")
  stamp = out.with_name(out.name + ".stamp")
  record = json.loads(stamp.read_text())
  stamp.write_text(json.dumps({**record, "source_sha256": "0" * 64}))
  calls = _count_conversions(monkeypatch)
  jspec.load("fake-pair", progress=False)
  assert calls == ["fake-target.gguf"]
  assert json.loads(stamp.read_text())["format_version"] == store.FORMAT_VERSION


def test_missing_chunk_package_names_it(fake_pair, monkeypatch):
  source = fetch.MODELS["fake-draft"]
  broken = fetch.ModelSource(**{**source.__dict__, "modules": ("no_such_chunk_xyz",) * 3,
                                "pip_names": ("no-such-chunk-xyz",) * 3})
  monkeypatch.setitem(fetch.MODELS, "fake-draft", broken)
  with pytest.raises(fetch.FetchError, match="no-such-chunk-xyz==1.0"):
    jspec.load("fake-pair", progress=False)


def _tokenizer_cache(path):
  """(magic line, header dict, backend bytes) of a tokenizer cache file."""
  magic, header, backend = path.read_bytes().split(b"\n", 2)
  return magic, json.loads(header), backend


@pytest.mark.parametrize("damage", ["garbage", "bad-backend", "edited-vocab", "bad-magic",
                                    "other-gguf", "first-format"])
def test_tokenizer_cache_is_rebuilt_unless_it_matches(fake_pair, monkeypatch, capsys, damage):
  first = jspec.load("fake-pair", progress=False)
  path = fake_pair / "fake-target.tokenizer.json"
  saved = path.read_bytes()
  magic, header, backend = _tokenizer_cache(path)
  write = lambda h, b, m=magic: path.write_bytes(m + b"\n" + json.dumps(h).encode() + b"\n" + b)
  if damage == "garbage":
    path.write_bytes(saved[:1000])
  elif damage == "bad-backend":
    write(header, b"{not a tokenizer")
  elif damage == "edited-vocab":  # still a valid tokenizer, with "d" and "e" swapped
    edited = json.loads(backend)
    vocab = edited["model"]["vocab"]
    vocab["d"], vocab["e"] = vocab["e"], vocab["d"]
    write(header, json.dumps(edited).encode())
  elif damage == "bad-magic":
    write(header, backend, b"jspec-tokenizer 9")
  elif damage == "other-gguf":
    write({**header, "source_sha256": "0" * 64}, backend)
  else:  # the first format: one JSON object, the backend as a string in it
    path.write_text(json.dumps({**header, "backend": backend.decode()}))
  second = jspec.load("fake-pair", progress=False)
  assert second.tokenizer.encode(PROMPT) == first.tokenizer.encode(PROMPT)
  assert ("unusable" in capsys.readouterr().err) == (damage not in ("other-gguf", "first-format"))
  assert path.read_bytes() == saved
  _no_gguf_tokenizer(monkeypatch)
  jspec.load("fake-pair", progress=False)


def test_a_cache_directory_that_cannot_be_created_is_one_line(fake_pair, monkeypatch, capsys,
                                                             tmp_path):
  (tmp_path / "a-file").write_text("")
  monkeypatch.setenv("JSPEC_CACHE", str(tmp_path / "a-file" / "cache"))
  with pytest.raises(fetch.FetchError, match="cannot create the jspec cache directory"):
    jspec.load("fake-pair", progress=False)
  assert cli.main(["generate", "--model", "fake-pair", PROMPT]) == 2
  err = capsys.readouterr().err
  assert err == (f"jspec: error: cannot create the jspec cache directory {tmp_path}/a-file/cache "
                 "(Not a directory); set JSPEC_CACHE to a writable directory\n")


def test_default_draft_vocabulary_is_ranked_with_the_pairs_tokenizer(pair, monkeypatch):
  # A default K under the tiny vocabulary stands in for 65536 under 151936.
  from jspec import draft_vocab
  target, draft = pair
  counted = []
  vocab = jspec.load(target, draft, progress=False, draft_vocab=0).draft.cfg.vocab_size
  ranking = list(range(vocab))[::-1]

  def rank(tokenizer, cache=None):
    counted.append(tokenizer)
    return np.asarray(ranking, np.int32)

  monkeypatch.setattr(draft_vocab, "DEFAULT", 64)
  monkeypatch.setattr(draft_vocab, "ranking", rank)
  bundle = jspec.load(target, draft, progress=False)
  assert len(counted) == 1 and counted[0] is bundle.tokenizer  # the future resolved, not passed on
  ids = bundle.draft.params["vocab_ids"].tolist()
  assert ids == draft_vocab.subset(64, vocab, ranking,
                                   list(bundle.draft.cfg.eos_token_ids)
                                   + draft_vocab.special_ids(bundle.tokenizer)).tolist()
  assert ids[-1] == vocab - 1 and 0 not in ids  # the ranking's first, not the ids' first
  full = jspec.load(target, draft, progress=False, draft_vocab=0)
  assert full.draft.params["vocab_head"] is None and len(counted) == 1
  spec = jspec.generate(bundle, PROMPT, max_new_tokens=8)
  assert spec.token_ids == jspec.generate(full, PROMPT, max_new_tokens=8, method="target").token_ids
