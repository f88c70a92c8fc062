"""How far batching can lift server throughput on this host: a floor from arithmetic alone.

    python -m bench.tools.serve_bound [--rows 8] [--max-new-tokens 64] [--reps 3]
                                      [--out bench/results/serve_bound_cpu.json]

Issue 37 asks 8 concurrent greedy requests to run at 3x the tok/s of the
same 8 served one at a time. Both passes do the same prefill work, and an
exact target multiplies float32 activations by every weight once per row,
so no kernel can make a pass cost less than its multiply-adds over the
host's fastest float32 rate. This tool measures, in one process on the
default pair (`serve_load`'s prompts: the first `--rows` of the suite,
greedy, EOS off):

  roof        the fastest float32 multiply-add rate seen on this host, the
              higher of: a C loop of independent vector FMAs on registers
              (no memory; one thread per core the host reports, compiled
              with `cc -O3 -march=native` as the kernels are), and XLA's
              matrix product [512, 1536] x [1536, 8960] (the target's gate
              shape); best of `--reps` x 5 runs each, as multiply-adds/s;
  widen       the block kernel's inner loop for 8 rows alone, from L1: two
              vectors of int8 weights widened per k, then 8 rows x 2 FMAs
              (same compiler and threads): the fastest an 8-row step can
              multiply with the target stored as it is (int8 blocks);
  alone       each prompt by itself with the default method (what a server
              without batching does): prefill and decode seconds;
  together    the rows as one batch, target-only (what `jspec serve` runs
              for a batch: `--speculate-max-batch` 1), prefill row by row
              then decode;
  step        target-only steps of one row and of all the rows, from the
              decode seconds over the rounds.

It then counts the multiply-adds a pass cannot avoid: every prompt token
through the layers (the head only for each prompt's last token), and every
decode step's rows through the layers and the head. The prefill's over the
roof plus the decode's over the widened loop's rate is the fastest any
kernel could run the batched pass (`floor_together_s`). Against it:

  best_ratio_this_host_allows   the one-at-a-time pass as measured;
  best_ratio_prefill_at_floor   the same, its prefill (the same tokens) at
                                the floor too: like for like;
  best_ratio_decode_only        the decodes alone, what long outputs tend
                                to (`_any_kernel`: the batch's decode at
                                the plain FMA roof).

The floor leaves out attention, norms and the loop, so the true ceiling is
lower still. Run it on a quiet host: load slows the measured passes more
than the best-of roofs.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import tempfile
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from bench import prompts as prompts_lib
from bench import results

TARGET_RATIO = 3.0  # issue 37


def roof_macs_per_s(reps: int) -> dict[str, float]:
  """The fastest float32 multiply-add rate XLA reaches here, on a compute-bound product.

  Args:
    reps: rounds of 5 timed calls.

  Returns:
    {"best": multiply-adds/s of the fastest call, "median": of all calls}.
  """
  m, k, n = 512, 1536, 8960
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((m, k), np.float32))  # [M, K]
  w = jnp.asarray(rng.standard_normal((k, n), np.float32))  # [K, N]
  product = jax.jit(lambda a, b: a @ b)
  product(x, w).block_until_ready()
  times = []
  for _ in range(reps * 5):
    t0 = time.perf_counter()
    product(x, w).block_until_ready()
    times.append(time.perf_counter() - t0)
  macs = m * k * n
  return {"best": macs / min(times), "median": macs / statistics.median(times)}


FMA_LOOP = r"""
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef __AVX512F__
typedef __m512 V;
#define LANES 16
#define FMA _mm512_fmadd_ps
#define SET1 _mm512_set1_ps
#define SUM(v) _mm512_reduce_add_ps(v)
static V WIDEN(const int8_t* q) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)q)));
}
#else
typedef __m256 V;
#define LANES 8
#define FMA _mm256_fmadd_ps
#define SET1 _mm256_set1_ps
static float SUM(V v) { float f[8]; _mm256_storeu_ps(f, v); return f[0] + f[7]; }
static V WIDEN(const int8_t* q) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)q)));
}
#endif
static long iters;
static int widen;
#define ROWS 8
// Register FMAs only: the arithmetic's roof.
static float fma_only(void) {
  V b = SET1(0.99999994f), c = SET1(1e-7f);
  V a0 = SET1(1.f), a1 = SET1(1.1f), a2 = SET1(1.2f), a3 = SET1(1.3f), a4 = SET1(1.4f),
    a5 = SET1(1.5f), a6 = SET1(1.6f), a7 = SET1(1.7f), a8 = SET1(1.8f), a9 = SET1(1.9f),
    a10 = SET1(2.f), a11 = SET1(2.1f);
  for (long i = 0; i < iters; ++i) {
    a0 = FMA(a0, b, c); a1 = FMA(a1, b, c); a2 = FMA(a2, b, c); a3 = FMA(a3, b, c);
    a4 = FMA(a4, b, c); a5 = FMA(a5, b, c); a6 = FMA(a6, b, c); a7 = FMA(a7, b, c);
    a8 = FMA(a8, b, c); a9 = FMA(a9, b, c); a10 = FMA(a10, b, c); a11 = FMA(a11, b, c);
  }
  return SUM(a0) + SUM(a1) + SUM(a2) + SUM(a3) + SUM(a4) + SUM(a5) + SUM(a6) + SUM(a7) +
         SUM(a8) + SUM(a9) + SUM(a10) + SUM(a11);
}
// The block kernel's inner loop for 8 rows, from L1: each k widens two
// vectors of int8 weights once and multiplies them into 8 rows' sums.
static float widen_rows(void) {
  static int8_t q[2 * LANES * 64];
  static float x[64 * ROWS];
  for (int i = 0; i < 2 * LANES * 64; ++i) q[i] = (int8_t)(i * 7);
  for (int i = 0; i < 64 * ROWS; ++i) x[i] = 1e-3f * (float)i;
  V acc[ROWS][2];
  for (int m = 0; m < ROWS; ++m) acc[m][0] = acc[m][1] = SET1(0.f);
  for (long i = 0; i < iters / 64; ++i) {
    for (int k = 0; k < 64; ++k) {
      V w0 = WIDEN(q + k * 2 * LANES), w1 = WIDEN(q + k * 2 * LANES + LANES);
      for (int m = 0; m < ROWS; ++m) {
        V b = SET1(x[k * ROWS + m]);
        acc[m][0] = FMA(b, w0, acc[m][0]);
        acc[m][1] = FMA(b, w1, acc[m][1]);
      }
    }
  }
  float total = 0.f;
  for (int m = 0; m < ROWS; ++m) total += SUM(acc[m][0]) + SUM(acc[m][1]);
  return total;
}
static void* run(void* out) {
  *(float*)out = widen ? widen_rows() : fma_only();
  return NULL;
}
int main(int argc, char** argv) {
  int threads = atoi(argv[1]);
  iters = atol(argv[2]);
  widen = argc > 3 && strcmp(argv[3], "widen") == 0;
  pthread_t t[64];
  float out[64];
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (int i = 0; i < threads; ++i) pthread_create(&t[i], NULL, run, &out[i]);
  for (int i = 0; i < threads; ++i) pthread_join(t[i], NULL);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  double s = (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec);
  // Multiply-adds: 12 vector FMAs an iteration, or 2 vectors x ROWS a k.
  double fmas = widen ? (double)(iters / 64) * 64 * 2 * ROWS : (double)iters * 12;
  printf("%.6e %f\n", threads * fmas * LANES / s, out[0]);
  return 0;
}
"""


def fma_loop_macs_per_s(reps: int, widen: bool = False) -> Optional[dict[str, float]]:
  """Multiply-adds/s of independent register FMAs on every core: the arithmetic's own roof.

  Args:
    reps: rounds of 5 timed runs.
    widen: time the block kernel's 8-row inner loop instead (int8 weights
      widened in registers, from L1): the roof of an exact 8-row step.

  Returns:
    {"best", "median"} multiply-adds/s, or None where no C compiler builds it.
  """
  with tempfile.TemporaryDirectory() as tmp:
    src, exe = pathlib.Path(tmp) / "fma.c", pathlib.Path(tmp) / "fma"
    src.write_text(FMA_LOOP)
    try:
      subprocess.run(["cc", "-O3", "-march=native", "-pthread", str(src), "-o", str(exe)],
                     check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
      return None
    mode = ["widen"] if widen else []
    rates = [float(subprocess.run([str(exe), str(os.cpu_count()), "20000000"] + mode, check=True,
                                  capture_output=True, text=True).stdout.split()[0])
             for _ in range(reps * 5)]
  return {"best": max(rates), "median": statistics.median(rates)}


def target_macs(bundle: jspec.Bundle) -> dict[str, int]:
  """Multiply-adds per token of the target: its layers' matrices, and its head.

  Args:
    bundle: from `jspec.load`.

  Returns:
    {"layers": per token through every layer, "head": the head's, per token}.
  """
  cfg = bundle.target.cfg
  d, f = cfg.hidden_size, cfg.intermediate_size
  qo, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  per_layer = 2 * d * qo + 2 * d * kv + 3 * d * f  # q and o, k and v, gate, up and down
  return {"layers": cfg.num_layers * per_layer, "head": d * cfg.vocab_size}


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Measures the passes and prints the bound as JSON.

  Args:
    argv: command-line arguments (see module docstring).

  Returns:
    0.
  """
  parser = argparse.ArgumentParser(prog="python -m bench.tools.serve_bound", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--rows", type=int, default=8)
  parser.add_argument("--max-new-tokens", type=int, default=64)
  parser.add_argument("--reps", type=int, default=3)
  parser.add_argument("--out", type=pathlib.Path,
                      default=pathlib.Path("bench/results/serve_bound_cpu.json"))
  args = parser.parse_args(argv)
  if not 1 <= args.rows <= 64 or args.reps < 1 or args.max_new_tokens < 2:
    parser.error("--rows must be 1 to 64, --reps at least 1, --max-new-tokens at least 2")
  bundle = jspec.load(progress=False)
  chosen = [prompts_lib.SUITE[i % len(prompts_lib.SUITE)] for i in range(args.rows)]
  ids = [prompts_lib.encode(p, bundle.tokenizer) for p in chosen]
  n = args.max_new_tokens
  kw = dict(max_new_tokens=n, temperature=0.0, stop_at_eos=False)

  def alone() -> dict[str, float]:
    runs = [jspec.generate(bundle, i, **kw).stats for i in ids]
    return {"prefill_s": sum(r["prefill_s"] for r in runs),
            "decode_s": sum(r["decode_s"] for r in runs)}

  def together() -> dict[str, float]:
    stats = jspec.generate(bundle, ids, method="target", **kw)[0].stats  # one batch: shared times
    return {"prefill_s": stats["prefill_s"], "decode_s": stats["decode_s"],
            "rounds": stats["rounds"]}

  def one_row() -> dict[str, float]:
    stats = jspec.generate(bundle, ids[0], method="target", **kw).stats
    return {"decode_s": stats["decode_s"], "rounds": stats["rounds"]}

  for fn in (alone, together, one_row):  # compiles
    fn()
  records: dict[str, list] = {"roof": [], "fma_loop": [], "widen": [], "alone": [],
                              "together": [], "one_row": []}
  for rep in range(args.reps):
    for name, fn in (("roof", lambda: roof_macs_per_s(1)),
                     ("fma_loop", lambda: fma_loop_macs_per_s(1)),
                     ("widen", lambda: fma_loop_macs_per_s(1, widen=True)), ("alone", alone),
                     ("together", together), ("one_row", one_row)):
      records[name].append(fn())
      print(f"rep {rep} {name}: {records[name][-1]}", flush=True)

  macs = target_macs(bundle)
  prompt_tokens = sum(len(i) for i in ids)
  # Every prompt token through the layers, each prompt's last through the
  # head; every decode step (n - 1 after the prefill's token) for every row
  # through the layers and the head.
  prefill_macs = prompt_tokens * macs["layers"] + len(ids) * macs["head"]
  decode_macs = (n - 1) * len(ids) * (macs["layers"] + macs["head"])
  med = lambda name, key: statistics.median(r[key] for r in records[name])
  roof = max(r["best"] for r in records["roof"] + [r for r in records["fma_loop"] if r])
  alone_s = statistics.median(r["prefill_s"] + r["decode_s"] for r in records["alone"])
  together_s = statistics.median(r["prefill_s"] + r["decode_s"] for r in records["together"])
  widen = max((r["best"] for r in records["widen"] if r), default=roof)
  floor_prefill = prefill_macs / roof
  floor_decode = decode_macs / widen  # kernels that widen int8 weights in registers
  floor_decode_any = decode_macs / roof  # any float32 kernel
  floor_s = floor_prefill + floor_decode
  alone_decode = med("alone", "decode_s")
  step_1 = med("one_row", "decode_s") / statistics.median(r["rounds"] for r in records["one_row"])
  step_b = med("together", "decode_s") / statistics.median(r["rounds"] for r in records["together"])
  summary = {
      "roof_macs_per_s_best": roof,
      "xla_product_macs_per_s_best": max(r["best"] for r in records["roof"]),
      "fma_loop_macs_per_s_best": max((r["best"] for r in records["fma_loop"] if r), default=None),
      "widen_8_rows_macs_per_s_best": widen,
      "roof_macs_per_s_median": statistics.median(r["median"] for r in records["roof"]),
      "target_macs_per_token": macs,
      "prompt_tokens": prompt_tokens,
      "alone_s": alone_s,
      "alone_prefill_s": med("alone", "prefill_s"),
      "together_s": together_s,
      "together_prefill_s": med("together", "prefill_s"),
      "measured_ratio": alone_s / together_s,
      "floor_together_s": floor_s,
      "floor_prefill_s": floor_prefill,
      "floor_decode_s": floor_decode,
      "alone_decode_s": alone_decode,
      # Generous: the one-at-a-time pass as measured, the batch at the floor.
      "best_ratio_this_host_allows": alone_s / floor_s,
      # Like for like: both passes' prefill (the same tokens) at the floor.
      "best_ratio_prefill_at_floor": (floor_prefill + alone_decode) / floor_s,
      # Any output length: decode alone, one at a time as measured.
      "best_ratio_decode_only": alone_decode / floor_decode,
      "best_ratio_decode_only_any_kernel": alone_decode / floor_decode_any,
      "target_ratio": TARGET_RATIO,
      "step_one_row_s": step_1,
      f"step_{len(ids)}_rows_s": step_b,
      f"step_{len(ids)}_rows_over_one_row": step_b / step_1,
      f"floor_step_{len(ids)}_rows_s": len(ids) * (macs["layers"] + macs["head"]) / widen,
  }
  doc = {"command": "python -m bench.tools.serve_bound " + " ".join(argv or []),
         "date": time.strftime("%Y-%m-%d %H:%M"), "load_average": os.getloadavg(),
         "prompts": [p.name for p in chosen], "max_new_tokens": n, "records": records,
         "summary": summary}
  results.write(doc, args.out)
  print(json.dumps(summary, indent=1))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
