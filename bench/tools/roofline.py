"""How close a target-only step is to the memory roof, and where the rest goes.

    python -m bench.tools.roofline [--reps 12] [--gib 1] [--slots 512] [--filled 200]

The bench's roofline fraction divides a decode's median weight-read rate by
the best of several reads of 1 GiB (`bench.memory`). This tool times, in
one process and alternating rep by rep so that a noisy shared machine slows
all alike:

  forward   one T=1 step of the 1.5B target (random weights of the real
            shapes, fp32, stored for jspec's CPU kernels as `jspec.load`
            stores them on CPU; the layers as one loop), on a cache of
            --slots slots holding --filled tokens, reading the whole float
            head (a verify's; not the greedy head of a target-only step);
  forward_xla_attention  the same step with XLA's attention in the loop
            instead of jspec's attention kernel
            (`jspec.Settings(fused_attention=False)`);
  products  only that step's matrix products (each layer's q, k, v, o,
            gate, up and down, then the head), chained as in the forward;
  xla_matvec  XLA's matrix-vector product over --gib GiB stored [rows, K]
            (one of the reads `bench.memory` takes the best of; an XLA sum
            is another, often faster);
  kernel_matvec  jspec's kernel over the same bytes, stored as panels.

It prints each one's median and best ms and GB/s (weight bytes over time),
then the forward's median against the XLA matvec's median and best, and
against the forward with XLA's attention. The gap between forward and
products is the rest of a step (attention, norms, the loop); the gap
between the kernel and XLA on one big matrix is the kernel's own.
docs/decisions.md cites the figures ("Kernels", "Attention kernel").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from bench import memory
from bench import shapes
from jspec import bundle as bundle_lib
from jspec import cache as cache_lib
from jspec import cpu_kernels
from jspec import model
from jspec import weights


def _products(cfg):
  """The products of one T=1 forward, chained: x [1, D] -> logits [1, V]."""

  def run(params, x):
    module = model.merge(cfg, params)
    for block in module.layers:
      attn, mlp = block.attn, block.mlp
      q = weights.dot(x, attn.q.w.get_value())  # [1, Nq]
      k = weights.dot(x, attn.k.w.get_value())  # [1, Nkv]
      v = weights.dot(x, attn.v.w.get_value())
      h = weights.dot(q + jnp.sum(k) + jnp.sum(v), attn.o.w.get_value())  # [1, D]
      gate = weights.dot(h, mlp.gate.w.get_value())  # [1, F]
      up = weights.dot(h, mlp.up.w.get_value())
      x = x + 1e-3 * weights.dot(gate * up, mlp.down.w.get_value())
    return weights.dot(x, model.head_of(module))  # [1, V]: untied, or the tied table

  return jax.jit(run)


def _forward(target: jspec.Model, token, cache, fused: bool):
  """One T=1 forward compiled with or without jspec's attention kernel.

  Args:
    target: the prepared target.
    token: [1, 1] int32.
    cache: its KV cache.
    fused: attend with jspec's kernel (`model.Backend.fused_attention`).

  Returns:
    The compiled forward, (params, token, cache) -> logits.
  """
  arch = model.Arch(target.cfg, dataclasses.replace(target.backend, fused_attention=fused))
  return jax.jit(lambda p, x, c: model.forward(arch, p, x, c)[0]).lower(
      target.params, token, cache).compile()


def _cases(cfg, gib: float, slots: int, filled: int) -> tuple[dict, dict]:
  """{name: zero-argument timed call} and {name: weight bytes it reads}."""
  # The forwards read the float head: the target needs no greedy head.
  target = bundle_lib.prepare(cfg, model.init_params(cfg, jax.random.key(0)), "target",
                              jspec.Settings(kernels=True, greedy_head=False), consume=True)
  params = target.params
  weight_bytes = memory.forward_bytes(cfg, params)  # what `bench` counts
  cache = cache_lib.with_lengths(cache_lib.init(cfg, 1, slots, target.backend.dtype),
                                 jnp.array([filled], jnp.int32))
  token = jnp.ones((1, 1), jnp.int32)
  forward = _forward(target, token, cache, fused=True)
  forward_xla = _forward(target, token, cache, fused=False)
  products = _products(cfg)
  x = jnp.ones((1, cfg.hidden_size), jnp.float32)

  k = cfg.hidden_size
  n = max(32, int(gib * (1 << 30)) // 4 // k // 32 * 32)  # rows, a whole number of panels
  rows = jnp.ones((n, k), jnp.float32)  # [N, K]
  panels = jnp.ones((n // 32, k, 32), jnp.float32)  # the same [K, N] as panels
  vector = jnp.ones((k,), jnp.float32)
  row = vector[None]  # [1, K]: made once, so each timed call is only the product
  matvec = jax.jit(lambda w, v: w @ v)
  kernel = jax.jit(cpu_kernels.matmul)
  cases = {
      "forward": lambda: forward(params, token, cache),
      "forward_xla_attention": lambda: forward_xla(params, token, cache),
      "products": lambda: products(params, x),
      "xla_matvec": lambda: matvec(rows, vector),
      "kernel_matvec": lambda: kernel(row, panels),
  }
  sizes = {"forward": weight_bytes, "forward_xla_attention": weight_bytes,
           "products": weight_bytes, "xla_matvec": rows.nbytes, "kernel_matvec": panels.nbytes}
  return cases, sizes


def main(argv=None) -> dict:
  """Measures and prints the figures (text, then one JSON line).

  Args:
    argv: command-line arguments (see module docstring).

  Returns:
    {name: {"median_ms", "best_ms", "median_gbs", "best_gbs"}, "forward_vs_matvec":
    {"median", "best"}, "forward_vs_xla_attention": the forward's median time over
    forward_xla_attention's}.
  """
  parser = argparse.ArgumentParser(prog="python -m bench.tools.roofline", description=__doc__)
  parser.add_argument("--reps", type=int, default=12, help="timed calls of each (default 12)")
  parser.add_argument("--gib", type=float, default=1.0,
                      help="size of the matrix-vector products' matrix in GiB (default 1)")
  parser.add_argument("--slots", type=int, default=512, help="KV cache slots (default 512)")
  parser.add_argument("--filled", type=int, default=200,
                      help="tokens already in the cache (default 200; fewer than --slots)")
  args = parser.parse_args(argv)
  if args.reps < 1 or not args.gib > 0:
    parser.error(f"--reps {args.reps} --gib {args.gib}: expected at least 1 rep and a size above 0")
  if not 0 <= args.filled < args.slots:
    parser.error(f"--slots {args.slots} --filled {args.filled}: expected 0 <= filled < slots")
  if not cpu_kernels.available():
    raise SystemExit(f"jspec's CPU kernel is unavailable here: {cpu_kernels.unavailable_reason()}")
  cases, sizes = _cases(shapes.QWEN25_CODER_1_5B, args.gib, args.slots, args.filled)
  for call in cases.values():
    jax.block_until_ready(call())  # compile and touch every page first
  times = {name: [] for name in cases}
  for rep in range(args.reps):
    order = list(cases) if rep % 2 == 0 else list(reversed(cases))
    for name in order:
      start = time.perf_counter()
      jax.block_until_ready(cases[name]())
      times[name].append(time.perf_counter() - start)
  out = {}
  for name, ts in times.items():
    med, best = float(np.median(ts)), float(np.min(ts))
    out[name] = {"median_ms": 1e3 * med, "best_ms": 1e3 * best,
                 "median_gbs": sizes[name] / med / 1e9, "best_gbs": sizes[name] / best / 1e9}
    print(f"{name:21s} median {1e3 * med:8.2f} ms {out[name]['median_gbs']:6.1f} GB/s   "
          f"best {1e3 * best:8.2f} ms {out[name]['best_gbs']:6.1f} GB/s", flush=True)
  out["forward_vs_matvec"] = {
      "median": out["forward"]["median_gbs"] / out["xla_matvec"]["median_gbs"],
      "best": out["forward"]["median_gbs"] / out["xla_matvec"]["best_gbs"]}
  out["forward_vs_xla_attention"] = out["forward"]["median_ms"] / out["forward_xla_attention"]["median_ms"]
  print(f"forward's median GB/s over XLA matvec's median {out['forward_vs_matvec']['median']:.0%}, "
        f"over its best {out['forward_vs_matvec']['best']:.0%}; its median time "
        f"over the forward with XLA's attention {out['forward_vs_xla_attention']:.3f}", flush=True)
  print(json.dumps(out))
  return out


if __name__ == "__main__":
  main()
