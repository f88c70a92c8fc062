"""What draft distillation costs on this machine: a training step per option, and the data.

    python -m bench.tools.distill_cost --train lora:8,lora:16,last:2,full --batch 4 \\
        --context 64 --gen 64 --steps 4
    python -m bench.tools.distill_cost --data --prompts 16 --gen 64

Training: each option runs in its own child process (so that each peak RSS
is its own), on the real draft's float weights, with random tokens and
labels of the given shapes (a step costs the same whatever the values): the
first step (its compile) and the median of the next ones, and the child's
peak RSS. Data: the pair loaded as `jspec distill` loads it (float draft);
seconds per generated token for the target's greedy output (speculative
decoding, the labels come free), for the draft's samples, and for the
target's label forward over whole sequences. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import importlib
import json
import resource
import statistics
import subprocess
import sys
import time
from typing import Any, Optional


def _options(text: str) -> list[tuple[str, int]]:
  out = []
  for item in text.split(","):
    name, _, arg = item.strip().partition(":")
    if name not in ("lora", "last", "full"):
      raise argparse.ArgumentTypeError(f"{item!r}: expected lora:R, last:N or full")
    out.append((name, int(arg) if arg else 0))
  return out


def _peak_rss() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _one(option: str, arg: int, batch: int, context: int, gen: int, steps: int,
         draft_path: str) -> dict[str, Any]:
  """One option's step cost, in this process."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  import convert  # pylint: disable=import-outside-toplevel
  distill = importlib.import_module("jspec.distill")  # jspec.distill is the function
  from jspec import model  # pylint: disable=import-outside-toplevel

  t0 = time.perf_counter()
  cfg, tensors = convert.load_checkpoint(draft_path)
  params = model.params_from_tensors(cfg, tensors)
  params = jax.tree.map(jnp.asarray, params)
  del tensors
  load_s = time.perf_counter() - t0
  kw = {"lora": {"lora_rank": arg or 16}, "last": {"last_layers": arg or 2}, "full": {}}[option]
  recipe = distill.make_recipe(train=option, batch_size=batch, **kw)
  tx = distill.optimizer(recipe, 100)
  trainable = distill.init_trainable(cfg, params, recipe)
  n_train = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(trainable))
  opt_state = tx.init(trainable)
  step = distill.make_step(cfg, recipe, tx)
  rng = np.random.default_rng(0)
  t = context + gen
  feed = {"tokens": jnp.asarray(rng.integers(0, 150_000, (batch, t)), jnp.int32),
          "at": jnp.asarray(np.tile(np.arange(context - 1, t - 1), (batch, 1)), jnp.int32),
          "mask": jnp.ones((batch, gen), bool),
          "label_ids": jnp.asarray(rng.integers(0, 150_000, (batch, gen, 1)), jnp.int32),
          "label_logp": jnp.zeros((batch, gen, 1), jnp.float32)}
  times = []
  for _ in range(steps + 1):
    s = time.perf_counter()
    trainable, opt_state, metrics = step(trainable, opt_state, params, feed)
    float(metrics["loss"])
    times.append(time.perf_counter() - s)
  per = statistics.median(times[1:])
  return {"option": f"{option}:{arg}" if arg else option, "trained_params": n_train,
          "batch": batch, "tokens_per_row": t, "loss_positions_per_row": gen,
          "first_step_s": times[0], "step_s": per, "step_s_all": times[1:],
          "s_per_loss_token": per / (batch * gen), "s_per_token": per / (batch * t),
          "load_s": load_s, "peak_rss_bytes": _peak_rss()}


def _data(prompts: int, gen: int, batch: int) -> dict[str, Any]:
  """Seconds per generated token of each way to make data, and of the label forward."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  import jspec  # pylint: disable=import-outside-toplevel
  from jspec import distill_data  # pylint: disable=import-outside-toplevel
  distill = importlib.import_module("jspec.distill")  # jspec.distill is the function

  t0 = time.perf_counter()
  bundle = jspec.load("qwen2.5-coder", draft_int8=False, progress=False)
  load_s = time.perf_counter() - t0
  fast = distill.fast_pair(bundle)
  items = distill_data.training_prompts(n_code=prompts // 2, n_chat=prompts - prompts // 2)
  out: dict[str, Any] = {"load_s": load_s, "prompts": len(items), "gen_tokens": gen,
                         "gen_batch": batch}
  recipe = distill.make_recipe(gen_tokens=gen)
  ctx = [distill._encode(bundle, p, recipe.max_context) for p in items]  # pylint: disable=protected-access
  out["context_tokens"] = [len(c) for c in ctx]
  conts = {}
  # (name, bundle, method, rows per call): the calls `jspec.distill` makes (`distill._generate`),
  # timed by the engine's own clocks (prefill + decode), so compiles do not count.
  ways = [("target_speculative_int8_draft", fast, "model", 1),
          ("target_speculative_float_draft", bundle, "model", 1),
          (f"target_only_batch{batch}", bundle, "target", batch),
          (f"draft_sampled_batch{batch}", None, "draft", batch)]
  alone = jspec.Bundle(bundle.draft, None, bundle.tokenizer, bundle.vocab_limit)
  for name, which, method, rows in ways:
    got, run_s, compile_s = [], 0.0, 0.0
    for s in range(0, len(ctx), rows):
      if method == "draft":
        res = jspec.generate(alone, ctx[s:s + rows], method="target", temperature=1.0,
                             max_new_tokens=gen, seed=s)
      else:
        res = jspec.generate(which, ctx[s:s + rows] if rows > 1 else ctx[s], method=method,
                             max_new_tokens=gen)
      res = res if isinstance(res, list) else [res]
      got += [r.token_ids for r in res]
      run_s += res[0].stats["prefill_s"] + res[0].stats["decode_s"]
      compile_s += res[0].stats["compile_s"]
    n = sum(len(r) for r in got)
    conts[name] = got
    out[name] = {"run_s": run_s, "compile_s": compile_s, "tokens": n, "tokens_per_s": n / run_s}
    print(json.dumps({name: out[name]}), file=sys.stderr, flush=True)
  tokens, at, mask = distill._layout(ctx, conts[f"draft_sampled_batch{batch}"], gen)  # pylint: disable=protected-access
  out["label_width"] = int(tokens.shape[1])
  for k, temp in ((1, 0.0), (32, 1.0)):
    lb = 4
    args = dict(k=k, temperature=temp, vocab_limit=bundle.vocab_limit)
    t = time.perf_counter()
    distill._target_labels(bundle.target.arch, bundle.target.params,  # pylint: disable=protected-access
                           jnp.asarray(tokens[:lb]), jnp.asarray(at[:lb]), **args)[0].block_until_ready()
    first = time.perf_counter() - t
    t = time.perf_counter()
    done = 0
    for s in range(0, len(tokens) - lb + 1, lb):
      ids, _ = distill._target_labels(bundle.target.arch, bundle.target.params,  # pylint: disable=protected-access
                                      jnp.asarray(tokens[s:s + lb]), jnp.asarray(at[s:s + lb]),
                                      **args)
      np.asarray(ids)
      done += lb
    dt = time.perf_counter() - t
    out[f"label_k{k}"] = {"first_call_s": first, "s_per_sequence": dt / max(done, 1),
                          "generated_tokens_per_s": int(mask[:done].sum()) / dt}
    print(json.dumps({f"label_k{k}": out[f"label_k{k}"]}), file=sys.stderr, flush=True)
  out["peak_rss_bytes"] = _peak_rss()
  return out


def main(argv: Optional[list[str]] = None) -> int:
  """Runs the measurements and prints one JSON object.

  Args:
    argv: arguments (None: sys.argv[1:]).

  Returns:
    0.
  """
  p = argparse.ArgumentParser(prog="python -m bench.tools.distill_cost", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--train", type=_options, default=None,
                 help="options to time: lora:R, last:N, full (comma-separated)")
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--context", type=int, default=64, help="tokens before the loss positions")
  p.add_argument("--gen", type=int, default=64, help="loss positions per row")
  p.add_argument("--steps", type=int, default=4, help="timed steps after the first")
  p.add_argument("--data", action="store_true", help="time the data phase instead")
  p.add_argument("--prompts", type=int, default=16, help="prompts for --data")
  p.add_argument("--gen-batch", type=int, default=8, help="prompts per generation call (--data)")
  p.add_argument("--one", help=argparse.SUPPRESS)
  p.add_argument("--draft-path", help=argparse.SUPPRESS)
  opts = p.parse_args(argv)
  if opts.one:
    name, _, arg = opts.one.partition(":")
    print(json.dumps(_one(name, int(arg or 0), opts.batch, opts.context, opts.gen, opts.steps,
                          opts.draft_path)))
    return 0
  if opts.data:
    print(json.dumps(_data(opts.prompts, opts.gen, opts.gen_batch), indent=1))
    return 0
  from bench import models  # pylint: disable=import-outside-toplevel
  draft_path = models.checkpoint_files("qwen2.5-coder")[1]
  results = []
  for name, arg in opts.train or _options("lora:8,lora:16,last:2,full"):
    cmd = [sys.executable, "-m", "bench.tools.distill_cost", "--one", f"{name}:{arg}",
           "--batch", str(opts.batch), "--context", str(opts.context), "--gen", str(opts.gen),
           "--steps", str(opts.steps), "--draft-path", draft_path]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
      results.append({"option": f"{name}:{arg}", "error": done.stderr.strip().splitlines()[-1:]})
    else:
      results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(json.dumps(results[-1]), file=sys.stderr, flush=True)
  print(json.dumps({"batch": opts.batch, "context": opts.context, "gen": opts.gen,
                    "results": results}, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
