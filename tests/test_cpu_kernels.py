"""jspec.cpu_kernels: the packed-weight matmul kernel computes x @ W, builds or says why not."""

from __future__ import annotations

import functools
import os
import pathlib
import shutil
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec import cli
from jspec import cpu_kernels

# Where a C++ compiler exists (CI's machine has one) the kernel must build:
# a silent fallback to the einsum would hide a broken kernel behind slowness.
HAVE_COMPILER = shutil.which(os.environ.get("CXX", "c++").split()[0]) is not None


def _random(shape, seed):
  return np.random.RandomState(seed).standard_normal(shape).astype(np.float32)


def test_kernel_builds_where_a_compiler_exists():
  if not HAVE_COMPILER:
    pytest.skip("no C++ compiler here")
  assert cpu_kernels.available(), cpu_kernels.unavailable_reason()


@pytest.mark.slow
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9, 12, 13, 17, 40, 50])
@pytest.mark.parametrize("k,n", [(64, 32), (37, 96), (160, 320)])
def test_matmul_matches_numpy(m, k, n):
  # Row counts on both sides of the 12-row tile (AVX-512), and of the 3-row
  # one and the 6 x 16 tiles from 4 rows (AVX2); K odd; one and many panels.
  x, w = _random((m, k), m), _random((k, n), k + n)
  y = jax.jit(cpu_kernels.matmul)(jnp.asarray(x), cpu_kernels.pack(jnp.asarray(w)))
  assert y.shape == (m, n) and y.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(y), x.astype(np.float64) @ w, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("m", [13, 50])
@pytest.mark.parametrize("n", [64, 96])
def test_a_row_comes_out_bit_for_bit_the_same_whatever_rows_share_the_call(m, n):
  # More than one row tile goes over K in blocks of 512 (K = 1100: two whole
  # blocks and a part), reloading each accumulator between blocks (on AVX2
  # in 6-row tiles over half a panel at a time); a row
  # alone goes over K in one pass (on AVX2 two panels at a time, and an odd
  # last panel alone: n = 96 is three panels). The FMAs are the same, in the
  # same order, so a verify row equals the target-only step's bit for bit.
  if not cpu_kernels.available():
    pytest.skip(f"kernel unavailable: {cpu_kernels.unavailable_reason()}")
  x, w = _random((m, 1100), m), _random((1100, n), 7)
  panels = cpu_kernels.pack(jnp.asarray(w))
  mm = jax.jit(cpu_kernels.matmul)
  many = np.asarray(mm(jnp.asarray(x), panels))
  np.testing.assert_allclose(many, x.astype(np.float64) @ w, rtol=1e-5, atol=1e-3)
  for row in (0, 12, m - 1):
    np.testing.assert_array_equal(many[row], np.asarray(mm(jnp.asarray(x[row:row + 1]), panels))[0])


def test_matmul_keeps_leading_axes_and_matches_its_fallback(monkeypatch):
  x, w = _random((2, 3, 48), 0), _random((48, 64), 1)
  panels = cpu_kernels.pack(jnp.asarray(w))
  kernel = jax.jit(cpu_kernels.matmul)(jnp.asarray(x), panels)
  monkeypatch.setattr(cpu_kernels, "available", lambda: False)
  fallback = jax.jit(cpu_kernels.matmul)(jnp.asarray(x), panels)  # a new trace: the einsum
  assert kernel.shape == fallback.shape == (2, 3, 64)
  np.testing.assert_allclose(np.asarray(kernel), np.asarray(fallback), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(fallback), x @ w, rtol=1e-5, atol=1e-4)


def test_concurrent_calls_in_one_program_all_finish_correctly():
  # Independent multiplies (like q, k and v) may run at once on XLA's
  # threads, each sharing its panels out to the same pool: none may wait on
  # a task queued behind another's.
  x = jnp.asarray(_random((9, 128), 2))
  ws = [_random((128, 32 * (i + 1)), 10 + i) for i in range(6)]
  panels = [cpu_kernels.pack(jnp.asarray(w)) for w in ws]
  outs = jax.jit(lambda x, ps: [cpu_kernels.matmul(x, p) for p in ps])(x, panels)
  for out, w in zip(outs, ws):
    np.testing.assert_allclose(np.asarray(out), np.asarray(x) @ w, rtol=1e-5, atol=1e-4)


def test_calls_from_several_threads_at_once_all_finish_correctly():
  # Programs run from several Python threads post their jobs to the same
  # helper thread, each replacing the one before if it was not taken yet:
  # every caller must still get its own whole product.
  x = jnp.asarray(_random((3, 256), 4))
  ws = [_random((256, 32 * (i + 5)), 20 + i) for i in range(4)]
  panels = [cpu_kernels.pack(jnp.asarray(w)) for w in ws]
  run = jax.jit(cpu_kernels.matmul)
  results = [[] for _ in ws]

  def worker(i):
    for _ in range(25):
      results[i].append(np.asarray(run(x, panels[i])))

  threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(len(ws))]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=60)
  assert not any(t.is_alive() for t in threads)
  for w, outs in zip(ws, results):
    assert len(outs) == 25
    for out in outs:
      np.testing.assert_allclose(out, np.asarray(x) @ w, rtol=1e-5, atol=1e-4)


def test_pack_and_pack_table_round_trip_and_index_as_documented():
  w = _random((5, 64), 3)
  panels = cpu_kernels.pack(jnp.asarray(w))
  assert panels.shape == (2, 5, 32)
  np.testing.assert_array_equal(np.asarray(panels[1, :, 7]), w[:, 32 + 7])
  np.testing.assert_array_equal(np.asarray(cpu_kernels.unpack(panels)), w)
  table = _random((96, 8), 4)  # [V, D]
  packed = cpu_kernels.pack_table(jnp.asarray(table))
  assert packed.shape == (3, 8, 32)
  for v in (0, 31, 32, 95):  # token v's embedding, as `model.PackedEmbed` reads it
    np.testing.assert_array_equal(np.asarray(packed[v // 32, :, v % 32]), table[v])
  np.testing.assert_array_equal(np.asarray(cpu_kernels.unpack_table(packed)), table)


def test_unpackable_shapes_are_refused_with_the_reason():
  assert not cpu_kernels.packable((8, 33)) and cpu_kernels.packable((8, 64))
  with pytest.raises(ValueError, match="33 columns are not a multiple of 32"):
    cpu_kernels.pack(jnp.zeros((8, 33)))
  with pytest.raises(ValueError, match="40 rows are not a multiple of 32"):
    cpu_kernels.pack_table(jnp.zeros((40, 8)))


def test_a_failed_compile_says_why_and_leaves_no_library(monkeypatch, tmp_path):
  monkeypatch.setenv("JSPEC_CACHE", str(tmp_path))
  monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
  with pytest.raises(RuntimeError, match=r"compiling cpu_kernels\.cc, cpu_attention\.cc, cpu_int4\.cc failed"):
    cpu_kernels.build()
  assert not list(tmp_path.rglob("*.so")) and not list(tmp_path.rglob("*.tmp"))


def _process_state(pid: int):
  """The state letter of the `sleep` process `pid` ("S", "R", "Z", ...), or None once it is gone."""
  try:
    state = pathlib.Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    if state not in ("Z", "X") and b"sleep" not in pathlib.Path(f"/proc/{pid}/cmdline").read_bytes():
      return None  # the pid now names another process
    return state
  except FileNotFoundError:
    return None


@pytest.mark.slow
def test_a_compiler_that_hangs_is_stopped_and_jspec_info_says_so(monkeypatch, tmp_path, capsys):
  # A "compiler" that never returns, with a child of its own (as c++ runs cc1plus).
  hang = tmp_path / "hang.sh"
  hang.write_text(f"#!/bin/sh\nsleep 600 &\necho $! > {tmp_path}/child.pid\nwait\n")
  hang.chmod(0o755)
  monkeypatch.setenv("JSPEC_CACHE", str(tmp_path / "cache"))
  monkeypatch.setenv("CXX", str(hang))
  monkeypatch.setenv("JSPEC_KERNEL_BUILD_TIMEOUT", "1.5")
  start = time.monotonic()
  with pytest.raises(cpu_kernels.BuildTimeout, match=r"^compiler timed out after 1\.5 s"):
    cpu_kernels.build()
  assert time.monotonic() - start < 30
  child = int((tmp_path / "child.pid").read_text())
  # Gone, or a zombie nobody reaped: not sleeping. A killed process can take
  # a moment to finish exiting on a loaded host (it reads "R" meanwhile), so
  # the check waits a bounded while; the pid may also be reused by then.
  deadline = time.monotonic() + 10
  while (state := _process_state(child)) not in (None, "Z", "X"):
    assert time.monotonic() < deadline, f"the compiler's child {child} is still alive ({state})"
    time.sleep(0.05)
  assert not list(tmp_path.rglob("*.so")) and not list(tmp_path.rglob("*.tmp"))
  # A fresh process's first ask: not available, with the reason, and `jspec info` says it.
  monkeypatch.setattr(cpu_kernels, "_load", functools.lru_cache(maxsize=1)(
      cpu_kernels._load.__wrapped__))
  assert not cpu_kernels.available()
  assert cpu_kernels.unavailable_reason().startswith("compiler timed out after 1.5 s")
  assert cli.main(["info"]) == 0
  assert "cpu kernels: not built (compiler timed out after 1.5 s" in capsys.readouterr().out


def test_the_build_timeout_comes_from_the_environment(monkeypatch):
  monkeypatch.delenv("JSPEC_KERNEL_BUILD_TIMEOUT", raising=False)
  assert cpu_kernels.build_timeout() == cpu_kernels.BUILD_TIMEOUT_S < 300
  monkeypatch.setenv("JSPEC_KERNEL_BUILD_TIMEOUT", "45")
  assert cpu_kernels.build_timeout() == 45.0
  for bad in ("soon", "0", "-3", "nan", "inf"):
    monkeypatch.setenv("JSPEC_KERNEL_BUILD_TIMEOUT", bad)
    with pytest.raises(RuntimeError, match="JSPEC_KERNEL_BUILD_TIMEOUT"):
      cpu_kernels.build_timeout()


@pytest.mark.slow
def test_turning_the_kernel_off_falls_back_to_xla_forms():
  # A fresh process: availability is decided once per process.
  code = ("import sys; sys.path.insert(0, 'tests'); import tiny; from jspec import cpu_kernels; "
          "b = tiny.packable_pair(0); "
          "print(cpu_kernels.available(), cpu_kernels.unavailable_reason(), b.target.backend.kernels, "
          "type(b.target.params['layers']['0']['mlp']['up']['w']).__name__)")
  env = {**os.environ, "JSPEC_CPU_KERNELS": "0"}
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       check=True, cwd=pathlib.Path(__file__).parent.parent).stdout
  assert out.split() == ["False", "turned", "off", "by", "JSPEC_CPU_KERNELS=0", "False", "Dense"]


def _int8(shape, seed):
  return np.random.RandomState(seed).randint(-127, 128, size=shape).astype(np.int8)


def test_int8_kernels_build_for_the_hosts_instructions():
  if not HAVE_COMPILER:
    pytest.skip("no C++ compiler here")
  flags = open("/proc/cpuinfo").read().split() if os.path.exists("/proc/cpuinfo") else []
  want = (("vnni",) if "avx512_vnni" in flags and "avx512f" in flags else ()) + (
      ("avx2",) if "avx2" in flags else ())
  assert cpu_kernels.int8_kinds() == want
  assert cpu_kernels.int8_kind() == (want[0] if want else None)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["vnni", "avx2"])
@pytest.mark.parametrize("m", [1, 2, 3, 9, 13])
@pytest.mark.parametrize("k,n", [(64, 32), (37, 96), (896, 128)])
def test_matmul_int8_is_exact(kind, m, k, n, monkeypatch):
  # K = 37 is padded to 40 inside; M = 3 and 13 span row tiles of 2 and 12.
  if kind not in cpu_kernels.int8_kinds():
    pytest.skip(f"no {kind} int8 kernel on this host")
  monkeypatch.setattr(cpu_kernels, "int8_kind", lambda: kind)
  xq, q = _int8((m, k), m), _int8((n, k), k + n)
  panels, sums = cpu_kernels.pack_int8(jnp.asarray(q))
  want = xq.astype(np.int64) @ q.astype(np.int64).T
  got = jax.jit(cpu_kernels.matmul_int8)(jnp.asarray(xq), panels, sums)
  assert got.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(got), want)
  monkeypatch.setattr(cpu_kernels, "int8_kind", lambda: None)
  fallback = jax.jit(cpu_kernels.matmul_int8)(jnp.asarray(xq), panels, sums)  # XLA's int8 dot
  np.testing.assert_array_equal(np.asarray(fallback), want)


def test_pack_int8_interleaves_four_k_per_output_and_round_trips():
  q = _int8((64, 10), 5)
  panels, sums = cpu_kernels.pack_int8(jnp.asarray(q))
  assert panels.shape == (2, 3, 32, 4) and panels.dtype == jnp.int8  # K 10 -> 12
  np.testing.assert_array_equal(np.asarray(panels[1, 2, 5, :2]), q[32 + 5, 8:10])
  np.testing.assert_array_equal(np.asarray(panels[1, 2, 5, 2:]), [0, 0])  # padding
  np.testing.assert_array_equal(np.asarray(sums), q.astype(np.int32).sum(axis=1))
  np.testing.assert_array_equal(np.asarray(cpu_kernels.unpack_int8(panels, 10)), q)
  with pytest.raises(ValueError, match="40 rows are not a multiple of 32"):
    cpu_kernels.pack_int8(jnp.zeros((40, 8), jnp.int8))


def test_layer_variants_pick_the_indexed_layers_weight():
  # A loop over layers hands the kernels every layer's weight and a traced
  # index (`LayerPick`); each index must give that layer's product, and an
  # index past the layers is an error, not a read out of bounds.
  if not cpu_kernels.available():
    pytest.skip(f"kernel unavailable: {cpu_kernels.unavailable_reason()}")
  x = jnp.asarray(_random((3, 64), 1))
  ws = tuple(cpu_kernels.pack(jnp.asarray(_random((64, 96), 10 + i))) for i in range(3))
  pick = jax.jit(lambda x, i, *ws: cpu_kernels.matmul(x, cpu_kernels.LayerPick(ws, i)))
  for i in range(3):
    np.testing.assert_array_equal(np.asarray(pick(x, jnp.int32(i), *ws)),
                                  np.asarray(jax.jit(cpu_kernels.matmul)(x, ws[i])))
  with pytest.raises(Exception, match="layer 3 outside"):
    jax.block_until_ready(pick(x, jnp.int32(3), *ws))
  if cpu_kernels.int8_kind() is None:
    return
  xq = jnp.asarray(_int8((2, 40), 2))
  tables = [cpu_kernels.pack_int8(jnp.asarray(_int8((64, 40), 20 + i))) for i in range(3)]
  panels = tuple(t[0] for t in tables)
  pick8 = jax.jit(lambda xq, i, sums, *ps: cpu_kernels.matmul_int8(
      xq, cpu_kernels.LayerPick(ps, i), sums))
  for i in range(3):
    np.testing.assert_array_equal(np.asarray(pick8(xq, jnp.int32(i), tables[i][1], *panels)),
                                  np.asarray(jax.jit(cpu_kernels.matmul_int8)(xq, *tables[i])))


@pytest.mark.parametrize("kind", ["vnni", "avx2"])
@pytest.mark.parametrize("m", [1, 2, 13])
def test_int8_matrices_in_one_call_are_each_ones_own(kind, m, monkeypatch):
  # Three matrices of 7, 3 and 1 panels (AVX2's row takes two in step, so
  # some are left over) and three layers with their own numbers; K = 37 is
  # padded inside. Every output must be that layer's own matrix's product,
  # exactly, and the program must hold one call for all three.
  if kind not in cpu_kernels.int8_kinds():
    pytest.skip(f"no {kind} int8 kernel on this host")
  monkeypatch.setattr(cpu_kernels, "int8_kind", lambda: kind)
  k, widths = 37, (224, 96, 32)
  layers = [[cpu_kernels.pack_int8(jnp.asarray(_int8((n, k), 10 * i + n))) for n in widths]
            for i in range(3)]
  xq = jnp.asarray(_int8((m, k), m))

  def run(i, xq):  # the sums picked as `weights.pick` picks them
    return cpu_kernels.matmul_int8_many(xq, [
        (cpu_kernels.LayerPick(tuple(layer[j][0] for layer in layers), i),
         jnp.stack([layer[j][1] for layer in layers])[i]) for j in range(len(widths))])

  target = {"vnni": cpu_kernels.TARGET_INT8_MANY, "avx2": cpu_kernels.TARGET_S8_MANY}[kind]
  text = jax.jit(run).lower(jnp.int32(0), xq).as_text()
  assert text.count(f"@{target}(") == 1 and text.count("custom_call") == 1
  def exact(panels):  # the int64 product with this matrix
    q = np.asarray(cpu_kernels.unpack_int8(panels, k))
    return np.asarray(xq, np.int64) @ q.astype(np.int64).T

  for i, layer in enumerate(layers):
    got = jax.jit(run)(jnp.int32(i), xq)
    for j, (panels, _) in enumerate(layer):
      assert got[j].shape == (m, widths[j])
      np.testing.assert_array_equal(np.asarray(got[j]), exact(panels))
  for (panels, _), y in zip(layers[2], cpu_kernels.matmul_int8_many(xq, layers[2])):  # arrays
    np.testing.assert_array_equal(np.asarray(y), exact(panels))


def test_dot_many_quantizes_x_once_for_int8_panels_and_matches_dot():
  if cpu_kernels.int8_kind() is None:
    pytest.skip("no int8 kernel on this host")
  from jspec import weights
  ws = [weights.to_int8(weights.Dense(jnp.asarray(_random((64, n), n))), panels=True)
        for n in (96, 32, 64)]
  x = jnp.asarray(_random((2, 3, 64), 5))
  for y, w in zip(weights.dot_many(x, ws), ws):
    np.testing.assert_array_equal(np.asarray(y), np.asarray(weights.dot(x, w)))
  text = jax.jit(lambda x: weights.dot_many(x, ws)).lower(x).as_text()
  assert text.count("custom_call") == 1
