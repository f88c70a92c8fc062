"""Capacity without weights: per-device bytes of Qwen2.5-7B/32B/72B targets with the 0.5B draft on meshes.

    python -m bench.tools.capacity                      # the table; compiles the 72B on 8 devices
    python -m bench.tools.capacity --compile all        # compiles every cell (slow)

Nothing is loaded or allocated: the params are `jax.ShapeDtypeStruct`s of
the real shapes in bfloat16 carrying the shardings `jspec.mesh.shard`
gives them (`jspec.mesh.abstract`), the caches come from `jax.eval_shape`
of prefill, and the programs that are compiled (`decode.prefill` and the
loop `decode.run`, the speculative default) are compiled for these
abstract arrays and asked for XLA's `memory_analysis()`. The devices are
fake CPU devices (`--xla_force_host_platform_device_count`), so the byte
counts are what each device of an accelerator mesh of that shape holds
(activations aside, which the compiled figures include as temporaries).

Each mesh of N devices is (data, model) with the widest "model" axis that
divides the target's heads, KV heads and MLP width and N, and whose "data"
axis divides the batch. The JSON goes to bench/results/capacity.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

_DEVICES = 8
if "jax" not in sys.modules:  # the fake devices must exist before JAX starts
  os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} "
                             f"--xla_force_host_platform_device_count={_DEVICES}").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jspec  # noqa: E402
from convert import config as config_lib  # noqa: E402
from jspec import decode  # noqa: E402
from jspec import mesh as mesh_lib  # noqa: E402
from jspec import model as model_lib  # noqa: E402

GB = 1e9
DEVICE_GB = 80  # an 80 GB accelerator (H100/A100 80GB)
CONTEXT = 4096  # cache slots a row: prompt + new tokens + a verify chunk
BATCH = 8
MAX_NEW = 256
DRAFT_VOCAB = 151936
_QWEN = dict(rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=32768,
             eos_token_ids=(151645,))
# Qwen2.5-7B/32B/72B(-Instruct) config.json; the 7B's as `bench.tools.large_target.SHAPES`.
TARGETS = {
    "7b": config_lib.Qwen2Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                                 num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128,
                                 tie_word_embeddings=False, **_QWEN),
    "32b": config_lib.Qwen2Config(vocab_size=152064, hidden_size=5120, intermediate_size=27648,
                                  num_layers=64, num_heads=40, num_kv_heads=8, head_dim=128,
                                  tie_word_embeddings=False, **_QWEN),
    "72b": config_lib.Qwen2Config(vocab_size=152064, hidden_size=8192, intermediate_size=29568,
                                  num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128,
                                  tie_word_embeddings=False, **_QWEN),
}
# Qwen2.5-0.5B(-Instruct): tied embeddings, as its config.json.
DRAFT = config_lib.Qwen2Config(vocab_size=DRAFT_VOCAB, hidden_size=896, intermediate_size=4864,
                               num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64,
                               tie_word_embeddings=True, **_QWEN)
RESULTS = pathlib.Path(__file__).resolve().parents[1] / "results" / "capacity.json"


def _arch(cfg: config_lib.Qwen2Config, placement: mesh_lib.Placement) -> model_lib.Arch:
  return model_lib.Arch(cfg, model_lib.Backend(kernels=False, dtype="bfloat16"), placement)


def programs_args(name: str, devices: int):
  """The abstract arguments of prefill for a target on a mesh, and its spec and width.

  Returns:
    (args of `decode.prefill`, spec, width, (data, model)).
  """
  t_cfg = TARGETS[name]
  shape = mesh_lib.widest(t_cfg, devices, BATCH)
  mesh = mesh_lib.make(*shape)
  t_place = mesh_lib.placement_of(t_cfg, mesh, "target")
  d_place = mesh_lib.placement_of(DRAFT, mesh, "draft")
  t_params = mesh_lib.abstract(model_lib.abstract_params(t_cfg, jnp.bfloat16), t_place)
  d_params = mesh_lib.abstract(model_lib.abstract_params(DRAFT, jnp.bfloat16), d_place)
  spec = jspec.Options(max_new_tokens=MAX_NEW).spec(_arch(t_cfg, t_place), _arch(DRAFT, d_place),
                                                    DRAFT_VOCAB)
  prompt = CONTEXT - MAX_NEW - spec.gamma_max - 2  # the longest prompt that fits the context
  width = decode.buffer_width(prompt, MAX_NEW, spec.gamma_max)
  p_width = (prompt + decode.PREFILL_CHUNK - 1) // decode.PREFILL_CHUNK * decode.PREFILL_CHUNK
  rows = lambda shp, dtype: jax.ShapeDtypeStruct(shp, dtype, sharding=t_place.sharding(
      mesh_lib.DATA, *([None] * (len(shp) - 1))))
  every = lambda shp, dtype: jax.ShapeDtypeStruct(shp, dtype, sharding=t_place.sharding(
      *([None] * len(shp))))
  knobs = decode.Knobs(*(every((), jnp.float32) for _ in range(3)))
  args = (t_params, d_params, rows((BATCH, p_width), jnp.int32), rows((BATCH,), jnp.int32),
          rows((BATCH,), jnp.int32), every((1,), jnp.int32),
          every((), jax.random.key(0).dtype), knobs)
  return args, spec, width, shape


def cell(name: str, devices: int, compile_programs: bool) -> dict:
  """One row of the table: bytes a device holds, and the compiled programs' memory if asked."""
  args, spec, width, shape = programs_args(name, devices)
  t_place, d_place = spec.target.placement, spec.draft.placement
  state = jax.eval_shape(lambda *a: decode.prefill(*a, spec=spec.program(), width=width), *args)
  # eval_shape gives global shapes; each cache is split as its model's placement says.
  cache_shard = lambda c, p: 2 * mesh_lib.device_bytes(jax.ShapeDtypeStruct(
      c.k.shape, c.k.dtype, sharding=p.sharding(None, mesh_lib.DATA, None, mesh_lib.MODEL, None)))
  row = {
      "target": name, "devices": devices, "mesh": {"data": shape[0], "model": shape[1]},
      "batch": BATCH, "cache_slots": width, "dtype": "bfloat16",
      "target_weights_gb": mesh_lib.device_bytes(args[0]) / GB,
      "draft_weights_gb": mesh_lib.device_bytes(args[1]) / GB,
      "target_kv_gb": cache_shard(state.target_cache, t_place) / GB,
      "draft_kv_gb": cache_shard(state.draft_cache, d_place) / GB,
  }
  row["total_gb"] = sum(row[k] for k in ("target_weights_gb", "draft_weights_gb",
                                         "target_kv_gb", "draft_kv_gb"))
  row["fits_80gb"] = row["total_gb"] < DEVICE_GB
  if compile_programs:
    t0 = time.perf_counter()
    pre = decode.prefill.lower(*args, spec=spec.program(), width=width).compile()
    run = decode.run.lower(args[0], args[1], pre.out_info, jax.ShapeDtypeStruct(
        (), jnp.int32, sharding=t_place.sharding()), spec=spec.program()).compile()
    for label, program in (("prefill", pre), ("run", run)):
      m = program.memory_analysis()
      peak = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
              - m.alias_size_in_bytes)
      row[f"{label}_compiled"] = {
          "argument_gb": m.argument_size_in_bytes / GB, "output_gb": m.output_size_in_bytes / GB,
          "temp_gb": m.temp_size_in_bytes / GB, "alias_gb": m.alias_size_in_bytes / GB,
          "peak_gb": peak / GB, "fits_80gb": peak < DEVICE_GB * GB}
    row["compile_s"] = time.perf_counter() - t0
  return row


def table(rows: list[dict]) -> str:
  """The rows as a markdown table (GB a device)."""
  lines = ["| target | devices | mesh (data x model) | target weights | draft weights | "
           "target KV | draft KV | total | compiled peak (loop) |",
           "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    peak = r.get("run_compiled", {}).get("peak_gb")
    lines.append(
        f"| {r['target']} | {r['devices']} | {r['mesh']['data']} x {r['mesh']['model']} | "
        f"{r['target_weights_gb']:.1f} | {r['draft_weights_gb']:.2f} | {r['target_kv_gb']:.2f} | "
        f"{r['draft_kv_gb']:.2f} | {r['total_gb']:.1f} | "
        + (f"{peak:.1f}" if peak is not None else "-") + " |")
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m bench.tools.capacity", description=__doc__.split(
      "\n")[0])
  parser.add_argument("--targets", default=",".join(TARGETS), help="comma-separated of "
                      + ", ".join(TARGETS))
  parser.add_argument("--devices", default="1,2,4,8", help="mesh sizes (at most 8)")
  parser.add_argument("--compile", default="72b@8", help="cells to compile: NAME@DEVICES,... "
                      "or 'all' or 'none' (default: 72b@8)")
  parser.add_argument("--out", default=str(RESULTS), help="JSON to write")
  args = parser.parse_args(argv)
  compile_cells = args.compile.split(",")
  rows = []
  for name in args.targets.split(","):
    for n in (int(x) for x in args.devices.split(",")):
      wanted = args.compile == "all" or f"{name}@{n}" in compile_cells
      rows.append(cell(name, n, wanted))
      print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({
      "command": "python -m bench.tools.capacity " + " ".join(argv or sys.argv[1:]),
      "jax": jax.__version__, "backend": "cpu (fake devices)", "device_gb": DEVICE_GB,
      "context_slots": CONTEXT, "batch": BATCH, "max_new_tokens": MAX_NEW,
      "draft": "qwen2.5-0.5b (tied, bfloat16, replicated over 'model')", "rows": rows},
      indent=1) + "\n")
  print(table(rows))
  return 0


if __name__ == "__main__":
  sys.exit(main())
