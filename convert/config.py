"""Qwen2 model configuration, read from an HF config.json or from GGUF metadata.

Only what the Qwen2 architecture as implemented in `jspec.model` supports is
accepted: settings that would silently change the math (sliding-window
attention, rope scaling, another activation) are rejected with an error that
names the field and its value, rather than producing a subtly wrong model.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from typing import Any, Mapping


class ConfigError(ValueError):
  """A checkpoint's configuration is missing a field or asks for something unsupported."""


@dataclasses.dataclass(frozen=True)
class Qwen2Config:
  """Shape and numerics of one Qwen2 decoder.

  Attributes:
    vocab_size: rows of the embedding table (and of the output head).
    hidden_size: model width D.
    intermediate_size: MLP width F.
    num_layers: decoder blocks L.
    num_heads: query heads N.
    num_kv_heads: key/value heads K (N % K == 0; grouped-query attention).
    head_dim: per-head width H.
    rope_theta: RoPE base frequency.
    rms_norm_eps: RMSNorm epsilon.
    tie_word_embeddings: the output head reuses the embedding table.
    max_position_embeddings: longest context the checkpoint was trained for.
    eos_token_ids: tokens that end a generation (may be empty).
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 1_000_000.0
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = False
  max_position_embeddings: int = 32768
  eos_token_ids: tuple[int, ...] = ()

  def __post_init__(self):
    positive = ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings")
    for name in positive:
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ConfigError(f"config field {name}={value!r}: expected a positive integer")
    if self.num_heads % self.num_kv_heads:
      raise ConfigError(
          f"num_attention_heads={self.num_heads} is not a multiple of "
          f"num_key_value_heads={self.num_kv_heads}")
    if self.head_dim % 2:
      raise ConfigError(f"head_dim={self.head_dim}: RoPE needs an even head dimension")
    if not (isinstance(self.rope_theta, (int, float)) and math.isfinite(self.rope_theta)
            and self.rope_theta > 0):
      raise ConfigError(f"rope_theta={self.rope_theta!r}: expected a finite positive number")
    # eps is added to a mean of squares in float32: it must be a positive float32 number.
    if not (isinstance(self.rms_norm_eps, (int, float)) and math.isfinite(self.rms_norm_eps)
            and 0 < self.rms_norm_eps < 1):
      raise ConfigError(f"rms_norm_eps={self.rms_norm_eps!r}: expected a number in (0, 1)")

  @property
  def queries_per_kv(self) -> int:
    """Query heads per key/value head (Q = N / K)."""
    return self.num_heads // self.num_kv_heads

  def to_dict(self) -> dict[str, Any]:
    """Returns the fields as a JSON-serialisable dict (inverse of `from_dict`)."""
    d = dataclasses.asdict(self)
    d["eos_token_ids"] = list(self.eos_token_ids)
    return d

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "Qwen2Config":
    """Builds a config from `to_dict` output.

    Args:
      d: a mapping with exactly this dataclass's fields.

    Returns:
      The config.
    """
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - fields
    if unknown:
      raise ConfigError(f"unknown jspec config fields {sorted(unknown)}; expected {sorted(fields)}")
    d = dict(d)
    d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
    return cls(**d)


def _eos_tuple(value: Any) -> tuple[int, ...]:
  if value is None:
    return ()
  if isinstance(value, int):
    return (value,)
  return tuple(int(v) for v in value)


def _require(d: Mapping[str, Any], key: str, source: str) -> Any:
  if key not in d or d[key] is None:
    raise ConfigError(f"{source}: required field {key!r} is missing")
  return d[key]


def from_hf_dict(d: Mapping[str, Any], source: str = "config.json") -> Qwen2Config:
  """Reads an HF `Qwen2Config` dict (transformers 4.x or 5.x layout).

  Args:
    d: the parsed config.json.
    source: a name for error messages (usually the file path).

  Returns:
    The config.

  Raises:
    ConfigError: another architecture, or a setting jspec does not implement.
  """
  model_type = d.get("model_type")
  if model_type != "qwen2":
    raise ConfigError(f"{source}: model_type={model_type!r}; jspec supports only 'qwen2'")
  archs = d.get("architectures") or ["Qwen2ForCausalLM"]
  if "Qwen2ForCausalLM" not in archs:
    raise ConfigError(f"{source}: architectures={archs!r}; expected Qwen2ForCausalLM")
  if d.get("use_sliding_window"):
    raise ConfigError(f"{source}: use_sliding_window={d['use_sliding_window']!r}; "
                      "sliding-window attention is not supported")
  act = d.get("hidden_act", "silu")
  if act != "silu":
    raise ConfigError(f"{source}: hidden_act={act!r}; Qwen2 uses 'silu'")
  # transformers 5 moved rope_theta into rope_parameters; older files keep it on top.
  rope = d.get("rope_parameters") or {}
  scaling = d.get("rope_scaling")
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if scaling:
    rope_type = scaling.get("rope_type", scaling.get("type", rope_type))
  if rope_type not in ("default", None):
    raise ConfigError(f"{source}: rope_type={rope_type!r}; only default RoPE is implemented")
  theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
  hidden = int(_require(d, "hidden_size", source))
  heads = int(_require(d, "num_attention_heads", source))
  head_dim = d.get("head_dim") or hidden // heads
  return Qwen2Config(
      vocab_size=int(_require(d, "vocab_size", source)),
      hidden_size=hidden,
      intermediate_size=int(_require(d, "intermediate_size", source)),
      num_layers=int(_require(d, "num_hidden_layers", source)),
      num_heads=heads,
      num_kv_heads=int(d.get("num_key_value_heads") or heads),
      head_dim=int(head_dim),
      rope_theta=float(theta),
      rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
      tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
      max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
      eos_token_ids=_eos_tuple(d.get("eos_token_id")),
  )


# What a config.json that is not an object holds, in JSON's words.
_JSON_TYPES = {list: "array", str: "string", int: "number", float: "number", bool: "boolean",
               type(None): "null"}


def from_hf_json(path: str | pathlib.Path) -> Qwen2Config:
  """Reads `config.json` from a file or a checkpoint directory.

  Args:
    path: a config.json file, or a directory holding one.

  Returns:
    The config.
  """
  path = pathlib.Path(path)
  if path.is_dir():
    path = path / "config.json"
  if not path.is_file():
    raise ConfigError(f"{path}: no config.json found (expected an HF checkpoint directory)")
  try:
    d = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise ConfigError(f"{path}: not valid JSON ({e})") from None
  if not isinstance(d, dict):
    raise ConfigError(f"{path}: expected a JSON object of config fields, got a JSON "
                      f"{_JSON_TYPES.get(type(d), type(d).__name__)}")
  return from_hf_dict(d, source=str(path))


def from_gguf_metadata(meta: Mapping[str, Any], vocab_size: int,
                       tie_word_embeddings: bool, source: str = "gguf") -> Qwen2Config:
  """Reads the `qwen2.*` keys of GGUF metadata.

  Args:
    meta: GGUF key -> plain Python value (strings, numbers, lists).
    vocab_size: rows of `token_embd.weight` (GGUF has no vocab-size key).
    tie_word_embeddings: True when the file has no `output.weight`.
    source: a name for error messages.

  Returns:
    The config.
  """
  arch = meta.get("general.architecture")
  if arch != "qwen2":
    raise ConfigError(f"{source}: general.architecture={arch!r}; jspec supports only 'qwen2'")
  if meta.get("qwen2.rope.scaling.type", "none") not in ("none", None):
    raise ConfigError(f"{source}: qwen2.rope.scaling.type={meta['qwen2.rope.scaling.type']!r}; "
                      "only default RoPE is implemented")
  hidden = int(_require(meta, "qwen2.embedding_length", source))
  heads = int(_require(meta, "qwen2.attention.head_count", source))
  eos = meta.get("tokenizer.ggml.eos_token_id")
  return Qwen2Config(
      vocab_size=int(vocab_size),
      hidden_size=hidden,
      intermediate_size=int(_require(meta, "qwen2.feed_forward_length", source)),
      num_layers=int(_require(meta, "qwen2.block_count", source)),
      num_heads=heads,
      num_kv_heads=int(meta.get("qwen2.attention.head_count_kv", heads)),
      head_dim=int(meta.get("qwen2.attention.key_length", hidden // heads)),
      rope_theta=float(meta.get("qwen2.rope.freq_base", 10000.0)),
      rms_norm_eps=float(meta.get("qwen2.attention.layer_norm_rms_epsilon", 1e-6)),
      tie_word_embeddings=tie_word_embeddings,
      max_position_embeddings=int(meta.get("qwen2.context_length", 32768)),
      eos_token_ids=_eos_tuple(eos),
  )
