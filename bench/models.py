"""Where a run's models come from, for jspec and for the HF peers alike.

  real pair     `jspec.load(name)`; the peers load the same GGUF files
  custom pair   `jspec.load(target=path, draft=path)`; the peers load the same
                paths when they are GGUF files or HF checkpoint directories
  random        random weights of the real shapes (`--random-weights`): no
                weight files, no gguf package, no network needed
  smoke         tiny random models (`--smoke`); the draft is the target plus a
                little noise, so drafts are often accepted and multi-token
                rounds are exercised

Every model is prepared once, as `jspec.load` prepares it (`jspec.bundle`):
the bundle's draft is int8 on CPU. A run with a float-draft mode
(`--float-draft`) loads the draft a second time with its float weights
(`jspec.Settings(draft_int8=False)`), beside the same target.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import convert
import jspec
from bench import memory
from bench import modes as modes_lib
from bench import shapes
from jspec import bundle as bundle_lib
from jspec import model as model_lib
from jspec import modules
from jspec import weights

FLOAT_DRAFT = bundle_lib.Settings(draft_int8=False)  # the settings a float-draft mode's draft has


@dataclasses.dataclass
class Loaded:
  """A run's models.

  Attributes:
    bundle: target, draft and tokenizer (None for random and smoke models).
    hf_source: how the HF child gets the same models (`peers.job`'s source),
      or None when it cannot.
    hf_skip_reason: why not, when hf_source is None.
    info: what the results JSON records about the models.
    float_bundle: the same target with the draft's float weights (for
      modes with draft_int8=False), or None when none was asked for.
  """

  bundle: jspec.Bundle
  hf_source: Optional[dict[str, Any]]
  hf_skip_reason: Optional[str]
  info: dict[str, Any]
  float_bundle: Optional[jspec.Bundle] = None

  def bundle_for(self, mode: modes_lib.Mode) -> jspec.Bundle:
    """The bundle a mode runs with: the float-draft one for a mode with draft_int8=False.

    Args:
      mode: a jspec mode.

    Returns:
      The bundle.

    Raises:
      ValueError: a float-draft mode, and no float draft was loaded.
    """
    if mode.draft_int8 is False:
      if self.float_bundle is None:
        raise ValueError(f"mode {mode.name} needs the float draft; load with float_draft=True")
      return self.float_bundle
    return self.bundle


def _describe(m: jspec.Model, path: Optional[str] = None) -> dict[str, Any]:
  # The stored forms say which draft (4-bit, int8, float) a run measured.
  forms = sorted({type(leaf).__name__ for leaf in jax.tree.leaves(m.params, is_leaf=weights.is_leaf)
                  if weights.is_leaf(leaf)})
  return {"config": m.cfg.to_dict(), "path": path, "backend": dataclasses.asdict(m.backend),
          "leaf_forms": forms, "param_bytes": memory.param_bytes(m.params),
          "forward_bytes": memory.forward_bytes(m.cfg, m.params)}


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
    norm: added to the norm scales (1: norms near one, as in `init_params`).

  Returns:
    A params tree of the structure and shapes `model.init_params` gives.
  """
  module = modules.Qwen2(cfg, rngs=None)  # shapes only
  rng = np.random.default_rng(seed)

  def draw(shape, offset: float = 0.0) -> jax.Array:
    return jnp.asarray(scale * rng.standard_normal(shape, np.float32) + offset, jnp.dtype(dtype))

  for _, node in nnx.iter_graph(module):
    if isinstance(node, modules.RMSNorm):
      node.scale.set_value(draw(node.scale.get_value().shape, norm))
  params = model_lib.params_of(module)
  return jax.tree.map(lambda leaf: draw(leaf.shape) if isinstance(leaf, jax.ShapeDtypeStruct)
                      else leaf, params)


def prepare_checkpoint(path: str, role: str, settings: bundle_lib.Settings,
                       dtype: str = "float32") -> jspec.Model:
  """One checkpoint loaded and prepared on its own, as `jspec.load` prepares a model of its role.

  Args:
    path: the checkpoint (GGUF, HF directory or converted jspec file).
    role: "target" or "draft" (`jspec.bundle.prepare`).
    settings: how it is stored.
    dtype: params dtype.

  Returns:
    The prepared model.
  """
  cfg, tensors = convert.load_checkpoint(path, dtype=dtype)
  params = model_lib.params_from_tensors(cfg, tensors)
  del tensors
  return bundle_lib.prepare(cfg, params, role, settings, consume=True)


def checkpoint_files(model: str, dtype: str = "float32") -> tuple[str, str]:
  """A known pair's (target, draft) checkpoints: the files `jspec.load` converted, else the GGUFs.

  Args:
    model: a known pair name.
    dtype: the params dtype of the converted files.

  Returns:
    Two paths `prepare_checkpoint` loads.
  """
  from jspec import fetch  # pylint: disable=import-outside-toplevel
  from jspec import loading  # pylint: disable=import-outside-toplevel
  out = []
  for gguf in fetch.resolve(model, progress=False):
    converted = loading.converted_path(gguf, dtype)
    out.append(str(converted if converted.is_file() else gguf))
  return out[0], out[1]


def load(model: str, target: Optional[str], draft: Optional[str], dtype: Optional[str],
         random_weights: bool, smoke: bool, float_draft: bool = False,
         draft_vocab: Optional[int] = None, draft_int4: Optional[bool] = None) -> Loaded:
  """Loads (or builds) the pair a run measures.

  Args:
    model: a known pair name (used without target/draft).
    target: the target's path, or None.
    draft: the draft's path, or None.
    dtype: as `jspec.load` takes it (None: its default); random weights
      take a float dtype (None and "exact": float32).
    random_weights: random weights of the real shapes.
    smoke: tiny random models.
    float_draft: also prepare the draft with its float weights
      (`Loaded.float_bundle`).
    draft_vocab: `jspec.Settings.draft_vocab` for the run's draft (None:
      the Settings default; 0: the whole vocabulary).
    draft_int4: `jspec.Settings.draft_int4` for the run's draft (None: the
      Settings default).

  Returns:
    The loaded models.
  """
  t0 = time.perf_counter()
  settings = bundle_lib.Settings()
  if draft_vocab is not None:
    settings = dataclasses.replace(settings, draft_vocab=draft_vocab)
  if draft_int4 is not None:
    settings = dataclasses.replace(settings, draft_int4=draft_int4)
  float_dtype = dtype if dtype not in (None, "exact") else "float32"  # random weights, float draft
  f_draft = None
  if smoke or random_weights:
    if smoke:
      t_cfg = d_cfg = shapes.SMOKE_TARGET
      t_params = _numpy_params(t_cfg, float_dtype, seed=0, scale=0.5)
      noise = _numpy_params(t_cfg, float_dtype, seed=1, scale=0.01, norm=0.0)
      d_params = jax.tree.map(lambda a, b: a + b, t_params, noise)  # a draft close to the target
      info = {"source": "smoke: tiny random models"}
    else:
      t_cfg, d_cfg, origin = shapes.real_pair(model, target, draft)
      t_params = model_lib.init_params(t_cfg, jax.random.key(0), jnp.dtype(float_dtype))
      d_params = model_lib.init_params(d_cfg, jax.random.key(1), jnp.dtype(float_dtype))
      info = {"source": f"random weights of the real shapes (shapes from {origin})"}
    # Prepared as `jspec.load` prepares a checkpoint: each source matrix goes
    # once its stored form exists.
    if float_draft:
      f_draft = bundle_lib.prepare(d_cfg, d_params, "draft", FLOAT_DRAFT)
    bundle = jspec.Bundle(bundle_lib.prepare(t_cfg, t_params, "target", settings, consume=True),
                          bundle_lib.prepare(d_cfg, d_params, "draft", settings, consume=True))
    hf_source = {"kind": "random", "target": t_cfg.to_dict(), "draft": d_cfg.to_dict()}
    reason = None
  elif target is not None:
    if draft is None:
      raise ValueError("--target needs --draft (speculative modes need a draft model)")
    bundle = jspec.load(target, draft, dtype=dtype, progress=False, settings=settings)
    if float_draft:
      f_draft = prepare_checkpoint(draft, "draft", FLOAT_DRAFT, float_dtype)
    hf_source, reason = _hf_source_for(target, draft)
    info = {"source": f"paths: target {target}, draft {draft}"}
  else:
    from jspec import fetch  # pylint: disable=import-outside-toplevel
    bundle = jspec.load(model, dtype=dtype, progress=False, settings=settings)
    t_gguf, d_gguf = fetch.resolve(model, progress=False)
    if float_draft:
      f_draft = prepare_checkpoint(checkpoint_files(model, float_dtype)[1], "draft", FLOAT_DRAFT,
                                   float_dtype)
    hf_source = {"kind": "gguf", "target": str(t_gguf), "draft": str(d_gguf)}
    info = {"source": f"known pair {model}"}
    reason = None
  jax.block_until_ready(jax.tree.leaves(bundle.target.params))
  info["load_s"] = time.perf_counter() - t0
  paths = hf_source if (hf_source or {}).get("kind") not in (None, "random") else {}
  info["target"] = _describe(bundle.target, paths.get("target"))
  info["draft"] = _describe(bundle.draft, paths.get("draft"))
  float_bundle = None
  if f_draft is not None:
    info["float_draft"] = _describe(f_draft, paths.get("draft"))
    float_bundle = jspec.Bundle(bundle.target, f_draft, bundle.tokenizer)
  info["rss_after_load_bytes"] = memory.rss_bytes()
  return Loaded(bundle, hf_source, reason, info, float_bundle)
