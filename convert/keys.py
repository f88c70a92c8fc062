"""The one key table: checkpoint tensor names -> jspec params paths and shapes.

Every source (an HF safetensors directory, a GGUF file) is read as a stream of
tensors named the HF way (`model.layers.3.self_attn.q_proj.weight`) in HF
orientation (a Linear weight is [out, in]). `Assembler` sends each one through
`convert_weight`, which finds its rule in `_RULES`, asserts its shape against
the config, transposes it if jspec wants it the other way round and casts it.
Anything the table does not account for is a hard error naming the tensor:
an unmapped name, a duplicate, a wrong shape, a NaN, a tensor the model needs
that never came. A checkpoint that loads has exactly the tensors the model
uses, each where the model expects it.

GGUF names (`blk.3.attn_q.weight`) map onto HF names through `_GGUF_NAMES`
first, so both sources are checked by the same table. llama.cpp's converter
permutes the Q/K rows of LLaMA checkpoints for its interleaved RoPE, but not
those of qwen2, which it runs with the same half-split RoPE as HF
(tests/test_convert.py checks this numerically against transformers).

jspec paths are `/`-joined keys of the model's params tree
(`layers/3/attn/q/w`: `jspec.model`'s modules define it), which is also how
`convert.store` names tensors in its files. Matrices come out [in, out]
(`jspec.weights.Dense`), token tables [V, D] (`jspec.weights.Table`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Iterator, Optional

import ml_dtypes
import numpy as np

from convert import config as config_lib


class ConvertError(ValueError):
  """A checkpoint does not hold what a Qwen2 model needs, or cannot be read."""


# Param dtypes by name; numpy has no bfloat16 of its own, ml_dtypes (a jax
# dependency) provides the one jax uses.
DTYPES = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
}


# The storage that keeps a checkpoint's own numbers: GGUF quantized matrices
# as exact int8 blocks (`convert.gguf_blocks`), bfloat16 as bfloat16, the rest
# as float32 (float16 widens to it exactly).
EXACT = "exact"


def resolve_dtype(dtype: Any) -> Optional[np.dtype]:
  """Maps "float32" / "bfloat16" / "float16" (or the dtype itself) to a numpy dtype.

  Args:
    dtype: a name from `DTYPES`, `EXACT`, or a numpy/jax dtype.

  Returns:
    The numpy dtype, or None for `EXACT` (each tensor keeps its own form).
  """
  if isinstance(dtype, str):
    if dtype == EXACT:
      return None
    if dtype not in DTYPES:
      raise ConvertError(f"dtype {dtype!r} is not supported; expected one of "
                         f"{sorted(DTYPES) + [EXACT]}")
    return DTYPES[dtype]
  d = np.dtype(dtype)
  if d not in DTYPES.values():
    raise ConvertError(f"dtype {d} is not supported; expected one of {sorted(DTYPES)}")
  return d


@dataclasses.dataclass(frozen=True)
class _Rule:
  """How one family of HF tensors becomes jspec params.

  Attributes:
    hf: regex fullmatched against the HF name; group 1 (if any) is the layer.
    path: jspec path; `{layer}` is filled from the match.
    shape: the HF shape as config symbols, e.g. "N*H, D" (see `_symbols`).
    transpose: HF stores Linear weights [out, in]; jspec's matrices are [in, out].
  """

  hf: str
  path: str
  shape: str
  transpose: bool = False


_LAYER = r"model\.layers\.(\d+)\."
_RULES = (
    # Token tables stay [V, D] like HF (read by rows; the head multiplies by their transpose).
    _Rule(r"model\.embed_tokens\.weight", "embed/table", "V, D"),
    _Rule(_LAYER + r"input_layernorm\.weight", "layers/{layer}/attn_norm/scale", "D"),
    _Rule(_LAYER + r"post_attention_layernorm\.weight", "layers/{layer}/mlp_norm/scale", "D"),
    _Rule(_LAYER + r"self_attn\.q_proj\.weight", "layers/{layer}/attn/q/w", "N*H, D",
          transpose=True),
    _Rule(_LAYER + r"self_attn\.q_proj\.bias", "layers/{layer}/attn/q/b", "N*H"),
    _Rule(_LAYER + r"self_attn\.k_proj\.weight", "layers/{layer}/attn/k/w", "K*H, D",
          transpose=True),
    _Rule(_LAYER + r"self_attn\.k_proj\.bias", "layers/{layer}/attn/k/b", "K*H"),
    _Rule(_LAYER + r"self_attn\.v_proj\.weight", "layers/{layer}/attn/v/w", "K*H, D",
          transpose=True),
    _Rule(_LAYER + r"self_attn\.v_proj\.bias", "layers/{layer}/attn/v/b", "K*H"),
    _Rule(_LAYER + r"self_attn\.o_proj\.weight", "layers/{layer}/attn/o/w", "D, N*H",
          transpose=True),
    _Rule(_LAYER + r"mlp\.gate_proj\.weight", "layers/{layer}/mlp/gate/w", "F, D", transpose=True),
    _Rule(_LAYER + r"mlp\.up_proj\.weight", "layers/{layer}/mlp/up/w", "F, D", transpose=True),
    _Rule(_LAYER + r"mlp\.down_proj\.weight", "layers/{layer}/mlp/down/w", "D, F",
          transpose=True),
    _Rule(r"model\.norm\.weight", "norm/scale", "D"),
    _Rule(r"lm_head\.weight", "head/w", "V, D"),
)

# Tensors that some checkpoints carry but that hold nothing the model needs:
# older transformers saved RoPE's inverse frequencies as a buffer, which jspec
# recomputes from rope_theta.
_IGNORED = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)

# GGUF tensor name -> HF tensor name (llama.cpp's names for the qwen2 arch).
_GGUF_NAMES = (
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"blk\.(\d+)\.attn_norm\.weight", "model.layers.{0}.input_layernorm.weight"),
    (r"blk\.(\d+)\.ffn_norm\.weight", "model.layers.{0}.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.attn_q\.(weight|bias)", "model.layers.{0}.self_attn.q_proj.{1}"),
    (r"blk\.(\d+)\.attn_k\.(weight|bias)", "model.layers.{0}.self_attn.k_proj.{1}"),
    (r"blk\.(\d+)\.attn_v\.(weight|bias)", "model.layers.{0}.self_attn.v_proj.{1}"),
    (r"blk\.(\d+)\.attn_output\.weight", "model.layers.{0}.self_attn.o_proj.weight"),
    (r"blk\.(\d+)\.ffn_gate\.weight", "model.layers.{0}.mlp.gate_proj.weight"),
    (r"blk\.(\d+)\.ffn_up\.weight", "model.layers.{0}.mlp.up_proj.weight"),
    (r"blk\.(\d+)\.ffn_down\.weight", "model.layers.{0}.mlp.down_proj.weight"),
)


def gguf_to_hf_name(name: str) -> str:
  """Maps a llama.cpp qwen2 tensor name to its HF name.

  Args:
    name: a GGUF tensor name, e.g. "blk.0.attn_q.weight".

  Returns:
    The HF name, e.g. "model.layers.0.self_attn.q_proj.weight".

  Raises:
    ConvertError: the name is not one a qwen2 GGUF has.
  """
  for pattern, template in _GGUF_NAMES:
    m = re.fullmatch(pattern, name)
    if m:
      return template.format(*m.groups())
  raise ConvertError(f"GGUF tensor {name!r} is not a qwen2 tensor jspec knows how to map")


def _symbols(cfg: config_lib.Qwen2Config) -> dict[str, int]:
  return {"V": cfg.vocab_size, "D": cfg.hidden_size, "F": cfg.intermediate_size,
          "N": cfg.num_heads, "K": cfg.num_kv_heads, "H": cfg.head_dim}


def _shape(spec: str, cfg: config_lib.Qwen2Config) -> tuple[int, ...]:
  """Evaluates a shape spec like "N*H, D" against the config."""
  sym = _symbols(cfg)
  return tuple(int(np.prod([sym[s.strip()] for s in dim.split("*")]))
               for dim in spec.split(","))


def _match(hf_name: str, cfg: config_lib.Qwen2Config) -> tuple[_Rule, str]:
  """Finds the rule for an HF name and its jspec path; raises if there is none."""
  for rule in _RULES:
    m = re.fullmatch(rule.hf, hf_name)
    if not m:
      continue
    layer = int(m.group(1)) if m.groups() else None
    if layer is not None and layer >= cfg.num_layers:
      raise ConvertError(f"tensor {hf_name!r} belongs to layer {layer}, but the config has "
                         f"num_layers={cfg.num_layers}")
    return rule, rule.path.format(layer=layer)
  raise ConvertError(f"tensor {hf_name!r} is not a Qwen2ForCausalLM weight jspec knows how to map")


def _rules_for(cfg: config_lib.Qwen2Config) -> Iterator[tuple[str, str, _Rule]]:
  """Every (jspec path, HF name, rule) the model needs."""
  for rule in _RULES:
    if rule.path == "head/w" and cfg.tie_word_embeddings:
      continue
    layers = range(cfg.num_layers) if "{layer}" in rule.path else [None]
    for layer in layers:
      # The patterns are literal names but for the layer group, so they invert.
      hf_name = rule.hf.replace(r"(\d+)", str(layer)).replace("\\.", ".")
      yield rule.path.format(layer=layer), hf_name, rule


def expected_shapes(cfg: config_lib.Qwen2Config) -> dict[str, tuple[int, ...]]:
  """The jspec params the model needs, with their (jspec-orientation) shapes.

  Args:
    cfg: the model config.

  Returns:
    jspec path -> shape: embeddings, then layer by layer, then norm and head.
  """
  out = {}
  for path, _, rule in _rules_for(cfg):
    shape = _shape(rule.shape, cfg)
    out[path] = shape[::-1] if rule.transpose else shape
  return dict(sorted(out.items(), key=lambda kv: _sort_key(kv[0])))


def _sort_key(path: str):
  parts = path.split("/")
  if parts[0] == "layers":
    return (1, int(parts[1]), path)
  return ({"embed": 0, "norm": 2, "head": 3}.get(parts[0], 4), 0, path)


def is_ignored(hf_name: str) -> bool:
  """Whether a checkpoint tensor is known to be unneeded (e.g. RoPE buffers).

  Args:
    hf_name: the HF tensor name.

  Returns:
    True for tensors to skip silently.
  """
  return any(re.fullmatch(p, hf_name) for p in _IGNORED)


def stored_dtype(source: Optional[np.dtype], dtype: Any) -> np.dtype:
  """The dtype a float tensor is converted to, known before reading it, so a file can be laid out.

  Args:
    source: the tensor's dtype as its source returns it (None: one not named here).
    dtype: the params dtype, or `EXACT` (see `resolve_dtype`).

  Returns:
    `dtype` itself, or with `EXACT` bfloat16 and float32 as they are and
    anything else (float16) widened exactly to float32.
  """
  cast = resolve_dtype(dtype)
  if cast is not None:
    return cast
  keep = (DTYPES["float32"], DTYPES["bfloat16"])
  return np.dtype(source) if source is not None and np.dtype(source) in keep else DTYPES["float32"]


def convert_weight(hf_name: str, array: Any, cfg: config_lib.Qwen2Config,
                   dtype: Any = "float32") -> tuple[str, Any]:
  """Checks one HF tensor's shape, then transposes and casts it for jspec.

  Args:
    hf_name: the HF tensor name.
    array: the tensor in HF orientation ([out, in] for Linear weights): a
      numpy array, or (exact storage) a `gguf_blocks.Blocks`.
    cfg: the model config the tensor must agree with.
    dtype: the params dtype, or `EXACT` (see `resolve_dtype`).

  Returns:
    (jspec path, C-contiguous array of the jspec shape and dtype); a
    `gguf_blocks.Blocks` stays as it is, in HF orientation.

  Raises:
    ConvertError: unmapped name, wrong shape, or NaN/Inf values.
  """
  rule, path = _match(hf_name, cfg)
  want = _shape(rule.shape, cfg)
  if tuple(array.shape) != want:
    raise ConvertError(f"tensor {hf_name!r} has shape {tuple(array.shape)}, expected "
                       f"({rule.shape}) = {want} from the config")
  if not isinstance(array, np.ndarray):  # int8 blocks: their scales must be finite numbers
    parts = [array.scale] + ([] if array.offset is None else [array.offset])
    if not all(np.isfinite(part).all() for part in parts):
      raise ConvertError(f"tensor {hf_name!r} holds NaN or Inf block scales")
    return path, array
  if rule.transpose:
    array = array.T
  cast = stored_dtype(array.dtype, dtype)
  # Contiguous: safetensors writes raw buffers, and a transposed view's buffer
  # is the untransposed data.
  array = np.ascontiguousarray(array, dtype=cast)
  if not np.isfinite(array).all():
    raise ConvertError(f"tensor {hf_name!r} holds NaN or Inf values (in {array.dtype})")
  return path, array


def transposed(cfg: config_lib.Qwen2Config) -> frozenset[str]:
  """The jspec paths whose tensors jspec holds transposed from HF's [out, in] (the matrices)."""
  return frozenset(path for path, _, rule in _rules_for(cfg) if rule.transpose)


def hf_names(cfg: config_lib.Qwen2Config) -> dict[str, str]:
  """The checkpoint tensor each param comes from.

  Args:
    cfg: the model config.

  Returns:
    jspec path -> HF name, as `expected_shapes` orders them.
  """
  names = {path: hf_name for path, hf_name, _ in _rules_for(cfg)}
  return {path: names[path] for path in expected_shapes(cfg)}


def hf_shapes(cfg: config_lib.Qwen2Config) -> dict[str, tuple[int, ...]]:
  """The shape each jspec path has in HF orientation ([out, in] for matrices and tables).

  Args:
    cfg: the model config.

  Returns:
    jspec path -> shape, as `expected_shapes` orders them.
  """
  return {path: _shape(rule.shape, cfg) for path, _, rule in _rules_for(cfg)}


class Assembler:
  """Collects the model's tensors from a stream of HF-named ones, checking everything.

  Usage: `add` every tensor of the checkpoint, then `finish` for the tensors
  by jspec path. With a `sink`, each converted tensor goes to it instead of
  being kept, so that a writer holds one tensor at a time, not the model.
  """

  def __init__(self, cfg: config_lib.Qwen2Config, dtype: Any = "float32",
               put: Optional[Callable[[np.ndarray], Any]] = None, source: str = "checkpoint",
               sink: Optional[Callable[[str, Any], None]] = None, tied_head: bool = False):
    """Args:
      cfg: the model config (from the same checkpoint).
      dtype: params dtype (see `resolve_dtype`).
      put: applied to each converted array before it is kept (e.g.
        `jax.device_put`, so that only one tensor at a time lives on the host).
      source: a name for error messages (the file or directory).
      sink: called as sink(jspec path, tensor) with each converted tensor,
        which is then not kept (`finish` returns nothing).
      tied_head: with a sink, the checkpoint also holds an lm_head.weight
        that the config ties to the embeddings: the embedding table is kept
        until the head has come and been compared with it.
    """
    self.cfg = cfg
    resolve_dtype(dtype)  # a bad dtype fails here, before any tensor
    self.dtype = dtype
    self.put = put or (lambda x: x)
    self.source = source
    self.sink = sink
    self._keep_embed = tied_head and cfg.tie_word_embeddings
    self._seen: dict[str, str] = {}  # jspec path -> HF name it came from
    self._tensors: dict[str, Any] = {}  # jspec path -> converted tensor
    self._tied_head: Optional[np.ndarray] = None

  def _check_tied_head(self) -> None:
    embed, head = self._tensors.get("embed/table"), self._tied_head
    embed, head = (x.widen() if hasattr(x, "widen") else x for x in (embed, head))  # int8 blocks
    embed = np.asarray(embed)
    head = np.asarray(head)
    head = head.astype(embed.dtype)
    if embed.shape != head.shape or not np.array_equal(embed, head):
      raise ConvertError(f"{self.source}: the config ties the output head to the embeddings "
                         "(tie_word_embeddings=True) but the checkpoint's lm_head.weight differs "
                         "from model.embed_tokens.weight")
    self._tied_head = None

  def add(self, hf_name: str, array: np.ndarray, label: Optional[str] = None) -> None:
    """Converts one tensor and keeps it.

    Args:
      hf_name: its HF name.
      array: its data in HF orientation.
      label: the tensor's name in the file when that is not the HF name (GGUF),
        added to error messages.
    """
    if is_ignored(hf_name):
      return
    if hf_name == "lm_head.weight" and self.cfg.tie_word_embeddings:
      # Some exporters write the tied head out as well; it must be the embedding.
      self._tied_head = array if not isinstance(array, np.ndarray) else np.asarray(array)
      if self.sink is not None and "embed/table" in self._tensors:
        self._check_tied_head()  # both here: compare now and let both go
        del self._tensors["embed/table"]
      return
    try:
      path, converted = convert_weight(hf_name, array, self.cfg, self.dtype)
    except ConvertError as e:
      where = f" (file tensor {label!r})" if label and label != hf_name else ""
      raise ConvertError(f"{self.source}: {e}{where}") from None
    if path in self._seen:
      raise ConvertError(f"{self.source}: tensor {hf_name!r} appears twice "
                         f"(as {self._seen[path]!r} before)")
    self._seen[path] = hf_name
    if self.sink is None:
      self._tensors[path] = self.put(converted) if isinstance(converted, np.ndarray) else converted
      return
    self.sink(path, converted)
    if path == "embed/table" and self._tied_head is not None:
      self._tensors[path] = converted
      self._check_tied_head()
      del self._tensors[path]
    elif path == "embed/table" and self._keep_embed:
      self._tensors[path] = converted  # until the tied head comes

  def finish(self) -> dict[str, Any]:
    """Returns the tensors once every one the model needs has been added.

    Returns:
      jspec path -> tensor, in `expected_shapes` order; empty with a sink.

    Raises:
      ConvertError: some tensors never came.
    """
    missing = [hf for path, hf, _ in _rules_for(self.cfg) if path not in self._seen]
    if missing:
      shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
      raise ConvertError(f"{self.source}: missing {len(missing)} tensor(s) the model needs: {shown}")
    if self._tied_head is not None:
      self._check_tied_head()
    if self.sink is not None:
      self._tensors.clear()
      return {}
    return {path: self._tensors[path] for path in expected_shapes(self.cfg)}
