"""Compile time of the speculative program: a cold process, then a second one with the cache.

    python -m bench.tools.compile_time [--gamma 4] [--policy fixed] [--method model]

Runs two fresh processes one after the other, both with JAX's persistent
compilation cache pointed at the same new empty directory. The first traces
and compiles the prefill and decode-loop programs from nothing; the second
finds them in the cache (the lowered programs in `jspec.program_store`, the
executables in XLA's cache). Each reports `compile_s` from `jspec.generate`
(model loading is timed apart and excluded). docs/decisions.md, "Program
store", cites the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from jspec import options

_CHILD = """
import json, sys, time
import jspec
t0 = time.perf_counter()
bundle = jspec.load("qwen2.5-coder", progress=False)
load_s = time.perf_counter() - t0
out = jspec.generate(bundle, "def quicksort(arr):", max_new_tokens=16, **json.loads(sys.argv[1]))
print(json.dumps({"load_s": load_s, "compile_s": out.stats["compile_s"]}))
"""


def main(argv=None) -> int:
  """Runs the cold and warm processes and prints both compile times as JSON.

  Args:
    argv: command-line arguments (see module docstring).

  Returns:
    0 on success, 1 if a child process failed.
  """
  parser = argparse.ArgumentParser(prog="python -m bench.tools.compile_time",
                                   description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--gamma", type=int, default=4)
  parser.add_argument("--policy", default="fixed", choices=options.POLICIES,
                      help="jspec.generate's policy (default fixed)")
  parser.add_argument("--method", default="model", choices=options.METHODS,
                      help="jspec.generate's method (default model)")
  args = parser.parse_args(argv)
  try:
    options.Options(gamma=args.gamma, policy=args.policy, method=args.method)
  except ValueError as e:
    parser.error(str(e))
  kwargs = json.dumps({"gamma": args.gamma, "policy": args.policy, "method": args.method})
  results = {}
  with tempfile.TemporaryDirectory(prefix="jspec-xla-") as xla_dir:
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": xla_dir}
    for run in ("cold", "warm"):
      proc = subprocess.run([sys.executable, "-c", _CHILD, kwargs], env=env,
                            capture_output=True, text=True, check=False)
      if proc.returncode:
        print(proc.stderr[-2000:], file=sys.stderr)
        return 1
      results[run] = json.loads(proc.stdout.strip().splitlines()[-1])
      print(f"{run}: compile {results[run]['compile_s']:.1f} s "
            f"(model load {results[run]['load_s']:.1f} s, not included)", flush=True)
  print(json.dumps({"gamma": args.gamma, "policy": args.policy, "method": args.method,
                    **results}))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
