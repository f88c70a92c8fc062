"""Running the same compiled loop over a `jax.sharding` mesh: tensor-parallel target, data-parallel rows.

A mesh has two axes, "data" and "model" (`make`, `parse`). The target is
tensor-parallel over "model": attention heads (q/k/v outputs, o inputs)
and the MLP's hidden width (gate/up outputs, down inputs) are split, the
token tables (embedding and head) are split over the vocabulary, and its
KV cache over the key/value heads. Batch rows are split over "data". The
draft is replicated over "model" (its rows still split over "data"): a
tiny draft's matrices are too small to split profitably. The placements are
`NamedSharding`s on the typed weight leaves (`shard`) and a few sharding
constraints inside the program (`constrain`); XLA's SPMD partitioner
(Shardy) inserts the collectives, so `jspec.decode`'s prefill and loop are
compiled once for the mesh as they are for one device
(docs/decisions-mesh.md).

jspec's CPU kernels are custom calls the partitioner cannot split, so a
sharded bundle keeps every matrix in XLA's forms (`Dense`, `Table`, `Int8`):
`shard` unpacks kernel panels and widens int8 blocks exactly.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding

from convert import config as config_lib
from jspec import cpu_kernels
from jspec import model as model_lib
from jspec import programs
from jspec import sharding
from jspec import weights

DATA, MODEL = sharding.DATA, sharding.MODEL
AXES = sharding.AXES
Placement = sharding.Placement

# Params paths (`model.path_name`) by how the target splits them over "model".
_COLUMNS = ("attn/q/w", "attn/k/w", "attn/v/w", "mlp/gate/w", "mlp/up/w")  # outputs split
_ROWS = ("attn/o/w", "mlp/down/w")  # inputs split: their products are summed over "model"
_BIASES = ("attn/q/b", "attn/k/b", "attn/v/b")
_TABLES = ("embed/table", "head/w")  # [V, D] token tables: split over the vocabulary


def parse(text: str) -> tuple[int, int]:
  """A `--mesh` value "DxM" as (data, model) sizes.

  Args:
    text: e.g. "2x2" (2 data rows x 2 model columns) or "4" (model only).

  Returns:
    (data, model).

  Raises:
    ValueError: not of that form.
  """
  found = re.fullmatch(r"\s*(\d+)\s*(?:[xX]\s*(\d+))?\s*", str(text))
  if not found:
    raise ValueError(f"mesh {text!r}: expected DATAxMODEL, e.g. 2x2, or a model axis size")
  data, mdl = (int(found[1]), int(found[2])) if found[2] else (1, int(found[1]))
  if data < 1 or mdl < 1:
    raise ValueError(f"mesh {text!r}: axis sizes must be >= 1")
  return data, mdl


def make(data: int = 1, model: int = 1, devices: Optional[Sequence[Any]] = None) -> Mesh:
  """A ("data", "model") mesh over the first data * model devices.

  Args:
    data: rows of the batch split this many ways.
    model: the target split this many ways.
    devices: the devices (default `jax.devices()`, every process's).

  Returns:
    The mesh (Auto axes).

  Raises:
    ValueError: more devices asked for than there are.
  """
  devices = list(jax.devices() if devices is None else devices)
  if data * model > len(devices):
    raise ValueError(f"mesh {data}x{model} needs {data * model} devices; there are "
                     f"{len(devices)}")
  return jax.make_mesh((data, model), AXES, axis_types=(AxisType.Auto,) * 2,
                       devices=devices[:data * model])


def normalize(mesh: Mesh) -> Mesh:
  """A user's mesh as a ("data", "model") mesh with Auto axes.

  A mesh may name only one of the two axes (the other is then of size 1);
  its axes become Auto, so that the partitioner, not sharding-in-types,
  places what the constraints leave open.

  Args:
    mesh: a `jax.sharding.Mesh`.

  Returns:
    The mesh over the same devices.

  Raises:
    ValueError: not a Mesh, or an axis named other than "data" and "model".
  """
  if not isinstance(mesh, Mesh):
    raise ValueError(f"mesh={mesh!r}: expected a jax.sharding.Mesh, e.g. "
                     "jax.make_mesh((data, model), ('data', 'model'))")
  unknown = [a for a in mesh.axis_names if a not in AXES]
  if unknown:
    raise ValueError(f"mesh axis {unknown[0]!r} is unknown: expected axes named "
                     f"{' and '.join(map(repr, AXES))}")
  sizes = dict(mesh.shape)
  shape = (sizes.get(DATA, 1), sizes.get(MODEL, 1))
  order = [a for a in AXES if a in mesh.axis_names]
  devices = np.transpose(mesh.devices, [list(mesh.axis_names).index(a) for a in order])
  return Mesh(devices.reshape(shape), AXES, axis_types=(AxisType.Auto,) * 2)


def check(cfg: config_lib.Qwen2Config, mesh: Mesh, role: str = "target") -> None:
  """Refuses a model the mesh cannot split evenly: before anything is placed or compiled.

  KV heads are not replicated to fill a wider "model" axis: the axis must
  divide them (docs/decisions-mesh.md).

  Args:
    cfg: the model's config.
    mesh: a normalized mesh.
    role: "target" (split over "model") or "draft" (replicated).

  Raises:
    ValueError: the "model" axis does not divide the heads, the KV heads or the MLP width.
  """
  if role == "target":
    _check_split(cfg, mesh.shape[MODEL])


def _check_split(cfg: config_lib.Qwen2Config, tp: int) -> None:
  """Refuses a "model" axis of size `tp` that does not divide the target's heads or MLP width."""
  for field, value in (("num_heads", cfg.num_heads), ("num_kv_heads", cfg.num_kv_heads),
                       ("intermediate_size", cfg.intermediate_size)):
    if value % tp:
      raise ValueError(f"mesh axis 'model' of size {tp} does not divide the target's "
                       f"{field}={value}: use a 'model' axis that divides {value}"
                       + (" (key/value heads are not replicated)" if field == "num_kv_heads"
                          else ""))


def widest(cfg: config_lib.Qwen2Config, devices: int, batch: int = 1) -> tuple[int, int]:
  """The (data, model) shape of `devices` with the widest "model" axis this target splits over.

  Args:
    cfg: the target's config.
    devices: devices in the mesh.
    batch: rows a generation will have (the "data" axis must divide them).

  Returns:
    (data, model) with data * model == devices.

  Raises:
    ValueError: no such shape (e.g. a batch of 1 on more devices than the target splits over).
  """
  for tp in range(devices, 0, -1):
    if devices % tp == 0 and batch % (devices // tp) == 0:
      try:
        _check_split(cfg, tp)
      except ValueError:
        continue
      return devices // tp, tp
  raise ValueError(f"no mesh of {devices} devices splits this target and a batch of {batch}")


def check_batch(rows: int, placement: Optional[Placement]) -> None:
  """Refuses a batch the "data" axis does not divide (before anything compiles).

  Args:
    rows: prompts in the batch.
    placement: the target's placement (None: one device, anything goes).

  Raises:
    ValueError: rows not a multiple of the "data" axis.
  """
  if placement is not None and rows % placement.data:
    raise ValueError(f"a batch of {rows} prompt(s) does not divide over the mesh's 'data' axis "
                     f"of size {placement.data}: pass a multiple of {placement.data} prompts")


def _xla_form(name: str, w: weights.Leaf) -> weights.Leaf:
  """A leaf in a form XLA's partitioner can split, with the same numbers.

  Kernel panels are unpacked and int8 blocks widened to float32 (exact);
  a token table stays a `Table`, which `weights.lookup` reads by rows.
  """
  if isinstance(w, weights.Int8Panels):
    return weights.Int8(cpu_kernels.unpack_int8(w.panels, w.inputs), w.scale)
  if isinstance(w, weights.KERNEL_LEAVES):
    m = weights.matrix(w)  # [I, O]
    return weights.Table(m.T) if name.endswith(_TABLES) else weights.Dense(m)
  return w


def _leaf_axes(name: str, w: Any, placement: Placement) -> Any:
  """Per array of a leaf (same pytree), its axes over the mesh (tuples of names or None)."""
  tp = placement.tensor_parallel
  if isinstance(w, weights.Dense):  # [I, O]
    if tp and name.endswith(_COLUMNS):
      return weights.Dense((None, MODEL))
    if tp and name.endswith(_ROWS):
      return weights.Dense((MODEL, None))
    if tp and placement.vocab_parallel and name.endswith(_TABLES):  # a head as [D, V]
      return weights.Dense((None, MODEL))
    return weights.Dense((None, None))
  if isinstance(w, weights.Table):  # [V, D]
    split = tp and placement.vocab_parallel and name.endswith(_TABLES)
    return weights.Table((MODEL, None) if split else (None, None))
  if isinstance(w, weights.Int8):  # q [O, I], scale [O]
    if tp and name.endswith(_COLUMNS):
      return weights.Int8((MODEL, None), (MODEL,))
    if tp and name.endswith(_ROWS):
      return weights.Int8((None, MODEL), (None,))
    return weights.Int8((None, None), (None,))
  if hasattr(w, "ndim"):
    if tp and name.endswith(_BIASES):
      return (MODEL,)
    return (None,) * w.ndim
  raise TypeError(f"{name}: cannot place a {type(w).__name__} on a mesh")


def _put(x: Any, where: NamedSharding) -> jax.Array:
  """`x` placed as `where` says; across processes each builds its own shards from its copy."""
  if where.is_fully_addressable:
    return jax.device_put(x, where)
  host = np.asarray(x)
  return jax.make_array_from_callback(host.shape, where, lambda index: host[index])


def _place_params(params: Any, placement: Placement) -> Any:
  """Every array of a params tree in its XLA form, placed by `_leaf_axes`."""
  leaves, tree = jax.tree_util.tree_flatten_with_path(params, is_leaf=weights.is_leaf)
  out = []
  for path, leaf in leaves:
    name = model_lib.path_name(path)
    if leaf is None:
      out.append(None)
      continue
    leaf = _xla_form(name, leaf) if weights.is_leaf(leaf) else leaf
    axes = _leaf_axes(name, leaf, placement)
    out.append(jax.tree.map(lambda a, ax: _put(a, placement.sharding(*ax)), leaf, axes))
  return jax.tree_util.tree_unflatten(tree, out)


def placement_of(cfg: config_lib.Qwen2Config, mesh: Mesh, role: str) -> Placement:
  """The placement of a model of this config in a role (`check`ed first).

  Args:
    cfg: the model's config.
    mesh: a normalized mesh.
    role: "target" (tensor-parallel) or "draft" (replicated over "model").

  Returns:
    Its `Placement`: the token tables split over "model" when the
    vocabulary divides the axis, else replicated.
  """
  check(cfg, mesh, role)
  target = role == "target"
  return Placement(mesh, tensor_parallel=target,
                   vocab_parallel=target and cfg.vocab_size % mesh.shape[MODEL] == 0)


def abstract(params: Any, placement: Placement) -> Any:
  """A params tree of `jax.ShapeDtypeStruct`s with the shardings `shard` would give them.

  For sizing and compiling programs without any weights (`bench.tools.capacity`).

  Args:
    params: params in XLA's forms as ShapeDtypeStructs (`model.abstract_params`).
    placement: the model's placement.

  Returns:
    The same tree, each struct carrying its `NamedSharding`.
  """
  leaves, tree = jax.tree_util.tree_flatten_with_path(params, is_leaf=weights.is_leaf)
  out = []
  for path, leaf in leaves:
    axes = _leaf_axes(model_lib.path_name(path), leaf, placement)
    out.append(jax.tree.map(lambda a, ax: jax.ShapeDtypeStruct(
        a.shape, a.dtype, sharding=placement.sharding(*ax)), leaf, axes))
  return jax.tree_util.tree_unflatten(tree, out)


def place_model(m: Any, mesh: Mesh, role: str) -> Any:
  """One prepared model (`jspec.bundle.Model`) on the mesh.

  Args:
    m: the model.
    mesh: a normalized mesh.
    role: "target" (tensor-parallel) or "draft" (replicated over "model").

  Returns:
    The model with placed params, its backend without the CPU kernels and
    its placement set.
  """
  placement = placement_of(m.cfg, mesh, role)
  params = dict(m.params)
  if "greedy_head" in params:  # the kernels' int8 head copy: no kernels on a mesh
    params["greedy_head"] = None
  params = _place_params(params, placement)
  backend = dataclasses.replace(m.backend, kernels=False)
  return dataclasses.replace(m, params=params, backend=backend, placement=placement)


def shard(bundle: Any, mesh: Mesh) -> Any:
  """A bundle placed on a mesh: target tensor-parallel, draft replicated, rows split over "data".

  Args:
    bundle: a prepared `jspec.Bundle` (any stored forms).
    mesh: a `jax.sharding.Mesh` with axes "data" and/or "model".

  Returns:
    A new bundle; `jspec.generate` then runs its programs on the mesh.

  Raises:
    ValueError: an unknown axis name, or a "model" axis that does not divide
      the target's heads, KV heads or MLP width (before anything is placed).
  """
  mesh = normalize(mesh)
  check(bundle.target.cfg, mesh, "target")
  target = place_model(bundle.target, mesh, "target")
  draft = place_model(bundle.draft, mesh, "draft") if bundle.draft is not None else None
  return dataclasses.replace(bundle, target=target, draft=draft)


# --- Host side: inputs, programs and outputs of a sharded generation. ---


def put_inputs(args: tuple, placement: Placement) -> tuple:
  """`decode.prefill`'s arguments (params already placed) on the mesh.

  Args:
    args: (target params, draft params, prompt [B, P], prompt_len [B],
      max_new [B], eos [E], key, knobs).
    placement: the target's placement.

  Returns:
    The same arguments, rows split over "data", the rest replicated.
  """
  t_params, d_params, prompt, prompt_len, max_new, eos, key, knobs = args
  rows = lambda x: _put(np.asarray(x), placement.sharding(DATA, *([None] * (np.ndim(x) - 1))))
  every = lambda x: _put(np.asarray(x), placement.sharding(*([None] * np.ndim(x))))
  key = jax.random.wrap_key_data(every(jax.random.key_data(key)))
  return (t_params, d_params, rows(prompt), rows(prompt_len), rows(max_new), every(eos), key,
          jax.tree.map(every, knobs))


def scalar(value: int, placement: Placement) -> jax.Array:
  """A [] int32 replicated over the mesh (the loop's round limit)."""
  return _put(np.int32(value), placement.sharding())


class Programs:
  """The mesh's compiled programs, keyed by name, static settings, shapes and shardings.

  Sharded programs are compiled directly (`jit(...).lower(...).compile()`),
  not through `jspec.program_store`: an exported program is only ever
  called on the devices it was stored for there.
  """

  def __init__(self):
    self.cache: dict[Any, Any] = {}
    self.compiles = 0

  def get(self, name: str, fn: Callable, args: tuple, static: dict) -> tuple[Any, float]:
    """The compiled `fn(*args, **static)` for these argument shardings (compiled on first use).

    Args:
      name: the program's name.
      fn: a `jax.jit`-wrapped function (its own donation applies).
      args: positional arguments: placed arrays or `jax.ShapeDtypeStruct`s with shardings.
      static: static keyword arguments.

    Returns:
      (executable, seconds spent compiling it now).
    """
    avals = jax.tree.map(lambda x: (x.shape, str(x.dtype), getattr(x, "sharding", None))
                         if hasattr(x, "shape") else x, args)
    key = (name, tuple(sorted(static.items())), str(jax.tree.structure(args)),
           tuple(jax.tree.leaves(avals)))
    if key in self.cache:
      return self.cache[key], 0.0
    programs.enable_persistent_cache()
    t0 = time.perf_counter()
    self.cache[key] = fn.lower(*args, **static).compile()
    self.compiles += 1
    return self.cache[key], time.perf_counter() - t0

  def clear(self) -> None:
    """Drops every program compiled here."""
    self.cache.clear()


PROGRAMS = Programs()


def to_host(state: Any) -> Any:
  """A loop state's per-row results as numpy, gathered across processes where needed.

  Args:
    state: a `decode.State` on the mesh.

  Returns:
    The state without its caches, key and knobs (None), every other field numpy.
  """
  def one(x):
    if not x.is_fully_addressable:
      return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)

  rows = state.replace(target_cache=None, draft_cache=None, key=None, knobs=None)
  return jax.tree.map(one, rows)


def device_bytes(tree: Any) -> int:
  """Bytes one device holds of a tree of placed arrays (or ShapeDtypeStructs with shardings)."""
  total = 0
  for x in jax.tree.leaves(tree):
    if not hasattr(x, "dtype"):
      continue
    shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) else x.shape
    total += math.prod(shape) * np.dtype(x.dtype).itemsize
  return int(total)
