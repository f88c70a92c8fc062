"""Where a model's arrays live on a ("data", "model") mesh, and the constraints that keep them there.

Static and free of jspec imports, so that `jspec.model`, `jspec.cache` and
`jspec.decode` can constrain their arrays without importing `jspec.mesh`
(which places whole bundles). With no placement (one device) every helper
here returns its input: the single-device program is traced as before.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

DATA, MODEL = "data", "model"
AXES = (DATA, MODEL)


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where one model's arrays live on a mesh; static (it is part of `model.Arch`).

  Attributes:
    mesh: a ("data", "model") mesh with Auto axes (`normalize`).
    tensor_parallel: split the model's heads and MLP over "model" (the
      target); False replicates them (the draft).
    vocab_parallel: split the token tables over "model" (the vocabulary
      divides the axis).
  """

  mesh: Mesh
  tensor_parallel: bool = True
  vocab_parallel: bool = True

  @property
  def data(self) -> int:
    """Size of the "data" axis."""
    return self.mesh.shape[DATA]

  @property
  def model(self) -> int:
    """Size of the "model" axis."""
    return self.mesh.shape[MODEL]

  def spec(self, *axes: Optional[str]) -> PartitionSpec:
    """A PartitionSpec with "model" dropped where this model is replicated over it."""
    drop = lambda a: None if a == MODEL and not self.tensor_parallel else a
    return PartitionSpec(*[drop(a) for a in axes])

  def sharding(self, *axes: Optional[str]) -> NamedSharding:
    """The `NamedSharding` of an array split as `axes` (one entry per dimension)."""
    return NamedSharding(self.mesh, self.spec(*axes))


def constrain(x: jax.Array, placement: Optional[Placement], *axes: Optional[str]) -> jax.Array:
  """`x` constrained to be split as `axes` over the placement's mesh; unchanged without one.

  Args:
    x: an array inside a traced program.
    placement: the model's placement, or None (one device: no-op).
    *axes: one mesh axis name (or None) per dimension of x.

  Returns:
    x, with a sharding constraint when placed.
  """
  if placement is None:
    return x
  return jax.lax.with_sharding_constraint(x, placement.sharding(*axes))


def constrain_rows(tree: Any, placement: Optional[Placement]) -> Any:
  """Every array of a pytree whose first axis is the batch split over "data", the rest replicated."""
  if placement is None:
    return tree
  return jax.tree.map(lambda x: constrain(x, placement, DATA, *([None] * (x.ndim - 1))), tree)




def constrain_cache(buf: jax.Array, placement: Optional[Placement]) -> jax.Array:
  """A [L, B, S, K, H] cache buffer: rows over "data", key/value heads over "model"."""
  return constrain(buf, placement, None, DATA, None, MODEL, None)
