"""How close a target-only step is to the memory roof, and where the rest goes.

    python -m bench.roofline [--reps 12] [--gib 1] [--slots 512] [--filled 200]

The bench's roofline fraction divides a decode's median weight-read rate by
the best of several reads of 1 GiB (`bench.memory`). This tool times, in
one process and alternating rep by rep so that a noisy shared machine slows
all alike:

  forward   one T=1 step of the 1.5B target (random weights of the real
            shapes, fp32, packed for jspec's CPU kernel as `generate` holds
            them on CPU; the layers as one loop), on a cache of --slots
            slots holding --filled tokens;
  forward_xla_attention  the same step with XLA's attention in the loop
            instead of jspec's attention kernel (JSPEC_FUSED_ATTENTION=0);
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
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench import memory
from bench import shapes
from jspec import cache as cache_lib
from jspec import cpu_kernels
from jspec import layout
from jspec import model


def _products(cfg):
  """The products of one T=1 forward, chained: x [1, D] -> logits [1, V]."""

  def run(params, x):
    for i in range(cfg.num_layers):
      attn, mlp = params[f"layers_{i}"]["self_attn"], params[f"layers_{i}"]["mlp"]
      q = cpu_kernels.matmul(x, attn["q_proj"]["panels"])  # [1, Nq]
      k = cpu_kernels.matmul(x, attn["k_proj"]["panels"])  # [1, Nkv]
      v = cpu_kernels.matmul(x, attn["v_proj"]["panels"])
      h = cpu_kernels.matmul(q + jnp.sum(k) + jnp.sum(v), attn["o_proj"]["panels"])  # [1, D]
      gate = cpu_kernels.matmul(h, mlp["gate_proj"]["panels"])  # [1, F]
      up = cpu_kernels.matmul(h, mlp["up_proj"]["panels"])
      x = x + 1e-3 * cpu_kernels.matmul(gate * up, mlp["down_proj"]["panels"])
    head = params["lm_head_panels"] if "lm_head_panels" in params else params["embed_tokens"]["panels"]
    return cpu_kernels.matmul(x, head)  # [V/32, D, 32]: untied, or the tied table

  return jax.jit(run)


def _forward(cfg, params, token, cache, fused: bool):
  """One T=1 forward compiled with or without jspec's attention kernel (read at trace time)."""
  saved = model.FUSED_ATTENTION
  model.FUSED_ATTENTION = fused
  try:
    return jax.jit(lambda p, x, c: model.forward(p, cfg, x, c)[0]).lower(
        params, token, cache).compile()
  finally:
    model.FUSED_ATTENTION = saved


def _cases(cfg, gib: float, slots: int, filled: int) -> tuple[dict, dict]:
  """{name: zero-argument timed call} and {name: weight bytes it reads}."""
  params = layout.convert(model.init_params(cfg, jax.random.key(0)), "packed")
  weight_bytes = memory.forward_bytes(params, cfg.tie_word_embeddings)  # what `bench` counts
  cache = cache_lib.with_lengths(cache_lib.init(cfg, 1, slots), jnp.array([filled], jnp.int32))
  token = jnp.ones((1, 1), jnp.int32)
  forward = _forward(cfg, params, token, cache, fused=True)
  forward_xla = _forward(cfg, params, token, cache, fused=False)
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
  parser = argparse.ArgumentParser(prog="python -m bench.roofline", description=__doc__)
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
