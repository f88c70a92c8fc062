"""Hands the heap's free memory back to the system after phases that free much of it.

glibc's malloc keeps freed blocks in the process's heap and arenas, ready for
reuse, so what a phase frees still counts in its resident memory: an XLA
compile (LLVM's working memory) leaves hundreds of MB there, which then sit
under the model's own pages for the rest of the run (docs/decisions-compact.md,
"Peak memory of a first run"). `trim` asks glibc to return it
(`malloc_trim(0)`); where the C library has no such call it does nothing.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any, Optional


@functools.cache
def _malloc_trim() -> Optional[Any]:
  """glibc's malloc_trim, or None where the process's C library has none."""
  try:
    fn = ctypes.CDLL(None).malloc_trim
  except (OSError, AttributeError):
    return None
  fn.argtypes = [ctypes.c_size_t]
  fn.restype = ctypes.c_int
  return fn


def trim() -> bool:
  """Returns the heap's free memory to the system where the C library can.

  Returns:
    Whether any memory was returned (False also where there is no malloc_trim).
  """
  fn = _malloc_trim()
  return bool(fn(0)) if fn is not None else False
