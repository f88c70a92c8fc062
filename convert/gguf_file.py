"""Reads a llama.cpp GGUF file (arch qwen2): metadata -> config, tensors -> float arrays.

(Named gguf_file, not gguf, so that it does not shadow the `gguf` package.)

`gguf.GGUFReader` maps the file and parses the header; tensor data stays on disk
until `read` dequantizes it with `gguf.quants.dequantize` (numpy; F32, F16,
BF16, Q8_0, Q5_0, Q4_K, Q6_K and the other types the package knows). A
quantized tensor is dequantized a block of rows at a time into one float32
array, because the dequantizers' temporaries are several times the size of
their output: a whole [151936, 1536] Q4_K embedding at once would need
gigabytes more.

The numpy view the reader gives of a tensor is [rows, ...] with the GGUF
shape reversed (GGUF lists the fastest axis first), so a 2-D weight comes out
[out, in], exactly the HF orientation, and tensor names go through
`keys.gguf_to_hf_name` to be checked by the HF key table.
"""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np

from convert import config as config_lib
from convert import gguf_blocks
from convert import keys

MAGIC = b"GGUF"
# Rows dequantized at once: bounds the dequantizers' temporaries to a few
# hundred MB even for the widest rows.
_ROWS_PER_CHUNK = 8192


def is_gguf_file(path: pathlib.Path) -> bool:
  """Whether a file starts with the GGUF magic.

  Args:
    path: any path.

  Returns:
    True for a file whose first four bytes are b"GGUF".
  """
  if not path.is_file():
    return False
  with open(path, "rb") as f:
    return f.read(4) == MAGIC


def package(path):
  """The gguf package, imported on first use so that `import jspec` never pays for it.

  Only reading a GGUF file needs it: jspec files and random weights do not,
  and a GPU machine with no network may lack it.

  Args:
    path: the file being read, for the error message.

  Returns:
    The `gguf` module (with `gguf.quants` imported).

  Raises:
    ConvertError: the package is not installed.
  """
  try:
    import gguf  # pylint: disable=import-outside-toplevel
    import gguf.quants  # pylint: disable=import-outside-toplevel,unused-import
  except ImportError:
    raise keys.ConvertError(f"{path}: reading a GGUF file needs the gguf package, which is not "
                            "installed (pip install gguf)") from None
  return gguf


def open_reader(path) -> gguf.GGUFReader:
  """Opens a GGUF file, turning every parse failure into a ConvertError.

  Args:
    path: the .gguf file.

  Returns:
    The reader (maps the file; reads tensor data lazily).
  """
  path = pathlib.Path(path)
  if not path.is_file():
    raise keys.ConvertError(f"{path}: no such file")
  with open(path, "rb") as f:
    magic = f.read(4)
  if magic != MAGIC:
    raise keys.ConvertError(f"{path}: not a GGUF file (starts with {magic!r}, expected {MAGIC!r})")
  gguf = package(path)
  try:
    return gguf.GGUFReader(path)
  except Exception as e:  # the reader fails with whatever numpy or struct raised
    raise keys.ConvertError(f"{path}: truncated or corrupted GGUF file; the reader failed with "
                            f"{type(e).__name__}: {e}") from None


def metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
  """The scalar and string metadata of a GGUF file as plain Python values.

  Arrays (the tokenizer's vocabulary and merges) are left out; see
  `jspec.tokenizer` for those.

  Args:
    reader: an open reader.

  Returns:
    key -> int, float, bool or str.
  """
  import gguf  # pylint: disable=import-outside-toplevel  (installed: the reader exists)
  out = {}
  for name, field in reader.fields.items():
    if field.types and field.types[0] == gguf.GGUFValueType.ARRAY:
      continue
    out[name] = field.contents()
  return out


class Source:
  """A GGUF file, opened: its config and its tensors under HF names.

  Attributes:
    config: the Qwen2Config from the qwen2.* metadata.
    names: HF tensor names in file order.
    path: the file.
  """

  def __init__(self, path):
    """Args:
      path: a qwen2 GGUF file.
    """
    self.path = pathlib.Path(path)
    self._reader = open_reader(self.path)
    self._tensors = {}  # HF name -> ReaderTensor
    for t in self._reader.tensors:
      try:
        hf_name = keys.gguf_to_hf_name(t.name)
      except keys.ConvertError as e:
        raise keys.ConvertError(f"{self.path}: {e}") from None
      if hf_name in self._tensors:
        raise keys.ConvertError(f"{self.path}: tensor {t.name!r} appears twice")
      self._tensors[hf_name] = t
    self.names = list(self._tensors)
    embed = self._tensors.get("model.embed_tokens.weight")
    if embed is None:
      raise keys.ConvertError(f"{self.path}: no token_embd.weight tensor (needed for the vocab size)")
    self.config = config_lib.from_gguf_metadata(
        metadata(self._reader),
        vocab_size=int(embed.shape[-1]),  # GGUF shape [D, V], fastest axis first
        tie_word_embeddings="lm_head.weight" not in self._tensors,
        source=str(self.path))

  def label(self, name: str) -> str:
    """The GGUF name of a tensor, for messages.

    Args:
      name: an HF tensor name from `names`.

    Returns:
      Its name in the file, e.g. "blk.0.attn_q.weight".
    """
    return self._tensors[name].name

  def form(self, name: str, exact: bool = False):
    """What `read` returns for a tensor, known without reading its data.

    Args:
      name: an HF tensor name from `names`.
      exact: as for `read`.

    Returns:
      A `gguf_blocks.Form` where `read` returns int8 blocks, else the dtype
      of the array it returns.
    """
    t = self._tensors[name]
    if exact and len(t.shape) == 2 and t.tensor_type.name in gguf_blocks.EXACT_TYPES:
      return gguf_blocks.form(t.tensor_type)
    if exact and t.tensor_type.name == "BF16":
      return keys.DTYPES["bfloat16"]
    return keys.DTYPES["float32"]

  def read(self, name: str, exact: bool = False):
    """Dequantizes one tensor, or with `exact` keeps a quantized matrix's own numbers.

    Args:
      name: an HF tensor name from `names`.
      exact: return a quantized matrix whose values int8 blocks hold exactly
        as `gguf_blocks.Blocks` and a BF16 one as bfloat16 (`keys.EXACT`).

    Returns:
      float32 array in HF orientation ([out, in] for weights), or with
      `exact` a `gguf_blocks.Blocks` or a bfloat16 array where those hold it.
    """
    t = self._tensors[name]
    shape = tuple(int(d) for d in reversed(t.shape))
    if exact and len(shape) == 2 and t.tensor_type.name in gguf_blocks.EXACT_TYPES:
      try:
        blocks = gguf_blocks.from_tensor(t)
      except gguf_blocks.InexactError:
        blocks = None
      except Exception as e:  # data cut short
        raise keys.ConvertError(f"{self.path}: cannot read tensor {t.name!r} "
                                f"({t.tensor_type.name}, shape {shape}) as int8 blocks: "
                                f"{type(e).__name__}: {e}") from None
      if blocks is not None:
        if blocks.shape != shape:
          raise keys.ConvertError(f"{self.path}: tensor {t.name!r} has blocks of shape "
                                  f"{blocks.shape}, expected {shape}")
        return blocks
    if exact and t.tensor_type.name == "BF16":
      return np.asarray(t.data).view(keys.DTYPES["bfloat16"]).reshape(shape)
    quants = package(self.path).quants
    try:
      data = t.data
      if data.ndim < 2:
        out = quants.dequantize(data, t.tensor_type).astype(np.float32, copy=False)
      else:
        out = np.empty(shape, np.float32)
        for start in range(0, data.shape[0], _ROWS_PER_CHUNK):
          out[start:start + _ROWS_PER_CHUNK] = quants.dequantize(
              data[start:start + _ROWS_PER_CHUNK], t.tensor_type)
    except Exception as e:  # unsupported quant type, or data cut short
      raise keys.ConvertError(f"{self.path}: cannot dequantize tensor {t.name!r} "
                              f"({t.tensor_type.name}, shape {shape}): {type(e).__name__}: {e}") \
          from None
    if out.shape != shape:
      raise keys.ConvertError(f"{self.path}: tensor {t.name!r} dequantized to shape {out.shape}, "
                              f"expected {shape}")
    return out

  def close(self) -> None:
    """Releases the memory map."""
    self._tensors.clear()
    self._reader = None
