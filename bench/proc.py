"""Child processes of a run: their environment and the line protocol they answer in.

The HF peers and the bandwidth probe run as children so that their memory
never counts in (or competes with) the jspec process. A child prints its
answers to stdout as lines `BENCH {json}`; anything else it prints (library
warnings, progress) is passed through to the parent's stderr.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from typing import Any, Iterator, Optional, Sequence

PREFIX = "BENCH "
_ROOT = pathlib.Path(__file__).resolve().parents[1]  # the checkout holding bench/ and jspec/


def env(platform: Optional[str] = None) -> dict[str, str]:
  """The environment of a child: this one, with this checkout first on the path.

  Args:
    platform: JAX_PLATFORMS for the child ("cpu", "cuda"), or None to inherit.

  Returns:
    The environment mapping.
  """
  out = os.environ.copy()
  out["PYTHONPATH"] = os.pathsep.join([str(_ROOT)] + [p for p in [out.get("PYTHONPATH")] if p])
  if platform:
    out["JAX_PLATFORMS"] = platform
  return out


def emit(record: dict[str, Any]) -> None:
  """Child side: sends one answer to the parent.

  Args:
    record: a JSON-serialisable dict.
  """
  sys.stdout.write(PREFIX + json.dumps(record) + "\n")
  sys.stdout.flush()


def stream(cmd: Sequence[str], child_env: dict[str, str]) -> Iterator[dict[str, Any]]:
  """Parent side: runs a child and yields its answers as they arrive.

  Args:
    cmd: the command line.
    child_env: its environment (see `env`).

  Yields:
    Each `BENCH {json}` line's dict.

  Raises:
    RuntimeError: the child exited with a non-zero status (after its answers).
  """
  proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, text=True, env=child_env,
                          cwd=str(_ROOT))
  finished = False
  try:
    for line in proc.stdout:
      if line.startswith(PREFIX):
        yield json.loads(line[len(PREFIX):])
      else:
        sys.stderr.write(line)
    finished = True
  finally:
    if not finished and proc.poll() is None:  # the parent stopped early or failed
      proc.kill()
    code = proc.wait()
  if code != 0:
    raise RuntimeError(f"child {' '.join(cmd[:4])} ... exited with status {code}")
