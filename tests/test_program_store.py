"""The on-disk store of traced programs: a later process compiles without tracing."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import jspec
import tiny
from jspec import programs
from jspec import cpu_kernels
from jspec import decode
from jspec import program_store

SETTINGS = dict(max_new_tokens=20, method="model", policy="confidence", gamma=4)


@pytest.fixture
def store(tmp_path, monkeypatch):
  """An empty store of this test's own, with the XLA cache on as `generate` turns it on."""
  programs.enable_persistent_cache()
  monkeypatch.setattr(program_store, "store_dir", lambda: tmp_path / "programs")
  monkeypatch.setattr(program_store, "_warned", set())  # each test sees its own warnings
  programs.release()
  return tmp_path / "programs"


def _count_round_traces(monkeypatch) -> list:
  """Counts how often the decode loop's round is traced (each trace calls `_round` once)."""
  calls = []
  real = decode._round

  def counted(*args, **kwargs):
    calls.append(1)
    return real(*args, **kwargs)

  monkeypatch.setattr(decode, "_round", counted)
  return calls


@pytest.mark.slow
def test_a_new_process_runs_the_stored_program_without_tracing(store, monkeypatch):
  bundle = tiny.pair(5)
  first = jspec.generate(bundle, tiny.prompt(1, 9), **SETTINGS)
  assert sorted(p.name.split("-")[0] for p in store.iterdir()) == ["prefill", "run"]
  programs.release()  # what a new process starts from: nothing compiled, nothing traced
  stored, traces = programs.PROGRAMS.stored, _count_round_traces(monkeypatch)
  again = jspec.generate(bundle, tiny.prompt(1, 9), **SETTINGS)
  assert traces == []
  assert programs.PROGRAMS.stored == stored + 2
  assert again.token_ids == first.token_ids
  assert again.stats["rounds"] == first.stats["rounds"]


@pytest.mark.slow
def test_changed_sources_trace_again(store, monkeypatch):
  bundle = tiny.pair(5)
  jspec.generate(bundle, tiny.prompt(1, 9), **SETTINGS)
  programs.release()
  # As if a jspec module had been edited: a new key, so the old program is not used.
  monkeypatch.setattr(program_store, "source_digest", lambda: "edited")
  traces = _count_round_traces(monkeypatch)
  jspec.generate(bundle, tiny.prompt(1, 9), **SETTINGS)
  assert traces == [1]
  assert len(list(store.iterdir())) == 4


@pytest.mark.slow
def test_an_unreadable_stored_program_is_traced_again_and_replaced(store):
  bundle = tiny.pair(5)
  first = jspec.generate(bundle, tiny.prompt(1, 9), **SETTINGS)
  for path in store.iterdir():
    path.write_bytes(b"not a program")
  programs.release()
  with pytest.warns(RuntimeWarning, match="unreadable stored program"):
    again = jspec.generate(bundle, tiny.prompt(1, 9), **SETTINGS)
  assert again.token_ids == first.token_ids
  programs.release()
  stored = programs.PROGRAMS.stored
  jspec.generate(bundle, tiny.prompt(1, 9), **SETTINGS)  # the rewritten files read back
  assert programs.PROGRAMS.stored == stored + 2


def _flip_middle(path, count=64):
  """Inverts `count` bytes in the middle of a file, keeping its size and mtime."""
  st = path.stat()
  with open(path, "r+b") as f:
    f.seek(st.st_size // 2)
    data = f.read(count)
    f.seek(st.st_size // 2)
    f.write(bytes(b ^ 0xFF for b in data))
  os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _runtime_warnings(record) -> list[str]:
  return [str(w.message) for w in record if issubclass(w.category, RuntimeWarning)]


@pytest.mark.slow
def test_a_damaged_stored_program_is_traced_again_and_replaced(store):
  bundle = tiny.pair(5)
  first = jspec.generate(bundle, tiny.prompt(1, 9), **SETTINGS)
  for path in store.iterdir():
    _flip_middle(path)  # still a flatbuffer, often one that deserializes: the sha256 tells
  programs.release()
  with pytest.warns(RuntimeWarning) as record:
    again = jspec.generate(bundle, tiny.prompt(1, 9), **SETTINGS)
  assert again.token_ids == first.token_ids
  messages = _runtime_warnings(record)
  assert len(messages) == 2 and all("sha256 does not match" in m for m in messages), messages
  programs.release()
  stored = programs.PROGRAMS.stored
  jspec.generate(bundle, tiny.prompt(1, 9), **SETTINGS)  # the replaced entries read back
  assert programs.PROGRAMS.stored == stored + 2


def _rewrite_module(path, edit):
  """Rewrites a stored program's StableHLO with a sound entry around it (its sha256 matches)."""
  data = path.read_bytes()
  head = len(program_store._MAGIC) + program_store._DIGEST_LEN + 1
  exported = jax.export.deserialize(bytearray(data[head:]))
  module = edit(bytearray(exported.mlir_module_serialized))
  path.write_bytes(program_store._entry(
      dataclasses.replace(exported, mlir_module_serialized=bytes(module))))


@pytest.mark.slow
def test_a_stored_program_that_does_not_lower_is_traced_again_and_replaced(store):
  bundle = tiny.pair(5)
  first = jspec.generate(bundle, tiny.prompt(1, 9), **SETTINGS)
  for path in store.iterdir():
    _rewrite_module(path, lambda module: module[:len(module) // 3])  # "Failed to deserialize"
  programs.release()
  with pytest.warns(RuntimeWarning) as record:
    again = jspec.generate(bundle, tiny.prompt(1, 9), **SETTINGS)
  assert again.token_ids == first.token_ids
  messages = _runtime_warnings(record)
  assert len(messages) == 2 and all("does not lower" in m for m in messages), messages
  programs.release()
  stored = programs.PROGRAMS.stored
  jspec.generate(bundle, tiny.prompt(1, 9), **SETTINGS)
  assert programs.PROGRAMS.stored == stored + 2


@pytest.mark.slow
def test_a_stored_program_that_does_not_compile_is_traced_again_and_replaced(store, monkeypatch):
  bundle = tiny.pair(5)
  first = jspec.generate(bundle, tiny.prompt(1, 9), **SETTINGS)
  programs.release()
  real = program_store._calling
  calls = []

  class Uncompilable:
    def compile(self):
      raise RuntimeError("INTERNAL: as XLA says of a module it cannot compile")

  def first_fails(name, *args):
    calls.append(name)
    lowered, call = real(name, *args)
    return (Uncompilable() if calls.count(name) == 1 else lowered), call

  monkeypatch.setattr(program_store, "_calling", first_fails)
  with pytest.warns(RuntimeWarning) as record:
    again = jspec.generate(bundle, tiny.prompt(1, 9), **SETTINGS)
  assert again.token_ids == first.token_ids
  messages = _runtime_warnings(record)
  assert len(messages) == 2 and all("does not compile" in m for m in messages), messages
  assert sorted(calls) == ["prefill", "prefill", "run", "run"]  # the stored one, then a trace


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["regular-file", "dangling-symlink"])
def test_an_unusable_store_directory_is_warned_once_and_skipped(store, kind):
  if kind == "regular-file":
    store.write_text("not a directory")
  else:
    store.symlink_to(store.parent / "gone" / "programs")
  with pytest.warns(RuntimeWarning) as record:  # two programs, one warning
    out = jspec.generate(tiny.pair(5), tiny.prompt(1, 9), **SETTINGS)
  messages = _runtime_warnings(record)
  assert len(messages) == 1 and f"cannot use the program store {store}" in messages[0], messages
  assert store.is_symlink() or store.read_text() == "not a directory"
  assert not (store.parent / "gone").exists()
  assert len(out.token_ids) == SETTINGS["max_new_tokens"]


def _read_only(directory):
  """Makes a directory read-only for this process, root included (chattr +i); None if it cannot."""
  if os.geteuid() != 0:
    directory.chmod(0o555)
    return lambda: directory.chmod(0o755)
  done = subprocess.run(["chattr", "+i", str(directory)], capture_output=True, check=False)
  if done.returncode != 0:
    return None
  return lambda: subprocess.run(["chattr", "-i", str(directory)], check=True)


@pytest.mark.slow
def test_a_read_only_store_generates_without_storing_and_warns_once(store):
  store.mkdir()
  undo = _read_only(store)
  if undo is None:
    pytest.skip("no way to make a directory read-only for root here (chattr failed)")
  try:
    with pytest.warns(RuntimeWarning) as record:  # two programs, one warning
      out = jspec.generate(tiny.pair(5), tiny.prompt(1, 9), **SETTINGS)
  finally:
    undo()
  messages = _runtime_warnings(record)
  assert len(messages) == 1 and f"cannot write the program store {store}" in messages[0], messages
  assert list(store.iterdir()) == []
  assert len(out.token_ids) == SETTINGS["max_new_tokens"]


@pytest.fixture
def no_xla_cache_yet(monkeypatch):
  """The XLA cache unset, as in a new process (restored afterwards)."""
  saved = {name: getattr(jax.config, name) for name in (
      "jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")}
  jax.config.update("jax_compilation_cache_dir", None)
  monkeypatch.setattr(program_store, "_warned", set())
  monkeypatch.setenv("JSPEC_XLA_CACHE", "1")
  yield
  for name, value in saved.items():
    jax.config.update(name, value)


def test_a_compilation_cache_that_cannot_be_created_is_warned_once(no_xla_cache_yet, tmp_path,
                                                                   monkeypatch):
  (tmp_path / "a-file").write_text("")
  monkeypatch.setenv("JSPEC_CACHE", str(tmp_path / "a-file" / "cache"))
  with pytest.warns(RuntimeWarning) as record:
    programs.enable_persistent_cache()
    programs.enable_persistent_cache()  # every new program asks again
  messages = _runtime_warnings(record)
  assert len(messages) == 1 and "cannot create the jspec cache directory" in messages[0]
  assert "compiling without a persistent cache" in messages[0]
  assert jax.config.jax_compilation_cache_dir is None
  assert program_store.store_dir() is None  # the store follows the XLA cache
  monkeypatch.setenv("JSPEC_CACHE", str(tmp_path / "cache"))
  (tmp_path / "cache").mkdir()
  (tmp_path / "cache" / "xla").write_text("")  # the cache exists, its xla entry is a file
  monkeypatch.setattr(program_store, "_warned", set())
  with pytest.warns(RuntimeWarning, match=r"cannot create the compilation cache directory .*xla"):
    programs.enable_persistent_cache()
  assert jax.config.jax_compilation_cache_dir is None


def test_a_read_only_compilation_cache_is_read_without_writing(no_xla_cache_yet, tmp_path,
                                                               monkeypatch):
  monkeypatch.setenv("JSPEC_CACHE", str(tmp_path))
  (tmp_path / "xla").mkdir()
  undo = _read_only(tmp_path / "xla")
  if undo is None:
    pytest.skip("no way to make a directory read-only for root here (chattr failed)")
  try:
    with pytest.warns(RuntimeWarning, match="is not writable"):
      programs.enable_persistent_cache()
  finally:
    undo()
  assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xla")  # still read
  # JAX writes no entry (it would warn about each one it failed to write).
  assert jax.config.jax_persistent_cache_min_compile_time_secs == float("inf")


def test_the_store_follows_the_xla_cache_switch(monkeypatch):
  programs.enable_persistent_cache()
  xla_dir = jax.config.jax_compilation_cache_dir
  assert xla_dir  # set, so only the switch can turn the store off below
  monkeypatch.setenv("JSPEC_XLA_CACHE", "1")
  assert program_store.store_dir() == pathlib.Path(xla_dir) / "jspec-programs"
  monkeypatch.setenv("JSPEC_XLA_CACHE", "0")
  assert program_store.store_dir() is None


def test_the_key_names_every_input_of_the_trace():
  spec = {"spec": "a"}
  base = program_store.program_key("run", ([1, 2],), spec)
  assert program_store.program_key("run", ([1, 2],), spec) == base
  assert program_store.program_key("prefill", ([1, 2],), spec) != base
  assert program_store.program_key("run", ([1, 2],), {"spec": "b"}) != base
  assert program_store.program_key("run", ((1, 2),), spec) != base  # tree structure
  arrays = program_store.program_key("run", (jnp.zeros((2, 3)),), spec)
  assert program_store.program_key("run", (jnp.zeros((3, 2)),), spec) != arrays
  assert program_store.program_key("run", (jnp.zeros((2, 3), jnp.int32),), spec) != arrays
  with jax.default_matmul_precision("highest"):  # a setting that changes the traced program
    assert program_store.program_key("run", (jnp.zeros((2, 3)),), spec) != arrays


def test_the_key_names_the_cpu_kernels_a_trace_calls(monkeypatch):
  # A cache directory moved to a host without VNNI must not run a program
  # that calls jspec_gemm_i8 (whose AVX2 build refuses), nor one without
  # the kernels where they exist now.
  if jax.default_backend() != "cpu":
    pytest.skip("the CPU kernels only enter CPU programs")
  base = program_store.program_key("run", ([1, 2],), {"spec": "a"})
  here = cpu_kernels.int8_kind()
  for kind in ("vnni", "avx2", None):
    if kind != here:
      monkeypatch.setattr(cpu_kernels, "int8_kind", lambda kind=kind: kind)
      assert program_store.program_key("run", ([1, 2],), {"spec": "a"}) != base, kind
  monkeypatch.undo()
  have, kind = cpu_kernels.available(), cpu_kernels.int8_kind()
  monkeypatch.setattr(cpu_kernels, "int8_kind", lambda: kind)
  monkeypatch.setattr(cpu_kernels, "available", lambda: not have)
  assert program_store.program_key("run", ([1, 2],), {"spec": "a"}) != base


# A packable target: with the CPU kernel the stored programs hold its custom
# call, which export must accept and a new process must find registered.
_CHILD = """
import json, sys
import jspec, tiny
from jspec import cpu_kernels, programs, weights
bundle = tiny.packable_pair(5)
out = jspec.generate(bundle, [3, 1, 4, 1, 5, 9, 2, 6, 5], **json.loads(sys.argv[1]))
up = bundle.target.params["layers"]["0"]["mlp"]["up"]["w"]
print(json.dumps({"ids": out.token_ids, "stored": programs.PROGRAMS.stored,
                  "packed": isinstance(up, weights.Panels),
                  "kernel": cpu_kernels.available()}))
"""


@pytest.mark.slow
def test_a_second_process_reads_what_the_first_stored(tmp_path):
  env = {**os.environ, "JSPEC_CACHE": str(tmp_path), "JSPEC_XLA_CACHE": "1",
         "PYTHONPATH": os.pathsep.join([os.path.dirname(tiny.__file__),
                                        os.environ.get("PYTHONPATH", "")])}
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  runs = []
  for _ in range(2):
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(SETTINGS)], env=env,
                          capture_output=True, text=True, check=True)
    runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
  assert [r["stored"] for r in runs] == [0, 2]
  assert runs[1]["ids"] == runs[0]["ids"]
  assert all(r["packed"] == r["kernel"] for r in runs)


# The first child makes the programs and the prepared files; the second only
# maps the files and runs the stored programs, as a second `jspec generate`
# does, and must not import flax on the way (`jspec.model`: it costs a large
# share of the time to the first token).
_MAKE = """
import json, pathlib, sys
import jspec, tiny
from jspec import prepared
bundle = tiny.packable_pair(5)
prepared.save(pathlib.Path(sys.argv[1], "t.safetensors"), bundle.target, "k" * 64)
prepared.save(pathlib.Path(sys.argv[1], "d.safetensors"), bundle.draft, "k" * 64)
print(json.dumps(jspec.generate(bundle, [3, 1, 4, 1, 5], max_new_tokens=9, gamma=2).token_ids))
"""
_READY = """
import json, pathlib, sys
import jspec
from jspec import prepared, programs
t = prepared.load(pathlib.Path(sys.argv[1], "t.safetensors"), "k" * 64)
d = prepared.load(pathlib.Path(sys.argv[1], "d.safetensors"), "k" * 64)
ids = jspec.generate(jspec.Bundle(t, d, None), [3, 1, 4, 1, 5], max_new_tokens=9, gamma=2).token_ids
print(json.dumps({"ids": ids, "stored": programs.PROGRAMS.stored, "flax": "flax" in sys.modules}))
"""


def test_a_ready_process_runs_without_importing_flax(tmp_path):
  env = {**os.environ, "JSPEC_CACHE": str(tmp_path), "JSPEC_XLA_CACHE": "1",
         "PYTHONPATH": os.pathsep.join([os.path.dirname(tiny.__file__),
                                        os.environ.get("PYTHONPATH", "")])}
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  run = lambda code: subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env,
                                    capture_output=True, text=True, check=True)
  made = json.loads(run(_MAKE).stdout.strip().splitlines()[-1])
  ready = json.loads(run(_READY).stdout.strip().splitlines()[-1])
  assert ready == {"ids": made, "stored": 2, "flax": False}
