"""One generation on a mesh of every device the machine has: tokens/s and the same ids as one device.

    python -m bench.tools.mesh_bench --target 1.5b --out mesh.json        # all devices
    python -m bench.tools.mesh_bench --target 7b --devices 2 --batch 4

Random weights of a real pair's shapes in bfloat16 (speed depends on shapes,
not values; acceptance of random weights says nothing about the real pair):
the target (the default pair's 1.5B, or Qwen2.5-7B's shapes) with the 0.5B
draft, on the (data, model) mesh of N devices with the widest "model" axis
the target splits over (`jspec.mesh.widest`). It times target-only and the
default method after a compile run, and checks that both give the greedy
ids of one device (run when the pair fits one device's memory:
`--no-single` skips it). `bench/device_gpu.sh` runs it on every GPU.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from bench import shapes
from convert import config as config_lib
from jspec import bundle as bundle_lib
from jspec import mesh as mesh_lib
from jspec import model as model_lib

DRAFT = shapes.QWEN25_CODER_0_5B
TARGETS = {
    "smoke": shapes.SMOKE_TARGET,  # with SMOKE_DRAFT: a check of the tool itself, on CPU
    "1.5b": shapes.QWEN25_CODER_1_5B,
    "7b": config_lib.Qwen2Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                                 num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128,
                                 rope_theta=1_000_000.0, max_position_embeddings=32768),
}


def random_pair(target: config_lib.Qwen2Config, dtype) -> jspec.Bundle:
  """Random weights (std 0.02) of the target's and the 0.5B draft's shapes, in XLA's forms."""
  draft = shapes.SMOKE_DRAFT if target == shapes.SMOKE_TARGET else DRAFT
  kt, kd = jax.random.split(jax.random.key(0))
  settings = jspec.Settings(kernels=False, draft_int8=False)
  t = bundle_lib.prepare(target, model_lib.init_params(target, kt, dtype=dtype), "target",
                         settings, consume=True)
  d = bundle_lib.prepare(draft, model_lib.init_params(draft, kd, dtype=dtype), "draft",
                         settings, consume=True)
  limit = min(target.vocab_size, draft.vocab_size)
  return jspec.Bundle(t, d, vocab_limit=limit if target.vocab_size != draft.vocab_size else None)


def timed(bundle: jspec.Bundle, prompts: list[list[int]], reps: int, **options) -> dict:
  """Compile run, then `reps` timed runs: median tokens/s over the batch, and the ids."""
  first = jspec.generate(bundle, prompts, **options)
  rates = []
  for _ in range(reps):
    t0 = time.perf_counter()
    rows = jspec.generate(bundle, prompts, **options)
    rates.append(sum(r.stats["new_tokens"] for r in rows) / (time.perf_counter() - t0))
  return {"tokens_per_s": float(np.median(rates)), "compile_s": first[0].stats["compile_s"],
          "ids": [r.token_ids for r in rows],
          "acceptance_rate": rows[0].stats["acceptance_rate"]}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m bench.tools.mesh_bench",
                                   description=__doc__.split("\n")[0])
  parser.add_argument("--target", choices=TARGETS, default="1.5b")
  parser.add_argument("--devices", type=int, default=None, help="devices (default: all)")
  parser.add_argument("--batch", type=int, default=None, help="rows (default: the data axis, "
                      "at least 1)")
  parser.add_argument("--max-new-tokens", type=int, default=64)
  parser.add_argument("--reps", type=int, default=2)
  parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
  parser.add_argument("--no-single", action="store_true", help="skip the one-device run")
  parser.add_argument("--out", default=None, help="JSON to write")
  args = parser.parse_args(argv)
  n = args.devices or jax.device_count()
  cfg = TARGETS[args.target]
  batch = args.batch
  if batch is None:  # as many rows as the data axis needs when the model axis is widest
    batch = next(b for b in range(1, 65) if _fits(cfg, n, b))
  shape = mesh_lib.widest(cfg, n, batch)
  print(f"mesh_bench: {jax.device_count()} {jax.default_backend()} device(s) found, using {n} "
        f"as data x model = {shape[0]} x {shape[1]}, batch {batch}", file=sys.stderr, flush=True)
  bundle = random_pair(cfg, jnp.dtype(args.dtype))
  prompts = [np.random.RandomState(r).randint(0, 200, size=40 + 7 * r).tolist()
             for r in range(batch)]
  options = {"target": dict(method="target"), "default": {}}
  result = {"devices_found": jax.device_count(), "devices": n, "backend": jax.default_backend(),
            "mesh": {"data": shape[0], "model": shape[1]}, "target": args.target,
            "dtype": args.dtype, "batch": batch, "max_new_tokens": args.max_new_tokens,
            "weights": "random (std 0.02)", "modes": {}}
  sharded = jspec.shard(bundle, mesh_lib.make(*shape, devices=jax.devices()[:n]))
  for name, extra in options.items():
    result["modes"][name] = {"mesh": timed(sharded, prompts, args.reps,
                                           max_new_tokens=args.max_new_tokens, **extra)}
  if not args.no_single:
    for name, extra in options.items():
      one = timed(bundle, prompts, args.reps, max_new_tokens=args.max_new_tokens, **extra)
      result["modes"][name]["one_device"] = one
      result["modes"][name]["ids_equal"] = one["ids"] == result["modes"][name]["mesh"]["ids"]
  for name, mode in result["modes"].items():
    print(f"mesh_bench {name}: {mode['mesh']['tokens_per_s']:.1f} tok/s on the mesh"
          + (f", {mode['one_device']['tokens_per_s']:.1f} on one device, ids equal: "
             f"{mode['ids_equal']}" if "one_device" in mode else ""), file=sys.stderr)
  if args.out:
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
  equal = all(m.get("ids_equal", True) for m in result["modes"].values())
  return 0 if equal else 1


def _fits(cfg: config_lib.Qwen2Config, devices: int, batch: int) -> bool:
  try:
    mesh_lib.widest(cfg, devices, batch)
  except ValueError:
    return False
  return True


if __name__ == "__main__":
  sys.exit(main())
