"""Where a run's models come from, for jspec and for the HF peers alike.

  real pair     `jspec.load(name)`; the peers load the same GGUF files
  custom pair   `jspec.load(target=path, draft=path)`; the peers load the same
                paths when they are GGUF files or HF checkpoint directories
  random        random weights of the real shapes (`--random-weights`): no
                weight files, no gguf package, no network needed
  smoke         tiny random models (`--smoke`); the draft is the target plus a
                little noise, so drafts are often accepted and multi-token
                rounds are exercised
"""

from __future__ import annotations

import dataclasses
import pathlib
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from bench import memory
from bench import shapes
from jspec import model as model_lib


@dataclasses.dataclass
class Loaded:
  """A run's models.

  Attributes:
    bundle: target, draft and tokenizer (None for random and smoke models).
    hf_source: how the HF child gets the same models (`peers.job`'s source),
      or None when it cannot.
    hf_skip_reason: why not, when hf_source is None.
    info: what the results JSON records about the models.
  """

  bundle: jspec.Bundle
  hf_source: Optional[dict[str, Any]]
  hf_skip_reason: Optional[str]
  info: dict[str, Any]


def _describe(m: jspec.Model, path: Optional[str] = None) -> dict[str, Any]:
  return {"config": m.cfg.to_dict(), "path": path,
          "param_bytes": memory.param_bytes(m.params),
          "forward_bytes": memory.forward_bytes(m.params, m.cfg.tie_word_embeddings)}


def _hf_source_for(target: str, draft: str) -> tuple[Optional[dict], Optional[str]]:
  """The HF child's source for custom paths, or the reason there is none."""
  paths = [pathlib.Path(target), pathlib.Path(draft)]
  if all(p.is_file() and p.suffix == ".gguf" for p in paths):
    return {"kind": "gguf", "target": str(paths[0]), "draft": str(paths[1])}, None
  if all(p.is_dir() and (p / "config.json").is_file() for p in paths):
    return {"kind": "hf_dir", "target": str(paths[0]), "draft": str(paths[1])}, None
  return None, "HF transformers loads GGUF files and HF checkpoint directories, not these paths"


def _numpy_params(cfg, dtype: str, seed: int, scale: float, norm: float = 1.0):
  """Random params from numpy: for tiny models, much faster than compiling a sampler per shape.

  Args:
    cfg: the config.
    dtype: params dtype.
    seed: numpy seed.
    scale: std of every weight.
    norm: added to the norm weights (1: norms near one, as in `init_params`).

  Returns:
    A params pytree of the shapes `model.init_params` gives.
  """
  shapes_tree = jax.eval_shape(lambda: model_lib.init_params(cfg, jax.random.key(0)))
  rng = np.random.default_rng(seed)

  def fill(path, leaf):
    values = scale * rng.standard_normal(leaf.shape, np.float32)
    if "norm" in jax.tree_util.keystr(path):
      values += norm
    return jnp.asarray(values, jnp.dtype(dtype))

  return jax.tree_util.tree_map_with_path(fill, shapes_tree)


def load(model: str, target: Optional[str], draft: Optional[str], dtype: str,
         random_weights: bool, smoke: bool) -> Loaded:
  """Loads (or builds) the pair a run measures.

  Args:
    model: a known pair name (used without target/draft).
    target: the target's path, or None.
    draft: the draft's path, or None.
    dtype: "float32", "bfloat16" or "float16".
    random_weights: random weights of the real shapes.
    smoke: tiny random models.

  Returns:
    The loaded models.
  """
  t0 = time.perf_counter()
  if smoke:
    cfg = shapes.SMOKE_TARGET
    t_params = _numpy_params(cfg, dtype, seed=0, scale=0.5)
    noise = _numpy_params(cfg, dtype, seed=1, scale=0.01, norm=0.0)
    d_params = jax.tree.map(lambda a, b: a + b, t_params, noise)  # a draft close to the target
    bundle = jspec.Bundle(jspec.Model(cfg, t_params), jspec.Model(cfg, d_params))
    source = {"kind": "random", "target": cfg.to_dict(), "draft": cfg.to_dict()}
    info = {"source": "smoke: tiny random models"}
    hf_source, reason = source, None
  elif random_weights:
    t_cfg, d_cfg, origin = shapes.real_pair(model, target, draft)
    t_params = model_lib.init_params(t_cfg, jax.random.key(0), jnp.dtype(dtype))
    d_params = model_lib.init_params(d_cfg, jax.random.key(1), jnp.dtype(dtype))
    bundle = jspec.Bundle(jspec.Model(t_cfg, t_params), jspec.Model(d_cfg, d_params))
    hf_source = {"kind": "random", "target": t_cfg.to_dict(), "draft": d_cfg.to_dict()}
    info = {"source": f"random weights of the real shapes (shapes from {origin})"}
    reason = None
  elif target is not None:
    if draft is None:
      raise ValueError("--target needs --draft (speculative modes need a draft model)")
    bundle = jspec.load(target, draft, dtype=dtype, progress=False)
    hf_source, reason = _hf_source_for(target, draft)
    info = {"source": f"paths: target {target}, draft {draft}"}
  else:
    from jspec import fetch  # pylint: disable=import-outside-toplevel
    bundle = jspec.load(model, dtype=dtype, progress=False)
    t_gguf, d_gguf = fetch.resolve(model, progress=False)
    hf_source = {"kind": "gguf", "target": str(t_gguf), "draft": str(d_gguf)}
    info = {"source": f"known pair {model}"}
    reason = None
  jax.block_until_ready(jax.tree.leaves(bundle.target.params))
  info["load_s"] = time.perf_counter() - t0
  info["target"] = _describe(bundle.target, (hf_source or {}).get("target")
                             if (hf_source or {}).get("kind") != "random" else None)
  info["draft"] = _describe(bundle.draft, (hf_source or {}).get("draft")
                            if (hf_source or {}).get("kind") != "random" else None)
  info["rss_after_load_bytes"] = memory.rss_bytes()
  return Loaded(bundle, hf_source, reason, info)
