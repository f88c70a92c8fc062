"""Decode speed from the mapped prepared files against the same weights copied into owned memory.

    python -m bench.tools.mapped_ab

`jspec.load` maps a known model's prepared file and hands XLA the page-cache
pages themselves (`jspec.prepared`). Those are 4 KB file pages; an owned
copy is anonymous memory. This loads the default pair once, copies every
array into a new buffer, and alternates the two bundles (target-only and
the default; quicksort, 64 tokens, greedy, EOS off; 3 repetitions after a
warm-up of each): decode tokens/s per repetition and medians
(docs/decisions.md, "Fast start").
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import jax
import jax.numpy as jnp
import numpy as np

import jspec


def _owned(m):
  return dataclasses.replace(m, params=jax.tree.map(
      lambda x: jnp.array(np.array(x)) if isinstance(x, jax.Array) else x, m.params))


def main(argv=None) -> int:
  """Runs the A/B and prints one line per bundle and method. Returns 0."""
  argparse.ArgumentParser(prog="python -m bench.tools.mapped_ab", description=__doc__,
                          formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
  mapped = jspec.load(progress=False)
  owned = jspec.Bundle(_owned(mapped.target), _owned(mapped.draft), mapped.tokenizer)
  p = "def quicksort(arr):"
  kw = dict(max_new_tokens=64, stop_at_eos=False)
  bundles = (("mapped", mapped), ("owned", owned))
  for _, b in bundles:
    for m in ("target", "model"):
      jspec.generate(b, p, method=m, **kw)
  res: dict = {}
  for rep in range(3):
    for name, b in bundles if rep % 2 == 0 else bundles[::-1]:
      for m in ("target", "model"):
        s = jspec.generate(b, p, method=m, **kw).stats
        res.setdefault((name, m), []).append((s["new_tokens"] - 1) / s["decode_s"])
  for k, v in sorted(res.items()):
    print(k, "decode tok/s median %.2f" % statistics.median(v), [round(x, 2) for x in v])
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
