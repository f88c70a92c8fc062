"""`python -m convert SRC OUT [--dtype D]`: convert a checkpoint to a jspec file.

`main(argv)` is also what `jspec convert` calls. Expected failures (a bad or
unsupported checkpoint, an unwritable destination) print one line on stderr
and exit with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Optional, Sequence

import convert
from convert import keys
from convert import config as config_lib


def build_parser(prog: str = "python -m convert") -> argparse.ArgumentParser:
  """The argument parser (shared with `jspec convert`).

  Args:
    prog: program name shown in usage.

  Returns:
    The parser.
  """
  parser = argparse.ArgumentParser(
      prog=prog, description="Convert an HF safetensors checkpoint directory or a qwen2 GGUF "
      "file into one jspec safetensors file that loads without conversion.")
  parser.add_argument("src", help="HF checkpoint directory (config.json + safetensors) or .gguf file")
  parser.add_argument("out", help="output file (or an existing directory: OUT/jspec.safetensors)")
  parser.add_argument("--dtype", default=keys.EXACT, choices=[keys.EXACT] + sorted(keys.DTYPES),
                      help="how weights are stored: exact (GGUF quantized matrices as the "
                      "int8 blocks that hold them exactly, bfloat16 as it is; default) or one "
                      "float type for all")
  return parser


def main(argv: Optional[Sequence[str]] = None, prog: str = "python -m convert") -> int:
  """Runs the converter.

  Args:
    argv: arguments without the program name (None: sys.argv[1:]).
    prog: program name for usage and error messages.

  Returns:
    Exit status: 0 on success, 2 on a bad input.
  """
  args = build_parser(prog).parse_args(argv)
  start = time.perf_counter()
  try:
    path = convert.convert_checkpoint(args.src, args.out, args.dtype, progress=True)
  except (keys.ConvertError, config_lib.ConfigError, OSError) as e:
    message = " ".join(str(e).split())  # one line, whatever the message held
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2
  size = path.stat().st_size / 1e9
  print(f"wrote {path} ({size:.2f} GB, {args.dtype}) in {time.perf_counter() - start:.1f} s",
        file=sys.stderr)
  return 0
