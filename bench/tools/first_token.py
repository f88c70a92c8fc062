"""Time to the first token of a new process: the first one, a second one, and new prompt lengths.

    python -m bench.tools.first_token [--reps 2] [--max-new-tokens 16] [--keep-prepared]
                                      [--out bench/results/first_token.json]

Each run is a fresh `python` process that imports jspec, loads the default
pair and streams one greedy prompt (`jspec.stream`); the parent records the
wall time from launching it to the first streamed token, and the child its
phases (import, load, request = programs ready, prefill). All processes
share one new, empty compilation cache (`JAX_COMPILATION_CACHE_DIR`, which
holds jspec's program store too), so:

  first       compiles both programs and, unless --keep-prepared, writes the
              pair's prepared files (`jspec.prepared`) after removing them;
              the converted files stay (the set-up command makes them once)
  second      the same prompt again: everything from the caches
  same-bucket a prompt of another length that pads to the same bucket
  new-bucket  a longer prompt, of a bucket not used before in the run (about 40,
              then 80, ... tokens): another buffer width, so new programs

`second`, `same-bucket` and `new-bucket` run `--reps` times, alternating, and
the table shows medians. The JSON is written atomically after every process.
docs/decisions.md, "Fast start", cites the figures.

    python -m bench.tools.first_token --against REV [--reps 4] [--out F.json]

instead compares this checkout with git revision REV (a temporary worktree)
on the `second` prompt: each side gets a cache of its own (links to the
converted files, its own prepared files and compiled programs, since both
are keyed by the code), one untimed process each to fill it, then `--reps`
processes each, alternating, so that both see the same host.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional

_CHILD = r"""
import json, sys, time
launched = float(sys.argv[1])
t0 = time.perf_counter()
import jspec
from jspec import loading, programs
t1 = time.perf_counter()
bundle = jspec.load("qwen2.5-coder", progress=False)
t2 = time.perf_counter()
gen = jspec.stream(bundle, sys.argv[2], max_new_tokens=int(sys.argv[3]))
piece, ids = next(gen)
first = time.time()
t3 = time.perf_counter()
all_ids = list(ids)
try:
  while True:
    all_ids += next(gen)[1]
except StopIteration as stop:
  stats = stop.value
print(json.dumps({
    "to_first_token_s": first - launched,
    "import_s": t1 - t0, "load_s": t2 - t1, "stream_to_first_s": t3 - t2,
    "compile_s": stats["compile_s"], "prefill_s": stats["prefill_s"],
    "compiles": programs.PROGRAMS.compiles, "stored": programs.PROGRAMS.stored,
    "prompt_tokens": len(bundle.tokenizer.encode(sys.argv[2])), "ids": all_ids}))
"""

PROMPTS = {
    "first": "def quicksort(arr):",
    "second": "def quicksort(arr):",
    "same-bucket": "def merge(a, b):",
    "new-bucket": None,  # cut from _LONG: a new bucket each rep
}
_LONG = ("class LRUCache:\n    \"\"\"A least-recently-used cache of at most `capacity` items, "
         "with get and put in O(1) using a dict and a doubly linked list of nodes; get returns "
         "-1 for a missing key and put evicts the oldest item when full.\"\"\"\n")


def _write(path: pathlib.Path, data: dict) -> None:
  tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
  tmp.write_text(json.dumps(data, indent=1) + "\n")
  os.replace(tmp, path)


def _prepared_files() -> list[pathlib.Path]:
  from jspec import fetch, loading  # pylint: disable=import-outside-toplevel
  target, draft = fetch.PAIRS["qwen2.5-coder"]
  out = []
  for name, role, dtype in ((target, "target", "exact"), (draft, "draft", "float32")):
    gguf = fetch.cache_dir() / fetch.MODELS[fetch.ALIASES.get(name, name)].filename
    out.append(loading.prepared_path(gguf, dtype, role))
  return out


def _child(prompt: str, max_new: int, env: dict, cwd: Optional[pathlib.Path] = None
           ) -> Optional[dict]:
  """One child process to its first token: its phases (and `wall_s`), or None if it failed."""
  launched = time.time()
  proc = subprocess.run([sys.executable, "-c", _CHILD, repr(launched), prompt, str(max_new)],
                        cwd=cwd, env=env, capture_output=True, text=True, check=False)
  wall = time.time() - launched
  if proc.returncode:
    print(proc.stderr[-3000:], file=sys.stderr)
    return None
  return {"wall_s": wall, "loadavg": os.getloadavg()[0],
          **json.loads(proc.stdout.strip().splitlines()[-1])}


def _side_cache(root: pathlib.Path, name: str) -> pathlib.Path:
  """A cache directory that links to the converted files of the real one, and holds nothing else."""
  from jspec import fetch  # pylint: disable=import-outside-toplevel
  cache = root / f"cache-{name}"
  cache.mkdir()
  for path in fetch.cache_dir().iterdir():
    if "prepared" not in path.name and path.name not in ("xla", "llamacpp"):
      (cache / path.name).symlink_to(path)
  return cache


def _against(rev: str, reps: int, max_new: int, out: pathlib.Path) -> int:
  """`--against REV`: this checkout and REV alternated on the `second` prompt (see the docstring)."""
  here = pathlib.Path(__file__).resolve().parents[2]
  runs: list[dict] = []
  result = {"command": f"python -m bench.tools.first_token --against {rev} --reps {reps}",
            "date": time.strftime("%Y-%m-%d %H:%M"), "loadavg_before": os.getloadavg(),
            "runs": runs}
  with tempfile.TemporaryDirectory(prefix="jspec-ab-") as tmp:
    root = pathlib.Path(tmp)
    subprocess.run(["git", "-C", str(here), "worktree", "add", "--detach", "-q",
                    str(root / "tree"), rev], check=True)
    try:
      sides = {"this": (here, _side_cache(root, "this")),
               rev: (root / "tree", _side_cache(root, "rev"))}
      order = list(sides) + [name for i in range(reps)
                             for name in (list(sides) if i % 2 == 0 else list(sides)[::-1])]
      for i, name in enumerate(order):
        tree, cache = sides[name]
        env = {**os.environ, "JSPEC_CACHE": str(cache)}
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
        child = _child(PROMPTS["second"], max_new, env, cwd=tree)
        if child is None:
          return 1
        run = {"side": name, "warm_up": i < len(sides), **child}
        runs.append(run)
        print(f"{name:12s} {'(filling its cache) ' if run['warm_up'] else ''}first token "
              f"{run['to_first_token_s']:6.2f} s  (import {run['import_s']:.2f}, load "
              f"{run['load_s']:.2f}, to the first token after load {run['stream_to_first_s']:.2f}, "
              f"prefill {run['prefill_s']:.2f}; load avg {run['loadavg']:.1f})", flush=True)
        _write(out, result)
    finally:
      subprocess.run(["git", "-C", str(here), "worktree", "remove", "--force", str(root / "tree")],
                     check=False)
  timed = [r for r in runs if not r["warm_up"]]
  result["ids_equal"] = len({tuple(r["ids"]) for r in timed}) == 1
  result["medians"] = {name: {key: statistics.median(r[key] for r in timed if r["side"] == name)
                              for key in ("to_first_token_s", "import_s", "load_s",
                                          "stream_to_first_s", "prefill_s")}
                       for name in sides}
  _write(out, result)
  print(json.dumps(result["medians"], indent=1))
  return 0


def main(argv=None) -> int:
  """Runs the processes and prints a table of medians.

  Args:
    argv: command-line arguments (see module docstring).

  Returns:
    0 on success, 1 if a child failed.
  """
  parser = argparse.ArgumentParser(prog="python -m bench.tools.first_token", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--reps", type=int, default=2)
  parser.add_argument("--max-new-tokens", type=int, default=16)
  parser.add_argument("--keep-prepared", action="store_true",
                      help="keep the prepared files (the first process then only compiles)")
  parser.add_argument("--against", metavar="REV",
                      help="compare this checkout with git revision REV instead")
  parser.add_argument("--out", type=pathlib.Path, default=None,
                      help="the JSON (default bench/results/first_token.json, "
                      "first_token_against.json with --against)")
  args = parser.parse_args(argv)
  if args.reps < 1 or args.max_new_tokens < 1:
    parser.error("--reps and --max-new-tokens must be at least 1")
  if args.against:
    return _against(args.against, args.reps, args.max_new_tokens,
                    args.out or pathlib.Path("bench/results/first_token_against.json"))
  args.out = args.out or pathlib.Path("bench/results/first_token.json")
  if not args.keep_prepared:
    for path in _prepared_files():
      path.unlink(missing_ok=True)
  runs: list[dict] = []
  result = {"command": "python -m bench.tools.first_token " + " ".join(argv or sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d %H:%M"), "loadavg_before": os.getloadavg(),
            "runs": runs}
  with tempfile.TemporaryDirectory(prefix="jspec-xla-") as xla_dir:
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": xla_dir}
    order = ["first"] + ["second", "same-bucket", "new-bucket"] * args.reps
    for i, kind in enumerate(order):
      prompt = PROMPTS[kind]
      if kind == "new-bucket":  # each rep's a bucket not seen before: about 40, 80, ... tokens
        rep = order[:i].count("new-bucket")
        prompt = (_LONG * 8)[:150 * 2 ** rep]
      child = _child(prompt, args.max_new_tokens, env)
      if child is None:
        return 1
      run = {"kind": kind, **child}
      runs.append(run)
      print(f"{kind:12s} first token {run['to_first_token_s']:6.2f} s  (import {run['import_s']:.2f}, "
            f"load {run['load_s']:.2f}, programs {run['compile_s']:.2f}, prefill "
            f"{run['prefill_s']:.2f}; compiled {run['compiles']}, from store {run['stored']}; "
            f"prompt {run['prompt_tokens']} tokens; load avg {run['loadavg']:.1f})", flush=True)
      _write(args.out, result)
  same = {kind: [r["ids"] for r in runs if r["kind"] == kind] for kind in PROMPTS}
  result["ids_repeat"] = {k: all(v == ids[0] for v in ids) for k, ids in same.items()
                          if ids and k != "new-bucket"}
  result["medians"] = {kind: {key: statistics.median(r[key] for r in runs if r["kind"] == kind)
                              for key in ("to_first_token_s", "import_s", "load_s", "compile_s",
                                          "prefill_s")}
                       for kind in PROMPTS}
  _write(args.out, result)
  print(json.dumps(result["medians"], indent=1))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
