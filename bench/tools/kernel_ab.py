"""Two builds of jspec's fp32 (or int8) kernel, timed call by call on the real model's matrices.

    python -m bench.tools.kernel_ab --base REV [--m 1,3,9,17,33,320] [--reps 10] [--int8]

Builds `jspec/cpu_kernels.cc` as it is at git revision REV and as it is in
the working tree (the compiler and flags of `jspec.cpu_kernels`), registers
both, and times `jspec_gemm_f32` at each M (rows: 1 a decode step, gamma + 1
a verify, a prompt's length a prefill) on each weight matrix of one layer
of the 1.5B target and on its output head, in panels as `jspec.load`
stores them (`jspec.weights.Panels`). The two builds alternate rep by rep
over the same arrays, in turn first, so a noisy shared machine slows both
alike.

Per M it prints each build's median ms for the products of one forward (28
times the layer's matrices, plus the head), their GFLOPS, the median of the
paired ratios (working tree / base: below 1 is faster), and whether both
builds' outputs were bit for bit the same. Attention, norms and the rest of
a forward are not in it: `bench.tools.forward_cost` times whole forwards.

With --int8 it times the host's int8 kernel (`cpu_kernels.int8_kind`:
`jspec_gemm_s8` on AVX2, `jspec_gemm_i8` with VNNI) on the int8 draft's
matrices instead: the 0.5B's layers and its untied head, as the int8 draft
stores them (`jspec.weights.Int8Panels`), with int8 activations (GOPS: two
per multiply-add). docs/decisions.md, "Kernels" and "Int8 draft", cites
the figures.
"""

from __future__ import annotations

import argparse
import ctypes
import pathlib
import subprocess
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench import shapes
from jspec import cpu_kernels


def _matrices(cfg) -> list[tuple[int, int, int]]:
  """(K, N, times per forward) of every product of a forward: a layer's seven and the head."""
  d, f = cfg.hidden_size, cfg.intermediate_size
  kv = cfg.num_kv_heads * cfg.head_dim
  layer = [(d, cfg.num_heads * cfg.head_dim), (d, kv), (d, kv), (cfg.num_heads * cfg.head_dim, d),
           (d, f), (d, f), (f, d)]  # q, k, v, o, gate, up, down
  return [(k, n, cfg.num_layers) for k, n in layer] + [(d, cfg.vocab_size, 1)]


# The kernel each mode times: (FFI symbol, output dtype) by int8 kind (None: fp32).
_KERNELS = {None: ("JspecGemmF32", jnp.float32), "avx2": ("JspecGemmS8", jnp.int32),
            "vnni": ("JspecGemmI8", jnp.int32)}


def _register(library_path: pathlib.Path, name: str, kind=None):
  """Registers one build's kernel as FFI target `name`; returns a jitted x, panels -> y.

  Args:
    library_path: the build.
    name: the FFI target name to register it under.
    kind: None for the fp32 kernel, else the int8 kind ("avx2", "vnni").

  Returns:
    jitted (x [M, K], panels) -> y [M, N].
  """
  symbol, dtype = _KERNELS[kind]
  library = ctypes.cdll.LoadLibrary(str(library_path))
  jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")

  def matmul(x, panels):  # [M, K], [N/32, K, 32] or [N/32, K/4, 32, 4] -> [M, N]
    out = jax.ShapeDtypeStruct((x.shape[0], panels.shape[0] * cpu_kernels.PANEL), dtype)
    return jax.ffi.ffi_call(name, out)(x, panels)

  return jax.jit(matmul)


def _weights(matrices, key, int8: bool) -> list[jax.Array]:
  """Random panels for each (K, N, _): fp32 `cpu_kernels.pack`, or int8 `pack_int8` panels."""
  if not int8:
    return [cpu_kernels.pack(0.02 * jax.random.normal(jax.random.fold_in(key, i), (k, n), jnp.float32))
            for i, (k, n, _) in enumerate(matrices)]
  return [cpu_kernels.pack_int8(jax.random.randint(jax.random.fold_in(key, i), (n, k), -127, 128,
                                                   jnp.int8))[0]
          for i, (k, n, _) in enumerate(matrices)]


def _inputs(m: int, matrices, key, kind) -> list[jax.Array]:
  """Random [m, K] activations for each matrix: float32, int8 in [-127, 127] or uint8 (VNNI)."""
  if kind is None:
    return [jax.random.normal(jax.random.fold_in(key, 1000 + i), (m, k), jnp.float32)
            for i, (k, _, _) in enumerate(matrices)]
  low, high, dtype = (1, 256, jnp.uint8) if kind == "vnni" else (-127, 128, jnp.int8)
  return [jax.random.randint(jax.random.fold_in(key, 1000 + i), (m, k), low, high, jnp.int32)
          .astype(dtype) for i, (k, _, _) in enumerate(matrices)]


def _base_source(rev: str, directory: pathlib.Path) -> pathlib.Path:
  """`jspec/cpu_kernels.cc` at git revision `rev`, written into `directory`."""
  repo = cpu_kernels.SOURCE.parent.parent
  relative = cpu_kernels.SOURCE.relative_to(repo).as_posix()
  done = subprocess.run(["git", "-C", str(repo), "show", f"{rev}:{relative}"], capture_output=True,
                        text=True)
  if done.returncode != 0:
    raise SystemExit(f"--base {rev}: git could not show {relative} there: {done.stderr.strip()}")
  path = directory / cpu_kernels.SOURCE.name  # the same name: the build caches by content
  path.write_text(done.stdout)
  return path


def _time(fn, x, w) -> float:
  """Seconds for one call of fn(x, w)."""
  start = time.perf_counter()
  fn(x, w).block_until_ready()
  return time.perf_counter() - start


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--base", required=True, help="git revision of the build to compare against")
  ap.add_argument("--m", default="1,3,9,17,33,320", help="comma-separated row counts")
  ap.add_argument("--reps", type=int, default=10, help="paired repetitions per M")
  ap.add_argument("--int8", action="store_true",
                  help="time the host's int8 kernel on the int8 draft's matrices instead")
  args = ap.parse_args(argv)
  try:
    ms = [int(m) for m in args.m.split(",")]
  except ValueError:
    ap.error(f"--m {args.m!r}: expected comma-separated row counts, e.g. 1,9,320")
  if min(ms) < 1 or args.reps < 1:
    ap.error(f"--m {args.m} --reps {args.reps}: expected row counts and reps of at least 1")
  with tempfile.TemporaryDirectory() as tmp:
    base_source = _base_source(args.base, pathlib.Path(tmp))
    if not cpu_kernels.available():
      raise SystemExit(f"jspec's CPU kernel is unavailable here: {cpu_kernels.unavailable_reason()}")
    base_so = cpu_kernels.build(base_source)
  kind = None
  if args.int8:
    kind = cpu_kernels.int8_kind()
    if kind is None:
      raise SystemExit("--int8: this host has no int8 kernel (needs AVX2 or AVX-512 VNNI)")
  label = "GOPS" if args.int8 else "GFLOPS"
  builds = {"base": _register(base_so, f"jspec_ab_base_{kind}", kind),
            "tree": _register(cpu_kernels.build(), f"jspec_ab_tree_{kind}", kind)}
  cfg = shapes.QWEN25_CODER_0_5B if args.int8 else shapes.QWEN25_CODER_1_5B
  matrices = _matrices(cfg)
  key = jax.random.key(0)
  ws = _weights(matrices, key, args.int8)
  times = np.array([t for _, _, t in matrices], np.float64)
  flops_per_row = 2.0 * sum(k * n * t for k, n, t in matrices)
  print(f"base {args.base} ({base_so.parent.name}) vs working tree "
        f"({cpu_kernels.build().parent.name}), {kind or 'fp32'} kernel on the "
        f"{'0.5B draft' if args.int8 else '1.5B target'}'s matrices; "
        f"ms for one forward's products, median of {args.reps}")
  for m in ms:
    xs = _inputs(m, matrices, key, kind)
    outs = {name: [np.asarray(fn(x, w)) for x, w in zip(xs, ws)] for name, fn in builds.items()}
    same = all(np.array_equal(a, b) for a, b in zip(outs["base"], outs["tree"]))
    per = {name: [] for name in builds}
    for rep in range(args.reps):
      for name in (["base", "tree"] if rep % 2 == 0 else ["tree", "base"]):
        # Per matrix, so each is weighted by how often a forward runs it.
        per[name].append(sum(t * _time(builds[name], x, w) for x, w, t in zip(xs, ws, times)))
    med = {name: float(np.median(v)) for name, v in per.items()}
    ratio = float(np.median(np.array(per["tree"]) / np.array(per["base"])))
    print(f"M={m:<5d} base {med['base'] * 1e3:8.1f} ms {m * flops_per_row / med['base'] / 1e9:6.1f} "
          f"{label}  tree {med['tree'] * 1e3:8.1f} ms {m * flops_per_row / med['tree'] / 1e9:6.1f} "
          f"{label}  tree/base {ratio:.3f}  bit-identical {same}", flush=True)


if __name__ == "__main__":
  main()
