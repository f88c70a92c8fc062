"""Peak RSS of a fresh process by phase: loading the default pair, compiling, one generation.

    python -m bench.tools.load_memory [--max-new-tokens 32] [--runs cold,warm]
                                      [--out /tmp/load_memory.json]

Each run is a new `python` process that loads the default pair
(`jspec.load()`), gets one greedy request's programs ready and generates
`--max-new-tokens` tokens. Every phase of the load (checking the converted
files, reading one, building the params tree, preparing it, writing or
mapping a prepared file) is timed and its own peak RSS taken: the process's
high-water mark (VmHWM) is reset to the current RSS as a phase starts
(`/proc/self/clear_refs`) and read as it ends, so each phase's peak is its
own, not the largest so far. Compile and generation are phases too.

The runs share a scratch cache (`JSPEC_CACHE`) that links to the real
cache's GGUF and converted files (nothing is assembled or converted again)
and starts without prepared files and with an empty compilation cache:

  cold   reads the converted files, prepares both models, writes their
         prepared files, compiles the programs
  warm   a second process: maps the prepared files, loads the programs

A phase's peak over the pair's parameter bytes (as prepared, the greedy head
included, as `python -m bench` counts them) is the figure issue 33 bounds
at 1.3x. docs/decisions-compact.md, "Peak memory of the real pair", cites it.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

_CHILD = r"""
import contextlib, functools, json, sys, threading, time

def status():
  out = {}
  for line in open("/proc/self/status"):
    key, _, value = line.partition(":")
    if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
      out[key] = int(value.split()[0]) * 1024
  return out

def reset_peak():
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")

phases, stack, lock = [], [], threading.RLock()

@contextlib.contextmanager
def phase(name):
  with lock:
    if stack:  # what the enclosing phase reached so far counts for it
      stack[-1]["peak"] = max(stack[-1]["peak"], status()["VmHWM"])
    before = status()
    reset_peak()
    rec = {"phase": name, "depth": len(stack), "rss_before": before["VmRSS"], "peak": 0,
           "t0": time.perf_counter()}
    stack.append(rec)
    phases.append(rec)
  try:
    yield
  finally:
    with lock:
      now = status()
      rec["peak"] = max(rec["peak"], now["VmHWM"])
      rec.update(rss_after=now["VmRSS"], anon_after=now["RssAnon"], file_after=now["RssFile"],
                 seconds=time.perf_counter() - rec.pop("t0"))
      stack.pop()
      if stack:
        stack[-1]["peak"] = max(stack[-1]["peak"], rec["peak"])
      reset_peak()

def wrap(module, attr, label):
  fn = getattr(module, attr)
  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with phase(label(*args, **kwargs) if callable(label) else label):
      return fn(*args, **kwargs)
  setattr(module, attr, wrapped)

def who(path):
  return "target" if "1.5b" in str(path) else "draft" if "0.5b" in str(path) else str(path)

reset_peak()
with phase("import jspec"):
  import jax
  import jspec
  from jspec import api, bundle, loading, model, options, prepared, weights

wrap(loading, "_convert_cached", lambda p, s, dtype, *a, **k: f"check converted {who(p)}")
wrap(loading, "_load_cached", lambda p, s, dtype, *a, **k: f"read converted {who(p)} ({dtype})")
wrap(loading, "_prepared_cached", lambda p, s, dtype, role, *a, **k: f"{role}")
wrap(model, "params_from_tensors", "params tree")
wrap(bundle, "prepare", lambda cfg, params, role="target", *a, **k: f"prepare {role}")
wrap(prepared, "save", "write prepared file")
wrap(prepared, "load", "map prepared file")

with phase("load (jspec.load)"):
  b = jspec.load(progress=False)
  jax.block_until_ready(jax.tree.leaves((b.target.params, b.draft.params)))
param_bytes = {"target": weights.nbytes(b.target.params), "draft": weights.nbytes(b.draft.params)}
prompt = "def quicksort(arr):"
opts = options.make(max_new_tokens=int(sys.argv[1]), stop_at_eos=False)
with phase("compile"):
  req = api.request(b, prompt, opts)
  req.run.program()
with phase("generate"):
  r = jspec.generate(b, prompt, opts)
overall = max(p["peak"] for p in phases)
import hashlib, numpy as np
digest = {}
for role in ("target", "draft"):  # after every phase: hashing touches every page
  h = hashlib.sha256()
  for path, leaf in jax.tree.flatten_with_path(getattr(b, role).params)[0]:
    h.update(jax.tree_util.keystr(path).encode() + np.asarray(leaf).tobytes())
  digest[role] = h.hexdigest()
print(json.dumps({"phases": phases, "param_bytes": param_bytes, "peak": overall,
                  "token_ids": r.token_ids, "params_sha256": digest,
                  "compile_s": r.stats["compile_s"]}))
"""

_PAIR = ("qwen2.5-coder-1.5b-instruct-q4_k_m", "exact"), ("qwen2.5-coder-0.5b-instruct-q4_k_m",
                                                         "float32")


def scratch_cache(real: pathlib.Path, scratch: pathlib.Path) -> None:
  """A cache that links to `real`'s GGUFs, converted files and kernels, copying their stamps.

  A stamp vouches for its file by size, times and inode, which a symbolic
  link keeps (`os.stat` follows it), so nothing is hashed or converted again.
  """
  scratch.mkdir(parents=True, exist_ok=True)
  for stem, dtype in _PAIR:
    for name in (f"{stem}.gguf", f"{stem}.{dtype}.jspec.safetensors", f"{stem}.tokenizer.json"):
      if (real / name).exists() and not (scratch / name).exists():
        (scratch / name).symlink_to(real / name)
    for name in (f"{stem}.gguf.sha256", f"{stem}.{dtype}.jspec.safetensors.stamp"):
      if (real / name).exists():
        shutil.copyfile(real / name, scratch / name)
  if (real / "kernels").is_dir() and not (scratch / "kernels").exists():
    (scratch / "kernels").symlink_to(real / "kernels")


def main(argv=None) -> int:
  """Runs the processes and prints a table per run. Returns 0, or 1 if a process failed."""
  ap = argparse.ArgumentParser(prog="python -m bench.tools.load_memory", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--max-new-tokens", type=int, default=32)
  ap.add_argument("--runs", default="cold,warm",
                  help="comma list; each is a new process on the same scratch cache")
  ap.add_argument("--cache", default=None, help="the real cache (default: $JSPEC_CACHE or "
                  "the user cache, as jspec.fetch finds it)")
  ap.add_argument("--out", default=None, help="JSON of every run (written at the end)")
  opts = ap.parse_args(argv)
  if opts.cache:
    real = pathlib.Path(opts.cache)
  else:
    from jspec import fetch  # pylint: disable=import-outside-toplevel
    real = fetch.cache_dir()
  doc = {"runs": {}}
  with tempfile.TemporaryDirectory(prefix="jspec-load-memory-") as tmp:
    scratch = pathlib.Path(tmp)
    scratch_cache(real, scratch)
    env = {**os.environ, "JSPEC_CACHE": str(scratch)}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    for run in opts.runs.split(","):
      proc = subprocess.run([sys.executable, "-c", _CHILD, str(opts.max_new_tokens)], env=env,
                            capture_output=True, text=True, check=False)
      if proc.returncode != 0:
        print(proc.stderr[-4000:], file=sys.stderr)
        return 1
      res = json.loads(proc.stdout.strip().splitlines()[-1])
      doc["runs"][run] = res
      both = sum(res["param_bytes"].values())
      print(f"\n{run}: parameter bytes target {res['param_bytes']['target'] / 1e9:.3f} GB + "
            f"draft {res['param_bytes']['draft'] / 1e9:.3f} GB = {both / 1e9:.3f} GB; "
            f"peak RSS {res['peak'] / 1e9:.3f} GB = {res['peak'] / both:.2f}x")
      print(f"params sha256 target {res['params_sha256']['target'][:16]} draft "
            f"{res['params_sha256']['draft'][:16]}; tokens {res['token_ids']}")
      print(f"{'phase':<44} {'s':>6} {'peak GB':>8} {'x params':>8} {'RSS after':>9} "
            f"{'anon':>6} {'file':>6}")
      for p in res["phases"]:
        print(f"{'  ' * p['depth'] + p['phase']:<44} {p['seconds']:6.1f} {p['peak'] / 1e9:8.3f} "
              f"{p['peak'] / both:8.2f} {p['rss_after'] / 1e9:9.3f} {p['anon_after'] / 1e9:6.2f} "
              f"{p['file_after'] / 1e9:6.2f}")
  if opts.out:
    from bench import results  # pylint: disable=import-outside-toplevel
    results.write(doc, pathlib.Path(opts.out))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
