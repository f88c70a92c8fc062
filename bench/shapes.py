"""Model configs for runs without real weights: the real pair's shapes, and tiny smoke models.

Speed depends on shapes, not values, so a machine without the weight files
(a GPU box with no network) can still measure what a round costs, with random
weights of exactly the real shapes. The shapes come from the real GGUF
metadata when the files are at hand, else from the copies below.
"""

from __future__ import annotations

import pathlib
import sys
from typing import Optional

from convert import config as config_lib

# Qwen2.5-Coder-1.5B-Instruct and -0.5B-Instruct as their Q4_K_M GGUF files
# describe them (read with `convert.gguf_file`). Both files carry a separate
# `output.weight`, so both heads are untied here even though the HF
# checkpoints tie the embeddings: these are the models jspec actually loads.
QWEN25_CODER_1_5B = config_lib.Qwen2Config(
    vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12,
    num_kv_heads=2, head_dim=128, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=False, max_position_embeddings=32768, eos_token_ids=(151645,))
QWEN25_CODER_0_5B = config_lib.Qwen2Config(
    vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
    num_kv_heads=2, head_dim=64, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=False, max_position_embeddings=32768, eos_token_ids=(151645,))

KNOWN = {"qwen2.5-coder": (QWEN25_CODER_1_5B, QWEN25_CODER_0_5B)}

# Smoke models: a 263-id vocabulary (prime; byte-level prompt ids fit below
# 256) and odd widths, small enough that every program compiles in a second.
SMOKE_VOCAB = 263
SMOKE_TARGET = config_lib.Qwen2Config(
    vocab_size=SMOKE_VOCAB, hidden_size=48, intermediate_size=74, num_layers=2, num_heads=6,
    num_kv_heads=2, head_dim=8, rope_theta=1e4, max_position_embeddings=512)
SMOKE_DRAFT = config_lib.Qwen2Config(
    vocab_size=SMOKE_VOCAB, hidden_size=24, intermediate_size=38, num_layers=1, num_heads=3,
    num_kv_heads=1, head_dim=8, rope_theta=1e4, max_position_embeddings=512)


def real_pair(model: str, target: Optional[str] = None, draft: Optional[str] = None,
              verbose: bool = True) -> tuple[config_lib.Qwen2Config, config_lib.Qwen2Config, str]:
  """The (target, draft) configs of a pair, without loading weights or touching the network.

  Args:
    model: a known pair name (see KNOWN), used when no paths are given.
    target: optional path of the target's GGUF file.
    draft: optional path of the draft's GGUF file.
    verbose: say on stderr where the shapes came from.

  Returns:
    (target config, draft config, where they came from: "gguf metadata" or "built-in").

  Raises:
    ValueError: an unknown pair name with no GGUF files to read.
  """
  paths = (target, draft) if target and draft else _assembled_files(model)
  if paths is not None:
    try:
      from convert import gguf_file  # pylint: disable=import-outside-toplevel (needs gguf)
      cfgs = []
      for path in paths:
        source = gguf_file.Source(path)
        cfgs.append(source.config)
        source.close()
      return cfgs[0], cfgs[1], "gguf metadata"
    except Exception as e:  # no gguf package, unreadable file: fall back to the copies
      if verbose:
        print(f"bench: cannot read shapes from {paths} ({type(e).__name__}: {e}); "
              "using built-in shapes", file=sys.stderr)
  if model not in KNOWN:
    raise ValueError(f"no built-in shapes for {model!r}; known: {sorted(KNOWN)} "
                     "(or pass --target/--draft GGUF files)")
  t_cfg, d_cfg = KNOWN[model]
  return t_cfg, d_cfg, "built-in"


def _assembled_files(model: str) -> Optional[tuple[str, str]]:
  """The pair's already assembled GGUF files in jspec's cache, if both are there."""
  try:
    from jspec import fetch  # pylint: disable=import-outside-toplevel
    names = fetch.PAIRS[model]
    paths = [fetch.cache_dir() / fetch.MODELS[n].filename for n in names]
  except Exception:  # unknown pair, unwritable cache dir: no files
    return None
  if all(pathlib.Path(p).is_file() for p in paths):
    return str(paths[0]), str(paths[1])
  return None
