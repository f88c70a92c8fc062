"""Sharded-run checks, run by `test_mesh.py` in a child process with 8 fake CPU devices.

The pytest process has one CPU device, and JAX fixes the device count when it
starts, so each group here runs as `python tests/mesh_check.py GROUP [ARGS]`
with `--xla_force_host_platform_device_count=8` added to XLA_FLAGS (the test
suite's compiler flags are kept). A group prints one line per check and exits
0, or raises: the parent test shows the traceback.

Ties are kept out, not hoped away: a sharded program sums some products in
another order (the row-split matrices are all-reduced over "model"), so its
logits may differ from one device's in the last bits. `assert_clear_margins`
checks that every greedy choice of the single-device reference wins by at
least MARGIN over the runner-up (ten thousand times the float32 differences
seen), so an equal token stream is the only correct outcome.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

_FLAG = "--xla_force_host_platform_device_count"
if "--worker" not in sys.argv and _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}=8".strip()
# These checks are about sharding, not the program store: without it a first
# compile here takes seconds instead of tens of seconds.
os.environ.setdefault("JSPEC_XLA_CACHE", "0")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jspec  # noqa: E402
from convert import config as config_lib  # noqa: E402
from jspec import api  # noqa: E402
from jspec import bundle as bundle_lib  # noqa: E402
from jspec import cache as cache_lib  # noqa: E402
from jspec import cpu_kernels  # noqa: E402
from jspec import decode  # noqa: E402
from jspec import mesh as mesh_lib  # noqa: E402
from jspec import model  # noqa: E402
from jspec import programs  # noqa: E402
from jspec import weights  # noqa: E402

# Widths divide a "model" axis of 2 (heads 6, KV heads 2, MLP 38, vocabulary
# 22) and are otherwise odd, so that a swapped axis is a shape error.
VOCAB = 22
TARGET = config_lib.Qwen2Config(vocab_size=VOCAB, hidden_size=24, intermediate_size=38,
                                num_layers=2, num_heads=6, num_kv_heads=2, head_dim=8,
                                rope_theta=1e4)
DRAFT = config_lib.Qwen2Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=19,
                               num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                               rope_theta=1e4)
SEED, SCALE = 0, 0.5
MARGIN = 1e-3  # least top-1 minus top-2 logit of any reference greedy choice
MESHES = ((1, 1), (2, 1), (1, 2), (2, 2), (4, 2))
# Every method, each with its default policy; "model-fixed" is the cheap
# variant the fast tier compiles (one verify width).
METHODS = {
    "target": dict(method="target"),
    "model": dict(method="model"),
    "model-fixed": dict(method="model", policy="fixed", gamma=2),
    "prompt_lookup": dict(method="prompt_lookup", ngram=2),
    "lookup_model": dict(method="lookup_model", ngram=2),
}
MAX_NEW = 12


def pair(seed: int = SEED, scale: float = SCALE, target=TARGET, draft=DRAFT) -> jspec.Bundle:
  """The unsharded pair in XLA's forms (the forms a mesh runs), float draft."""
  kt, kd = jax.random.split(jax.random.key(seed))
  return bundle_lib.make((target, model.init_params(target, kt, scale=scale)),
                         (draft, model.init_params(draft, kd, scale=scale)),
                         settings=jspec.Settings(kernels=False, draft_int8=False))


def prompts(rows: int = 4) -> list[list[int]]:
  """Rows of different lengths, with repeats so that prompt lookup finds matches."""
  rng = np.random.RandomState(7)
  out = []
  for r in range(rows):
    base = rng.randint(0, VOCAB, size=3 + r).tolist()
    out.append(base + base[:2 + r % 3])
  return out


def assert_clear_margins(bundle: jspec.Bundle, rows: list[list[int]], new: list[list[int]]):
  """Every greedy token the reference chose beats the runner-up by MARGIN (module docstring)."""
  m = bundle.target
  for prompt, out in zip(rows, new):
    seq = prompt + out
    cache = cache_lib.init(m.cfg, 1, len(seq))
    logits, _ = jax.jit(model.forward, static_argnums=0)(m.arch, m.params,
                                                         jnp.asarray([seq], jnp.int32), cache)
    chosen = np.asarray(logits[0, len(prompt) - 1:len(seq) - 1])  # [new, V]
    top2 = np.sort(chosen, axis=-1)[:, -2:]
    assert np.argmax(chosen, -1).tolist() == out, "reference is not the target's argmax"
    margin = float(np.min(top2[:, 1] - top2[:, 0]))
    assert margin > MARGIN, f"greedy margin {margin:.2e} <= {MARGIN}: pick another seed"


def generate_ids(bundle: jspec.Bundle, rows, **options) -> list[list[int]]:
  return [r.token_ids for r in jspec.generate(bundle, rows, max_new_tokens=MAX_NEW, **options)]


def drafting(bundle: jspec.Bundle, rows, **options) -> list[tuple[int, int, int]]:
  """Each row's (rounds, drafted, accepted): greedy, they follow from the draft's own choices.

  The ids are the target's whatever the draft proposes, so a draft placed
  or converted wrongly shows only here.
  """
  return [(r.stats["rounds"], r.stats["drafted"], r.stats["accepted"])
          for r in jspec.generate(bundle, rows, max_new_tokens=MAX_NEW, **options)]


def check_greedy(meshes, methods, same_method: bool = True) -> None:
  """Greedy output on each mesh equals the single-device run, token for token, per method.

  Args:
    meshes: (data, model) shapes.
    methods: keys of METHODS.
    same_method: compare with one device's run of the same method; else
      with one device's target-only run only (greedy, every method gives
      its tokens on one device: `test_engine.py`), which compiles less.
  """
  base_bundle = pair()
  rows = prompts()
  target_only = generate_ids(base_bundle, rows, method="target")
  assert_clear_margins(base_bundle, rows, target_only)
  for name in methods:
    base = generate_ids(base_bundle, rows, **METHODS[name]) if same_method else target_only
    assert base == target_only, f"{name} on one device differs from target-only"
    for shape in meshes:
      t0 = time.perf_counter()
      # As users make it: jax.make_mesh gives Explicit axes, which `jspec.shard` makes Auto.
      mesh = jax.make_mesh(shape, mesh_lib.AXES, devices=jax.devices()[:shape[0] * shape[1]])
      sharded = jspec.shard(base_bundle, mesh)
      got = generate_ids(sharded, rows, **METHODS[name])
      assert got == base, f"{name} on mesh {shape}: {got} != {base}"
      if same_method and name != "target":
        assert drafting(sharded, rows, **METHODS[name]) == drafting(
            base_bundle, rows, **METHODS[name]), f"{name} on mesh {shape}: other drafts"
      if same_method and name == "model" and shape[0] == 1:  # one prompt: a data axis of 1
        pieces = [ids for _, ids in jspec.stream(sharded, rows[0], max_new_tokens=MAX_NEW,
                                                   rounds_per_dispatch=2)]
        assert sum(pieces, []) == generate_ids(base_bundle, [rows[0]])[0], "stream differs"
      print(f"greedy {name} mesh {shape}: equal ({time.perf_counter() - t0:.1f} s)", flush=True)


def check_placement(shape=(2, 2)) -> None:
  """Each device holds its share of the target, a whole draft, and the program moves no weight.

  The target's split matrices, biases and token tables are 1/M on each
  device (M the "model" axis), its norms whole; the draft is whole
  everywhere. No all-gather, all-to-all or collective-permute in the
  compiled loop carries as many elements as a split weight: the partitioner
  moved activations (all-reduce, small all-gathers), never weights.
  """
  data, tp = shape
  bundle = jspec.shard(pair(), mesh_lib.make(*shape))
  d, f, n, k, h, v = (TARGET.hidden_size, TARGET.intermediate_size, TARGET.num_heads,
                      TARGET.num_kv_heads, TARGET.head_dim, TARGET.vocab_size)
  split = TARGET.num_layers * (d * (n + 2 * k) * h + (n + 2 * k) * h + n * h * d + 3 * d * f)
  split += 2 * v * d  # embedding and head
  whole = (2 * TARGET.num_layers + 1) * d  # norms
  want = 4 * (split // tp + whole)
  per_device = {}
  for leaf in jax.tree.leaves(bundle.target.params):
    for s in leaf.addressable_shards:
      per_device[s.device] = per_device.get(s.device, 0) + s.data.nbytes
  assert set(per_device.values()) == {want}, (sorted(set(per_device.values())), want)
  draft_total = sum(x.nbytes for x in jax.tree.leaves(pair().draft.params))
  for leaf in jax.tree.leaves(bundle.draft.params):
    assert all(s.data.shape == leaf.shape for s in leaf.addressable_shards), "draft not whole"
  print(f"placement {shape}: target {want} bytes a device (of {4 * (split + whole)}), "
        f"draft whole ({draft_total} bytes)", flush=True)
  req = api.request(bundle, prompts(2 * data), jspec.Options(max_new_tokens=MAX_NEW,
                                                             policy="fixed", gamma=2))
  smallest = min(x.size for x in jax.tree.leaves(bundle.target.params) if x.ndim == 2) // tp
  for name, program in (("prefill", req.prefill), ("run", req.run.compiled)):
    moved = _moved_elements(program.as_text())
    assert all(e < smallest for e in moved), f"{name} moves a weight: {sorted(moved)[-3:]}"
    print(f"collectives {name}: largest all-gather/all-to-all/permute {max(moved, default=0)} "
          f"elements (< {smallest}, the smallest weight shard)", flush=True)


_MOVE = re.compile(r"= \(?([a-z0-9]+)\[([0-9,]*)\][^=]*? (all-gather|all-to-all|collective-permute)"
                   r"(-start)?\(")


def _moved_elements(hlo: str) -> list[int]:
  """Elements in the result of every all-gather, all-to-all and collective-permute of an HLO text."""
  out = []
  for m in _MOVE.finditer(hlo):
    dims = [int(x) for x in m.group(2).split(",") if x]
    out.append(int(np.prod(dims)) if dims else 1)
  return out


def _as_blocks(w: weights.Dense) -> weights.Leaf:
  """A float [I, O] matrix quantized to symmetric int8 blocks of 32 inputs (`weights.Blocks`)."""
  t = np.asarray(w.w, np.float32).T  # [O, I]
  blocks = t.reshape(t.shape[0], -1, 32)
  scale = np.maximum(np.abs(blocks).max(-1), 1e-8) / 127.0  # [O, I/32]
  q = np.clip(np.round(blocks / scale[..., None]), -127, 127).astype(np.int8)
  return weights.blocks(q.reshape(t.shape), scale.astype(np.float32))


def check_kernel_forms(shape=(2, 2)) -> None:
  """A bundle prepared for the CPU kernels gives, sharded, the ids it gives on one device.

  The target in float32 panels (with its greedy head) and in int8 blocks
  (as an exact GGUF target), the draft in int8 panels: `jspec.shard`
  turns each into XLA's forms with the same numbers.
  """
  import tiny  # pylint: disable=import-outside-toplevel

  if not cpu_kernels.available():
    print("kernels: not built here, skipped", flush=True)
    return
  kt, kd = jax.random.split(jax.random.key(1))
  t_params = model.init_params(tiny.PACKABLE_TARGET, kt, scale=0.3)
  d_params = model.init_params(tiny.PACKABLE_DRAFT, kd, scale=0.3)
  as_blocks = jax.tree.map(lambda w: _as_blocks(w) if isinstance(w, weights.Dense) else w,
                           t_params, is_leaf=weights.is_leaf)
  settings = jspec.Settings(kernels=True, draft_int8=True)
  rows = prompts()
  for name, target in (("panels", t_params), ("blocks", as_blocks)):
    bundle = bundle_lib.make((tiny.PACKABLE_TARGET, target), (tiny.PACKABLE_DRAFT, d_params),
                             settings=settings)
    kinds = {type(w).__name__ for w in jax.tree.leaves(bundle.target.params["layers"],
                                                       is_leaf=weights.is_leaf)
             if weights.is_leaf(w)}
    assert kinds == {"Panels" if name == "panels" else "Blocks"}, kinds
    base = generate_ids(bundle, rows, method="target")
    assert_clear_margins(bundle, rows, base)
    sharded = jspec.shard(bundle, mesh_lib.make(*shape))
    assert not sharded.target.backend.kernels and sharded.target.params["greedy_head"] is None
    for method in ("target", "model-fixed"):
      got = generate_ids(sharded, rows, **METHODS[method])
      assert got == base, f"{name} {method}: {got} != {base}"
    assert drafting(sharded, rows, **METHODS["model-fixed"]) == drafting(
        bundle, rows, **METHODS["model-fixed"]), f"{name}: the converted draft drafts otherwise"
    print(f"kernels: a {name} target (int8-panel draft) on mesh {shape} gives its one-device ids",
          flush=True)


def check_errors() -> None:
  """Bad meshes and batches are one-line ValueErrors before anything is placed or compiled."""
  bundle = pair()
  before = (mesh_lib.PROGRAMS.compiles, programs.PROGRAMS.compiles)
  wide_kv = config_lib.Qwen2Config(vocab_size=VOCAB, hidden_size=24, intermediate_size=40,
                                   num_layers=1, num_heads=8, num_kv_heads=2, head_dim=8)
  devices = np.asarray(jax.devices()[:4]).reshape(2, 2)
  cases = [
      (lambda: jspec.shard(bundle, mesh_lib.make(1, 4)), "does not divide the target's num_heads=6"),
      (lambda: jspec.shard(pair(target=wide_kv), mesh_lib.make(1, 4)),
       "does not divide the target's num_kv_heads=2"),
      (lambda: jspec.shard(bundle, jax.sharding.Mesh(devices, ("data", "tensor"))),
       "mesh axis 'tensor' is unknown"),
      (lambda: jspec.generate(jspec.shard(bundle, mesh_lib.make(2, 1)), prompts(3)),
       "a batch of 3 prompt(s) does not divide over the mesh's 'data' axis of size 2"),
      (lambda: jspec.generate(jspec.shard(bundle, mesh_lib.make(2, 1)), [1, 2, 3]),
       "a batch of 1 prompt(s)"),
      (lambda: mesh_lib.make(4, 4), "mesh 4x4 needs 16 devices; there are 8"),
      (lambda: mesh_lib.parse("2by2"), "expected DATAxMODEL"),
  ]
  for run, message in cases:
    try:
      run()
    except ValueError as err:
      assert message in str(err), f"{err!r} lacks {message!r}"
      assert "\n" not in str(err)
    else:
      raise AssertionError(f"no ValueError ({message})")
  assert (mesh_lib.PROGRAMS.compiles, programs.PROGRAMS.compiles) == before, "compiled"
  # A mesh naming one axis means the other is of size 1.
  one_axis = jax.sharding.Mesh(np.asarray(jax.devices()[:2]), ("model",))
  assert jspec.shard(bundle, one_axis).target.placement.mesh.shape == {"data": 1, "model": 2}
  print(f"errors: {len(cases)} bad inputs refused before compiling", flush=True)


def check_cache(shape=(2, 2)) -> None:
  """After rounds on a mesh, every row's caches equal a fresh one-device prefill of its tokens."""
  base = pair(4)
  bundle = jspec.shard(base, mesh_lib.make(*shape))
  rows = prompts(4)
  for method in ("model", "lookup_model"):
    spec = jspec.Options(method=method, temperature=1.0, gamma=3, policy="fixed",
                         ngram=1).spec(bundle.target.arch, bundle.draft.arch)
    p_width = 16
    width = decode.buffer_width(p_width, 16, 3)
    padded = np.zeros((len(rows), p_width), np.int32)
    for r, row in enumerate(rows):
      padded[r, :len(row)] = row
    args = mesh_lib.put_inputs((bundle.target.params, bundle.draft.params, padded,
                                np.asarray([len(r) for r in rows], np.int32),
                                np.full((len(rows),), 16, np.int32), np.zeros((0,), np.int32),
                                jax.random.key(0), spec.knobs()), bundle.target.placement)
    state = decode.prefill(*args, spec=spec, width=width)
    for limit in (1, 3):
      state = decode.run(args[0], args[1], state, jnp.int32(limit), spec=spec)
      tokens, seq_len = np.asarray(state.tokens), np.asarray(state.seq_len)
      for r in range(len(rows)):
        n = int(seq_len[r])
        for m, c, held in ((base.target, state.target_cache, n - 1),
                           (base.draft, state.draft_cache, int(state.draft_len[r]))):
          fresh = cache_lib.init(m.cfg, 1, width)
          _, fresh = model.forward(m.arch, m.params, jnp.asarray([tokens[r, :held]]), fresh)
          if m is base.target:
            assert int(c.lengths[r]) == held, (int(c.lengths[r]), held)
          for got, want in ((c.k, fresh.k), (c.v, fresh.v)):
            np.testing.assert_allclose(np.asarray(got)[:, r, :held], np.asarray(want)[:, 0, :held],
                                       atol=1e-5)
    print(f"cache {method} mesh {shape}: equal to a fresh prefill after 1 and 3 rounds",
          flush=True)


def check_lossless(shape=(2, 2)) -> None:
  """A sharded sampled run passes `test_lossless`'s chi-square test against the exact target."""
  import test_lossless  # pylint: disable=import-outside-toplevel

  base = pair(3, 0.6)
  bundle = jspec.shard(base, mesh_lib.make(*shape))
  spec = jspec.Options(temperature=1.0, gamma=3, policy="fixed").spec(bundle.target.arch,
                                                                     bundle.draft.arch)
  rows = [[3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8, 1, 8]]
  n = test_lossless.N_ROWS
  padded = np.zeros((2 * n, 8), np.int32)
  lengths = np.zeros(2 * n, np.int32)
  for i, p in enumerate(rows):
    padded[i::2, :len(p)] = p
    lengths[i::2] = len(p)
  args = mesh_lib.put_inputs((bundle.target.params, bundle.draft.params, padded, lengths,
                              np.full((2 * n,), 3, np.int32), np.zeros((0,), np.int32),
                              jax.random.key(11), spec.knobs()), bundle.target.placement)
  state = decode.prefill(*args, spec=spec, width=decode.buffer_width(8, 3, 3))
  state = decode.run(args[0], args[1], state, jnp.int32(1 << 30), spec=spec)
  tokens = np.asarray(state.tokens)
  for i, p in enumerate(rows):
    got = tokens[i::2][:, len(p):len(p) + 3]
    probs = test_lossless.exact_joint(base, p, 3, spec.sampling)
    p_value = test_lossless.chi_square_p(got, probs)
    assert p_value > test_lossless.ALPHA, f"prompt {p}: chi-square p = {p_value:.2e}"
    print(f"lossless mesh {shape} prompt {p}: chi-square p = {p_value:.3f}", flush=True)


def worker(process_id: int, processes: int, port: int, out: str) -> None:
  """One of several processes running one generation on a mesh over all their devices.

  Writes {"sharded": ids over the 2 x (devices / 2) mesh of every process,
  "one_device": ids of this process's own single-device target-only run}
  to `out`, for the parent test to compare.
  """
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=processes,
                             process_id=process_id, initialization_timeout=60,
                             heartbeat_timeout_seconds=30, shutdown_timeout_seconds=30)
  assert jax.process_count() == processes, jax.process_count()
  assert jax.device_count() > jax.local_device_count(), "one process holds every device"
  base = pair()
  bundle = jspec.shard(base, mesh_lib.make(2, jax.device_count() // 2))
  got = {"sharded": generate_ids(bundle, prompts(), **METHODS["model-fixed"]),
         "one_device": generate_ids(base, prompts(), method="target"),
         "devices": jax.device_count()}
  with open(out, "w") as f:
    json.dump(got, f)
  print(f"process {process_id}: {got}", flush=True)
  jax.distributed.shutdown()


def main(argv: list[str]) -> None:
  t0 = time.perf_counter()
  group = argv[0]
  if group == "fast":
    check_errors()
    check_greedy([(2, 2)], ["model-fixed"], same_method=False)
    check_placement((2, 2))
  elif group == "greedy":
    check_greedy([tuple(int(x) for x in argv[1].split("x"))], list(METHODS))
  elif group == "cache":
    check_cache()
  elif group == "lossless":
    check_lossless()
  elif group == "kernels":
    check_kernel_forms()
  elif group == "placement":
    check_placement(tuple(int(x) for x in argv[1].split("x")))
  elif group == "--worker":
    worker(int(argv[1]), int(argv[2]), int(argv[3]), argv[4])
  else:
    raise SystemExit(f"unknown group {group!r}")
  print(f"{group}: {time.perf_counter() - t0:.1f} s after imports", flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
