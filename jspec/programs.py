"""The compiled programs of a process: each (spec, shapes) is compiled once and kept.

A generation is two programs, `decode.prefill` and `decode.run`. They are
compiled per `decode.Spec.program()` and argument shapes, kept here for the
process, and kept on disk between processes twice over: JAX's persistent
compilation cache holds the executables, and `jspec.program_store` the
traced programs, so a second process neither traces nor compiles.
"""

from __future__ import annotations

import concurrent.futures
import tempfile
import time
from typing import Any, Callable

import jax

from jspec import decode
from jspec import fetch
from jspec import heap
from jspec import program_store


def enable_persistent_cache() -> None:
  """Points JAX's persistent compilation cache at `<jspec cache>/xla` (once).

  A second process then loads the compiled programs instead of compiling
  them again. A cache directory the user configured already is left alone;
  JSPEC_XLA_CACHE=0 turns this off. The cache only saves time, so a
  directory that cannot be created is warned about once and programs are
  compiled without it.
  """
  if not program_store.caching_on() or jax.config.jax_compilation_cache_dir:
    return
  try:
    xla_dir = fetch.cache_dir() / "xla"
    try:
      xla_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
      raise fetch.FetchError(f"cannot create the compilation cache directory {xla_dir} "
                             f"({err.strerror or type(err).__name__})") from None
  except fetch.FetchError as err:
    program_store.warn_once("xla-cache", f"{err}; compiling without a persistent cache")
    return
  jax.config.update("jax_compilation_cache_dir", str(xla_dir))
  # The tiny programs of tests compile in well under a second; cache what matters.
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
  try:
    tempfile.TemporaryFile(dir=xla_dir).close()
  except OSError as err:  # read-only: JAX would warn about every entry it fails to write
    program_store.warn_once("xla-cache", f"the compilation cache directory {xla_dir} is not "
                            f"writable ({err.strerror or type(err).__name__}); reading compiled "
                            "programs from it without adding any")
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))


class Programs:
  """Compiled executables keyed by name, static settings and argument shapes (compile once).

  Attributes:
    compiles: how many programs this process compiled (tests read it).
    stored: how many of those it lowered from `program_store` instead of tracing.
  """

  def __init__(self):
    self.cache: dict[Any, Any] = {}
    self.jitted: list[Any] = []  # the jitted callables behind them, whose caches hold them too
    self.compiles = 0
    self.stored = 0

  def get(self, name: str, fn: Callable, args: tuple, static: dict,
          donate_argnums: tuple[int, ...] = ()) -> tuple[Any, float]:
    """The compiled `fn(*args, **static)`, compiling it on first use.

    Args:
      name: the program's name ("prefill", "run").
      fn: a `jax.jit`-wrapped function.
      args: its positional arguments (arrays or `jax.ShapeDtypeStruct`s).
      static: its static keyword arguments.
      donate_argnums: positions of `args` whose buffers the program may reuse.

    Returns:
      (executable, seconds spent compiling it now: 0 when it was ready).
    """
    shapes = jax.tree.map(lambda x: (x.shape, x.dtype) if hasattr(x, "shape") else x, args)
    key = (name, tuple(sorted(static.items())), str(shapes))
    if key in self.cache:
      return self.cache[key], 0.0
    enable_persistent_cache()
    t0 = time.perf_counter()
    compiled, jitted, stored = program_store.compile_program(name, fn, args, static,
                                                             donate_argnums)
    heap.trim()  # what the compiler freed would otherwise stay resident under the model
    self.cache[key] = compiled
    self.jitted.append(jitted)
    self.compiles += 1
    self.stored += stored
    return self.cache[key], time.perf_counter() - t0

  def get_later(self, name: str, fn: Callable, args: tuple, static: dict,
                donate_argnums: tuple[int, ...] = ()) -> "Pending":
    """`get` in a background thread: the caller runs another program meanwhile.

    A generation's loop program is not needed until its prefill has run, so
    compiling (or loading) it while the prefill runs brings the first token
    forward by the loop's compile time.

    Args:
      name, fn, args, static, donate_argnums: as `get`.

    Returns:
      A `Pending` program: calling it waits for the compile.
    """
    return Pending(_COMPILER.submit(self.get, name, fn, args, static,
                                    donate_argnums=donate_argnums))

  def clear(self) -> None:
    """Drops every compiled program here and in JAX's caches, so that its memory is freed.

    JAX's caches of the jitted functions (trace -> HLO -> executable) keep
    each executable alive as well: emptying `self.cache` alone frees nothing.
    """
    self.cache.clear()
    for jitted in self.jitted + [decode.prefill, decode.run]:
      jitted.clear_cache()
    self.jitted.clear()
    heap.trim()


class Pending:
  """A program being compiled in another thread; a call waits for it, then runs it."""

  def __init__(self, future: concurrent.futures.Future):
    self._future = future

  def program(self) -> Any:
    """The compiled program (waits for it; a failed compile raises here)."""
    return self._future.result()[0]

  def seconds(self) -> float:
    """Seconds its compile took (waits for it): 0 when it was ready."""
    return self._future.result()[1]

  def __call__(self, *args):
    return self.program()(*args)


# One compile at a time in the background: a second would only contend for
# the same cores (and the same cache entries).
_COMPILER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="jspec-compile")
PROGRAMS = Programs()


def release() -> None:
  """Frees every compiled program; a later `generate` compiles again (or loads the persistent cache).

  A process that goes through many settings or prompt-length buckets piles
  up compiled programs (each holds its executable's memory) unless it
  releases the ones it is done with.
  """
  PROGRAMS.clear()
