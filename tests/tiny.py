"""Tiny random model pairs for engine tests (prime-ish sizes so shapes can't be confused)."""

from __future__ import annotations

import jax
import numpy as np

import jspec
from convert import config as config_lib
from jspec import bundle as bundle_lib
from jspec import model

VOCAB = 11

TARGET = config_lib.Qwen2Config(
    vocab_size=VOCAB, hidden_size=24, intermediate_size=37, num_layers=2, num_heads=6,
    num_kv_heads=2, head_dim=8, rope_theta=1e4)
DRAFT = config_lib.Qwen2Config(
    vocab_size=VOCAB, hidden_size=16, intermediate_size=19, num_layers=1, num_heads=2,
    num_kv_heads=1, head_dim=8, rope_theta=1e4)

# Sizes that jspec's CPU kernel can store in panels (multiples of 32, the
# vocabulary included): the "packed" layout then really packs them.
PACKABLE_VOCAB = 64
PACKABLE_TARGET = config_lib.Qwen2Config(
    vocab_size=PACKABLE_VOCAB, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16, rope_theta=1e4, eos_token_ids=())
PACKABLE_DRAFT = config_lib.Qwen2Config(  # tied, like the real drafts: the table is the head
    vocab_size=PACKABLE_VOCAB, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
    num_kv_heads=1, head_dim=16, rope_theta=1e4, eos_token_ids=(), tie_word_embeddings=True)


def packable_pair(seed: int = 0, scale: float = 0.3, **settings) -> jspec.Bundle:
  """A random pair whose matrices and tables the CPU kernels can store in panels.

  Args:
    seed: picks the weights.
    scale: weight std.
    **settings: fields of `jspec.Settings` (kernels, draft_int8, ...).

  Returns:
    A tokenizer-less bundle over a `PACKABLE_VOCAB`-token vocabulary.
  """
  kt, kd = jax.random.split(jax.random.key(seed))
  return bundle_lib.make((PACKABLE_TARGET, model.init_params(PACKABLE_TARGET, kt, scale=scale)),
                         (PACKABLE_DRAFT, model.init_params(PACKABLE_DRAFT, kd, scale=scale)),
                         settings=jspec.Settings(**settings))


def pair(seed: int = 0, scale: float = 0.5, vocab: int = VOCAB, **settings) -> jspec.Bundle:
  """A random target/draft pair over a `vocab`-token vocabulary.

  Args:
    seed: picks the weights.
    scale: weight std; 0.5 gives peaked but not degenerate distributions.
    vocab: vocabulary size.
    **settings: fields of `jspec.Settings` (kernels, draft_int8, ...).

  Returns:
    A tokenizer-less bundle (prompts are token ids).
  """
  t_cfg, d_cfg = configs(vocab)
  kt, kd = jax.random.split(jax.random.key(seed))
  return bundle_lib.make((t_cfg, model.init_params(t_cfg, kt, scale=scale)),
                         (d_cfg, model.init_params(d_cfg, kd, scale=scale)),
                         settings=jspec.Settings(**settings))


def configs(vocab: int = VOCAB) -> tuple[config_lib.Qwen2Config, config_lib.Qwen2Config]:
  """The tiny target and draft configs over a `vocab`-token vocabulary."""
  if vocab == VOCAB:
    return TARGET, DRAFT
  resize = lambda cfg: config_lib.Qwen2Config(**{**cfg.to_dict(), "vocab_size": vocab,
                                                 "eos_token_ids": ()})
  return resize(TARGET), resize(DRAFT)


def prompt(seed: int, length: int, vocab: int = VOCAB) -> list[int]:
  """Random token ids."""
  return np.random.RandomState(seed).randint(0, vocab, size=length).tolist()
