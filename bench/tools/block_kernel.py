"""jspec's int8 block (and bfloat16) kernels against its fp32 kernel on the 1.5B target's matrices.

    python -m bench.tools.block_kernel [--m 1,3,5,9,17] [--reps 7] [--breakdown 1]
                                       [--forms blk,blk4,blk4f,f32,bf16] [--layers 28] [--json OUT]

Times, in one process, the products of one forward of the 1.5B target
(Qwen2.5-Coder-1.5B: 28 layers of q [1536->1536], k, v [1536->256],
o [1536->1536], gate, up [1536->8960], down [8960->1536], then the head
[1536->151936]) with random weights in up to five forms:

  blk   int8 block panels (`cpu_kernels.pack_blocks` layout), as the GGUF
        file defines them: Q4_K (B 32, scales and offsets, q in [0, 15])
        for q, k, o, gate, up and half of v and down, Q6_K (B 16, scales, q
        in [-32, 31]) for the other half and the head, a byte per q;
        `cpu_kernels.matmul_blocks`.
  blk4  the same, with q two to a byte (`cpu_kernels.pack_nibbles`) where
        every layer of a kind is Q4_K (q, k, o, gate, up), as the target is
        prepared (`jspec.weights.uniform` keeps v and down a byte per q).
  blk4f blk4 with every scale and offset factored as the k-quant stores
        them (a float d per 256 inputs and an int8 per block,
        `cpu_kernels.pack_factored`), as the target is prepared now.
  f32   the same weights widened to float32 panels (`cpu_kernels.pack`
        layout); `cpu_kernels.matmul`. The baseline.
  bf16  those rounded to bfloat16 panels; `cpu_kernels.matmul_bf16`.

Each form is one compiled program chaining the products (x [M, 1536] through
every layer, then the head), so its weights (distinct per layer: 1.9, 6.2
and 3.1 GB, far above the caches) stream from memory once per call. The
forms alternate rep by rep, in turn first. Memory bandwidth is read
(`bench.memory`: the best of a numpy sum, an XLA sum and an XLA
matrix-vector product over 1 GiB, in a child process) just before and just
after; the roof is the higher of the two. A shared machine's bandwidth
drifts over minutes (on the 2-core VM, 5 to 12 GB/s within one run, with
other processes running), so every rep also reads 1 GiB in process (the
better of an XLA sum and an XLA matrix-vector product, in the same
alternating order): "rep" is the median over reps of each form's rate over
that rep's read. The load average before and after is printed too.

Per M it prints each form's median ms, the GB/s of weight bytes actually
read (blk: q + scales + offsets; f32: 4 bytes a weight; bf16: 2), that
rate's fraction of the roof and its rep fraction, and the median of the
paired speedups over f32 (blk4 also over blk, "/blk"; blk4f over blk4, "/blk4"). With --breakdown M it also times each matrix kind
alone at those M (all layers' copies of it in one program), to show where
the time goes.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench import memory
from bench import shapes
from jspec import cpu_kernels

KINDS = ("q", "k", "v", "o", "gate", "up", "down")
FORMS = ("blk", "blk4", "blk4f", "f32", "bf16")
NIBBLE_KINDS = ("q", "k", "o", "gate", "up")  # Q4_K in every layer of the Q4_K_M file
READ_BYTES = 1 << 30  # each rep's read (`_Reads`)


def _layer_specs(cfg) -> dict[str, tuple[int, int]]:
  """Matrix kind -> (K in, N out) of one layer."""
  d, f = cfg.hidden_size, cfg.intermediate_size
  nq, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  return {"q": (d, nq), "k": (d, kv), "v": (d, kv), "o": (nq, d), "gate": (d, f), "up": (d, f),
          "down": (f, d)}


def _gguf_form(kind: str, layer: int) -> tuple[int, bool]:
  """(B, offsets) of a matrix in the Q4_K_M file: Q6_K for half of v and down and the head."""
  if kind == "head" or (kind in ("v", "down") and layer % 2 == 0):
    return 16, False  # Q6_K
  return 32, True  # Q4_K


def _blocks(key, k: int, n: int, block: int, offsets: bool):
  """Random int8 block panels of a [K, N] weight: (qpanels, spanels, opanels or None)."""
  kq, ks, ko, kd = jax.random.split(key, 4)
  p = n // cpu_kernels.PANEL
  low, high = (0, 16) if offsets else (-32, 32)  # Q4_K's range, Q6_K's
  q = jax.random.randint(kq, (p, k, cpu_kernels.PANEL), low, high, jnp.int8)
  # scale d * sc as the k-quants define them: a float16 d per 256 inputs,
  # an integer sc per block (Q4_K's 6 bits, Q6_K's 8), so blk4f can factor them
  d = jax.random.uniform(kd, (p, k // 256, 1, cpu_kernels.PANEL), jnp.float32, 1e-5, 3e-5)
  d = d.astype(jnp.float16).astype(jnp.float32)
  sc_low, sc_high = (32, 64) if offsets else (64, 128)
  per = 256 // block
  s = (d * jax.random.randint(ks, (p, k // 256, per, cpu_kernels.PANEL), sc_low, sc_high)
       ).reshape(p, k // block, cpu_kernels.PANEL)
  o = (-(d * jax.random.randint(ko, (p, k // 256, per, cpu_kernels.PANEL), 0, 64)
         ).reshape(s.shape) if offsets else None)
  return q, s, o


def _factored(panels, block: int, k: int):
  """Float scale panels [P, K/B, 32] as `cpu_kernels.pack_factored` panels of the same numbers."""
  rows = np.asarray(cpu_kernels.unpack(panels)).T  # [N, K/B]
  factors = cpu_kernels.factor_scales(rows, block)
  if factors is None:
    raise ValueError("block_kernel: the random scales did not factor")
  return cpu_kernels.pack_factored(*factors)


def _weights(cfg, layers: int, key, forms) -> dict:
  """{form: {"layers": [{kind: weight}], "head": weight}} for each form."""
  specs = _layer_specs(cfg)
  widen, nibbles = jax.jit(cpu_kernels.widen_blocks), jax.jit(cpu_kernels.pack_nibbles)
  four = lambda kind, b: (nibbles(b[0]), *b[1:]) if kind in NIBBLE_KINDS else b
  convert = {"blk": lambda kind, b: b,
             "blk4": four,
             "blk4f": lambda kind, b: (four(kind, b)[0],) + tuple(
                 None if a is None else _factored(a, b[0].shape[1] // a.shape[1], b[0].shape[1])
                 for a in b[1:]),
             "f32": lambda kind, b: widen(*b),
             "bf16": lambda kind, b: widen(*b).astype(jnp.bfloat16)}
  out = {f: {"layers": []} for f in forms}
  for i in range(layers + 1):  # the last is the head
    parts = {"head": (cfg.hidden_size, cfg.vocab_size)} if i == layers else specs
    made = {f: {} for f in forms}
    for kind, (k, n) in parts.items():
      key, sub = jax.random.split(key)
      blocks = _blocks(sub, k, n, *_gguf_form(kind, i))
      for f in forms:
        made[f][kind] = convert[f](kind, blocks)
    for f in forms:
      if i == layers:
        out[f]["head"] = made[f]["head"]
      else:
        out[f]["layers"].append(made[f])
  return out


def _matmul(form: str):
  if form in ("blk", "blk4", "blk4f"):
    return lambda x, w: cpu_kernels.matmul_blocks(x, *w)
  return cpu_kernels.matmul_bf16 if form == "bf16" else cpu_kernels.matmul


def _chain(form: str):
  """A jitted forward's products: x [M, D] through every layer, then the head -> [M, V]."""
  mm = _matmul(form)

  def run(ws, x):
    for lw in ws["layers"]:
      q = mm(x, lw["q"])  # [M, Nq]
      k = mm(x, lw["k"])  # [M, Nkv]
      v = mm(x, lw["v"])
      h = mm(q + jnp.sum(k) + jnp.sum(v), lw["o"])  # [M, D]
      gate = mm(h, lw["gate"])  # [M, F]
      up = mm(h, lw["up"])
      x = x + 1e-3 * mm(gate * up, lw["down"])
    return mm(x, ws["head"])

  return jax.jit(run)


def _each(form: str, kind: str):
  """A jitted program of one matrix kind alone: every layer's copy (or the head) on one x."""
  mm = _matmul(form)

  def run(ws, x):
    if kind == "head":
      return mm(x, ws["head"])
    return tuple(mm(x, lw[kind]) for lw in ws["layers"])

  return jax.jit(run)


def _nbytes(tree) -> int:
  return sum(int(a.nbytes) for a in jax.tree_util.tree_leaves(tree))


def _select(ws, kind: str):
  if kind == "head":
    return {"head": ws["head"], "layers": []}
  return {"layers": [{kind: lw[kind]} for lw in ws["layers"]]}


def _paired(calls: dict, reps: int) -> dict[str, list[float]]:
  """Seconds per call of each zero-argument call, alternating which goes first."""
  for call in calls.values():
    jax.block_until_ready(call())  # compile, and touch every page
  times = {name: [] for name in calls}
  for rep in range(reps):
    for name in (list(calls) if rep % 2 == 0 else list(reversed(calls))):
      start = time.perf_counter()
      jax.block_until_ready(calls[name]())
      times[name].append(time.perf_counter() - start)
  return times


def _read_gbs(times: dict) -> np.ndarray:
  """Each rep's read rate (`_Reads`): the better of the two."""
  best = np.minimum(np.array(times["read_matvec"]), np.array(times["read_sum"]))
  return READ_BYTES / best / 1e9


class _Reads:
  """1 GiB read in process, twice (an XLA sum and matrix-vector product), timed with each rep."""

  def __init__(self):
    cols = 4096
    self.matrix = jnp.ones((READ_BYTES // 4 // cols, cols), jnp.float32)  # [rows, cols]
    self.vector = jnp.ones((cols,), jnp.float32)
    self.matvec = jax.jit(lambda w, v: w @ v)
    self.sum = jax.jit(jnp.sum)

  def calls(self) -> dict:
    return {"read_matvec": lambda: self.matvec(self.matrix, self.vector),
            "read_sum": lambda: self.sum(self.matrix)}


def _row(label: str, times: dict, nbytes: dict, roof: float, forms) -> dict:
  reads = _read_gbs(times)
  out = {"label": label, "read_gbs": float(np.median(reads))}
  parts = []
  for f in forms:
    t = np.array(times[f])
    med = float(np.median(t))
    gbs = nbytes[f] / med / 1e9
    rep = float(np.median(nbytes[f] / t / 1e9 / reads))
    out[f] = {"median_ms": med * 1e3, "best_ms": float(t.min()) * 1e3, "gbs": gbs,
              "roof_fraction": gbs / roof, "rep_fraction": rep, "bytes": nbytes[f]}
    text = f"{f} {med * 1e3:8.2f} ms {gbs:5.2f} GB/s {100 * gbs / roof:3.0f}% rep {100 * rep:3.0f}%"
    if f != "f32" and "f32" in forms:
      out[f]["speedup"] = float(np.median(np.array(times["f32"]) / t))
      text += f" {out[f]['speedup']:4.2f}x"
    if f == "blk4" and "blk" in forms:
      out[f]["over_blk"] = float(np.median(np.array(times["blk"]) / t))
      text += f" {out[f]['over_blk']:4.2f}x/blk"
    if f == "blk4f" and "blk4" in forms:
      out[f]["over_blk4"] = float(np.median(np.array(times["blk4"]) / t))
      text += f" {out[f]['over_blk4']:4.2f}x/blk4"
    parts.append(text)
  print(f"{label:>7s} read {out['read_gbs']:5.2f} | " + " | ".join(parts), flush=True)
  return out


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(prog="python -m bench.tools.block_kernel",
                               description=__doc__.split("\n\n")[0])
  ap.add_argument("--m", default="1,3,5,9,17", help="comma-separated row counts")
  ap.add_argument("--reps", type=int, default=7, help="paired repetitions per M")
  ap.add_argument("--breakdown", default="1", help="row counts to time matrix by matrix ('' none)")
  ap.add_argument("--forms", default=",".join(FORMS), help=f"some of {','.join(FORMS)}")
  ap.add_argument("--layers", type=int, default=28, help="layers (fewer: a quicker, smaller run)")
  ap.add_argument("--json", help="also write the figures to this file")
  args = ap.parse_args(argv)
  ms = [int(m) for m in args.m.split(",") if m]
  breakdown = [int(m) for m in args.breakdown.split(",") if m]
  forms = [f for f in args.forms.split(",") if f]
  if not forms or set(forms) - set(FORMS) or args.reps < 1 or not ms:
    ap.error(f"--forms {args.forms} --reps {args.reps} --m {args.m}: expected forms among "
             f"{FORMS}, at least one rep and one row count")
  if not cpu_kernels.available():
    raise SystemExit(f"jspec's CPU kernel is unavailable here: {cpu_kernels.unavailable_reason()}")
  cfg = shapes.QWEN25_CODER_1_5B
  load_before = os.getloadavg()
  before = memory.bandwidth()
  ws = _weights(cfg, args.layers, jax.random.key(0), forms)
  nbytes = {f: _nbytes(w) for f, w in ws.items()}
  print("weights: " + ", ".join(f"{f} {nbytes[f] / 1e9:.3f} GB" for f in forms)
        + f" ({args.layers} layers + head)", flush=True)
  reads = _Reads()
  rows = []
  for m in ms:
    x = jnp.ones((m, cfg.hidden_size), jnp.float32) * 0.01
    chains = {f: _chain(f) for f in forms}
    calls = {f: (lambda f=f: chains[f](ws[f], x)) for f in forms}
    rows.append((m, "forward", _paired({**calls, **reads.calls()}, args.reps), nbytes))
    if m in breakdown:
      for kind in (*KINDS, "head"):
        k = cfg.intermediate_size if kind == "down" else cfg.hidden_size
        xk = jnp.ones((m, k), jnp.float32) * 0.01
        sel = {f: _select(ws[f], kind) for f in forms}
        progs = {f: _each(f, kind) for f in forms}
        calls = {f: (lambda f=f: progs[f](sel[f], xk)) for f in forms}
        rows.append((m, kind, _paired({**calls, **reads.calls()}, args.reps),
                     {f: _nbytes(s) for f, s in sel.items()}))
  del reads
  after = memory.bandwidth()
  load_after = os.getloadavg()
  roof = max(before.get("gbs") or 0.0, after.get("gbs") or 0.0)
  print(f"memory read: before {before.get('gbs') or 0:.2f} GB/s, after {after.get('gbs') or 0:.2f}"
        f" GB/s (roof: the higher); load average before {load_before[0]:.2f}, after "
        f"{load_after[0]:.2f}; {args.reps} reps, medians; speedups over f32 paired by rep")
  results = {"roof_gbs": roof, "before": before, "after": after, "layers": args.layers,
             "reps": args.reps, "load_before": load_before, "load_after": load_after,
             "forms": forms, "rows": []}
  current = None
  for m, label, times, nb in rows:
    if m != current:
      print(f"M={m}")
      current = m
    entry = _row(label, times, nb, roof, forms)
    entry["m"] = m
    results["rows"].append(entry)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=1)
  return results


if __name__ == "__main__":
  main()
