"""Memory figures: the machine's read bandwidth, peak RSS, and weight bytes read per forward.

Decoding one token reads every weight matrix once, so weight bytes read per
second against the bandwidth measured on the same machine in the same run is
how close a decoder is to its roofline.

The bandwidth runs in a child process (`python -m bench.memory NBYTES`) so its
1 GB test array never counts in the benchmark process's peak RSS.
"""

from __future__ import annotations

import ctypes
import resource
import sys
import time
from typing import Any, Optional

import numpy as np

from bench import proc


def peak_rss_bytes() -> int:
  """Peak resident set size of this process so far.

  Linux's ru_maxrss survives exec: a child started from a 9 GB parent reports
  at least 9 GB. The high-water mark in /proc/self/status (VmHWM) belongs to
  the process's own address space, so it is read first.

  Returns:
    Bytes.
  """
  try:
    for line in open("/proc/self/status", encoding="ascii"):
      if line.startswith("VmHWM:"):
        return int(line.split()[1]) * 1024  # "VmHWM:  123456 kB"
  except (OSError, ValueError, IndexError):
    pass
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
  return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def rss_bytes() -> Optional[int]:
  """Current resident set size of this process, or None without psutil."""
  try:
    import psutil  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  return int(psutil.Process().memory_info().rss)


def release_freed() -> None:
  """Hands memory that Python and XLA have freed back to the OS (glibc keeps it otherwise).

  After the jspec weights are deleted, glibc still holds gigabytes of freed
  heap; trimming it keeps them from sitting beside the HF child's models.
  """
  try:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
  except (OSError, AttributeError):  # not glibc: nothing to do
    pass


def device_peak_bytes() -> Optional[int]:
  """Peak bytes in use on the default JAX device, where the backend reports it (GPUs)."""
  import jax  # pylint: disable=import-outside-toplevel
  try:
    stats = jax.devices()[0].memory_stats() or {}
  except Exception:  # CPU backends may not implement memory_stats
    return None
  peak = stats.get("peak_bytes_in_use")
  return int(peak) if peak is not None else None


def param_bytes(params: Any) -> int:
  """Bytes of every array in a params tree: what the model holds in memory.

  Args:
    params: a jspec params tree (`jspec.Model.params`), its greedy head included.

  Returns:
    The bytes (`jspec.weights.nbytes`).
  """
  from jspec import weights  # pylint: disable=import-outside-toplevel (imports JAX)
  return weights.nbytes(params)


def greedy_head_bytes(params: Any) -> int:
  """Bytes of a target's greedy head (`jspec.greedy_head`), 0 when it has none.

  Args:
    params: a jspec params tree.

  Returns:
    The bytes of `params["greedy_head"]`.
  """
  from jspec import weights  # pylint: disable=import-outside-toplevel
  return weights.nbytes(params.get("greedy_head"))


def head_bytes(cfg: Any, params: Any) -> int:
  """Bytes of a model's output head leaf (`jspec.model.head_of`: the token table when tied).

  Args:
    cfg: the model's config.
    params: its params tree.

  Returns:
    The bytes.
  """
  from jspec import model  # pylint: disable=import-outside-toplevel
  from jspec import weights  # pylint: disable=import-outside-toplevel
  return weights.nbytes(model.head_of(model.merge(cfg, params)))


def forward_bytes(cfg: Any, params: Any) -> int:
  """Weight bytes one forward pass reads: every array once, except an untied table's lookup.

  An untied embedding table is only gathered (one row per token,
  negligible); a tied one is read in full as the output head. The greedy
  head is not read by a forward of the whole head: a greedy one-row step
  reads it instead of the head (`bench.engine.one_row_bytes`). KV-cache
  reads are not counted: at these lengths they are tens of MB against GBs
  of weights.

  Args:
    cfg: the model's config.
    params: its params tree, matrices as typed leaves (`jspec.weights`).

  Returns:
    Bytes.
  """
  from jspec import model  # pylint: disable=import-outside-toplevel
  from jspec import weights  # pylint: disable=import-outside-toplevel
  module = model.merge(cfg, params)
  total = weights.nbytes(params) - greedy_head_bytes(params)
  if module.head is not None:  # untied: the token table is only looked up
    total -= weights.nbytes(module.embed.table.get_value())
  return total


def _measure(nbytes: int, reps: int) -> dict[str, Any]:
  """Best-of-reps read bandwidth over an nbytes float32 array: numpy sum, XLA sum, XLA matvec."""
  out: dict[str, Any] = {"array_bytes": int(nbytes), "reps": reps}
  n = nbytes // 4
  host = np.ones(n, np.float32)
  host.sum()  # touch every page before timing
  best = float("inf")
  for _ in range(reps):
    t0 = time.perf_counter()
    host.sum()
    best = min(best, time.perf_counter() - t0)
  out["numpy_gbs"] = nbytes / best / 1e9
  del host

  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  def best_of(fn, *args):
    fn(*args).block_until_ready()
    best = float("inf")
    for _ in range(reps * 4):  # cheap on a GPU, where one pass is a fraction of a millisecond
      t0 = time.perf_counter()
      fn(*args).block_until_ready()
      best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9

  cols = 4096
  x = jnp.ones((n // cols, cols), jnp.float32)
  out["jax_sum_gbs"] = best_of(jax.jit(jnp.sum), x)
  # A matrix-vector product is what decoding one token does with each weight.
  out["jax_matvec_gbs"] = best_of(jax.jit(lambda w, v: w @ v), x, jnp.ones((cols,), jnp.float32))
  out["jax_backend"] = jax.default_backend()
  # The roofline uses the fastest read the machine showed: the more bandwidth
  # is credited to the machine, the harder the roofline fraction is to reach.
  measured = [out["jax_sum_gbs"], out["jax_matvec_gbs"]]
  if jax.default_backend() == "cpu":
    measured.append(out["numpy_gbs"])  # on a GPU, numpy measures the host instead
  out["gbs"] = max(measured)
  return out


def bandwidth(nbytes: int = 1 << 30, reps: int = 5, platform: Optional[str] = None) -> dict[str, Any]:
  """Measures memory read bandwidth in a child process.

  Args:
    nbytes: size of the array summed (default 1 GiB).
    reps: repetitions; the best one counts.
    platform: JAX_PLATFORMS of the child ("cpu", "cuda"), or None to inherit.

  Returns:
    {"gbs": the best GB/s (1e9 bytes/s) of the methods, "numpy_gbs" (a
    single-threaded numpy sum), "jax_sum_gbs", "jax_matvec_gbs" (an XLA sum
    and matrix-vector product on the default device), "jax_backend",
    "array_bytes", "reps"}, or {"gbs": None, "error": ...} if the child failed.
  """
  cmd = [sys.executable, "-m", "bench.memory", str(int(nbytes)), str(int(reps))]
  try:
    return list(proc.stream(cmd, proc.env(platform)))[-1]
  except (RuntimeError, IndexError, ValueError) as e:
    return {"gbs": None, "error": f"{type(e).__name__}: {e}"}


if __name__ == "__main__":
  proc.emit(_measure(int(sys.argv[1]), int(sys.argv[2])))
