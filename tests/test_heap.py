"""`jspec.heap`: what a compile frees is handed back to the system, not left resident."""

import ctypes

import jax
import jax.numpy as jnp

from jspec import heap
from jspec import programs


def test_trim_returns_whether_it_could():
  assert isinstance(heap.trim(), bool)
  # glibc (the hosts jspec runs on) has malloc_trim; elsewhere trim does nothing.
  try:
    ctypes.CDLL(None).malloc_trim  # pylint: disable=expression-not-assigned
  except AttributeError:
    assert heap.trim() is False
  else:
    assert heap._malloc_trim() is not None  # pylint: disable=protected-access


def test_each_compile_and_each_release_trims(monkeypatch):
  calls = []
  monkeypatch.setattr(heap, "trim", lambda: calls.append(1) or True)
  store = programs.Programs()
  fn = jax.jit(lambda x, scale: x * scale, static_argnames="scale")
  args = (jax.ShapeDtypeStruct((4,), jnp.float32),)
  compiled, seconds = store.get("heap_test", fn, args, {"scale": 2.0})
  assert seconds > 0 and calls == [1]
  assert float(compiled(jnp.ones(4))[0]) == 2.0
  store.get("heap_test", fn, args, {"scale": 2.0})  # ready: nothing compiled, nothing trimmed
  assert calls == [1]
  store.clear()
  assert calls == [1, 1]
