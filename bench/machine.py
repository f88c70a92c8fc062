"""Where and with what a run was made: the machine, library versions, the git commit, the command."""

from __future__ import annotations

import os
import pathlib
import platform
import subprocess
import sys
from typing import Any, Optional

_ROOT = pathlib.Path(__file__).resolve().parents[1]


def _cpu_model() -> Optional[str]:
  try:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("model name"):
        return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or None


def _cpu_flags() -> list[str]:
  try:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("flags"):
        flags = set(line.split(":", 1)[1].split())
        return sorted(f for f in flags if f.startswith(("avx", "amx", "fma")))
  except OSError:
    pass
  return []


def describe() -> dict[str, Any]:
  """The machine and the JAX it runs.

  Returns:
    cpu_count, usable cpus, cpu model and vector flags, memory, OS, Python,
    and JAX's version, backend and devices.
  """
  import jax  # pylint: disable=import-outside-toplevel
  import jaxlib  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  out: dict[str, Any] = {
      "cpu_count": os.cpu_count(),
      "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
      "cpu_model": _cpu_model(),
      "cpu_flags": _cpu_flags(),
      "platform": platform.platform(),
      "python": platform.python_version(),
      "numpy": np.__version__,
      "jax": jax.__version__,
      "jaxlib": jaxlib.__version__,
      "jax_backend": jax.default_backend(),
      "jax_devices": [str(d) for d in jax.devices()],
      "xla_flags": os.environ.get("XLA_FLAGS"),
      "jax_compilation_cache_dir": os.environ.get("JAX_COMPILATION_CACHE_DIR"),
  }
  try:
    import psutil  # pylint: disable=import-outside-toplevel
    out["memory_bytes"] = int(psutil.virtual_memory().total)
    out["memory_available_bytes_at_start"] = int(psutil.virtual_memory().available)
  except ImportError:
    pass
  return out


def _git(*args: str) -> Optional[str]:
  try:
    return subprocess.run(["git", "-C", str(_ROOT), *args], stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True, check=True,
                          timeout=30).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return None


def git() -> dict[str, Any]:
  """The checkout's commit and whether it had uncommitted changes.

  Returns:
    {"commit", "dirty", "changed": up to 20 changed paths}.
  """
  status = _git("status", "--porcelain")
  # "XY path" per line; `_git` strips the output, which takes the first
  # line's leading space (" M path"), so split on whitespace, not at column 3.
  changed = [line.split(maxsplit=1)[-1] for line in (status or "").splitlines()]
  return {"commit": _git("rev-parse", "HEAD"), "dirty": bool(changed), "changed": changed[:20]}


def command(argv: Optional[list[str]]) -> list[str]:
  """The exact command line of the run (argv as given to `main`, or sys.argv)."""
  if argv is None:
    return [sys.executable, "-m", "bench"] + sys.argv[1:]
  return [sys.executable, "-m", "bench"] + list(argv)
