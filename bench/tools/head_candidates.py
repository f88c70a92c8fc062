"""How many tokens the greedy head recomputes in float32, over the real target's own greedy steps.

    JSPEC_CACHE=... python -m bench.tools.head_candidates bench/results/suite_cpu.json [--prompts a,b]

`jspec.greedy_head` multiplies a greedy step's hidden state by an int8 copy
of the head, then recomputes in float32 every token whose bound says it
could be the argmax; over `greedy_head.CAPACITY` of them in a call it reads
the whole float32 head instead. For each prompt of a bench results file this
runs the target over the prompt and its recorded target-only tokens, takes
the normed hidden state at each greedy step, and prints the percentiles of
the candidate count (`greedy_head.candidates`), how many steps would fall
back, and whether the float32 head's argmax is the recorded token at every
step (the hidden states are the ones generation saw). The target is loaded
as `jspec.load` prepares it on CPU, which needs jspec's CPU kernels
(docs/decisions.md, "Greedy head").
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jspec
from jspec import cache as cache_lib
from jspec import cpu_kernels
from jspec import greedy_head
from jspec import model
from jspec import modules
from jspec import weights


def hidden_states(target: jspec.Model, params, ids: jax.Array, prompt_len: int) -> jax.Array:
  """[N, D] normed hidden states at the steps that emitted ids[prompt_len:] (N = len - prompt_len).

  Args:
    target: the prepared target (its config and backend).
    params: its params (an argument, so that they are not program constants).
    ids: [L] int32 prompt and generated ids.
    prompt_len: static length of the prompt.

  Returns:
    The hidden states, float32.
  """
  module = model.merge(target.cfg, params)
  # An identity head: the "logits" are the normed hidden states.
  module.head = nnx.data(modules.Linear(weights.Dense(jnp.eye(target.cfg.hidden_size,
                                                            dtype=jnp.float32))))
  n = ids.shape[0] - 1
  cache = cache_lib.init(target.cfg, 1, n, target.backend.dtype)
  x, _ = module(ids[None, :n], cache, backend=target.backend)
  return x[0, prompt_len - 1:]


def main(argv=None) -> None:
  """Prints the candidate counts over a results file's target-only steps.

  Args:
    argv: command-line arguments (see module docstring).
  """
  ap = argparse.ArgumentParser(prog="python -m bench.tools.head_candidates",
                               description=__doc__.splitlines()[0])
  ap.add_argument("results", help="a bench results JSON with target-only token ids")
  ap.add_argument("--prompts", default="", help="comma-separated prompt names (default: all)")
  ap.add_argument("--model", default="qwen2.5-coder-1.5b")
  args = ap.parse_args(argv)
  doc = json.load(open(args.results))
  names = [n for n in (args.prompts.split(",") if args.prompts else doc["prompts"])
           if "target" in doc["prompts"][n]["modes"]]
  if not cpu_kernels.available():
    raise SystemExit(f"the greedy head needs jspec's CPU kernels: "
                     f"{cpu_kernels.unavailable_reason()}")
  target = jspec.load(args.model, progress=False, kernels=True).target
  params = target.params
  head_leaf = model.head_of(model.merge(target.cfg, params))
  if not greedy_head.suits(head_leaf):
    raise SystemExit(f"{args.model}: its head is not float32 kernel panels, so it has no "
                     "greedy head")
  panels = head_leaf.p  # [V/32, D, 32]
  head = params["greedy_head"]
  if head is None:  # only where the settings turned it off
    head = greedy_head.make(panels)
  # Weights travel as arguments: closed over, they would be copied into
  # each program as constants.
  forward = jax.jit(lambda params, ids, p: hidden_states(target, params, ids, p),
                    static_argnums=2)
  count = jax.jit(lambda head, x: jnp.sum(greedy_head.candidates(x, head), axis=-1))
  argmax = jax.jit(lambda panels, x: jnp.argmax(cpu_kernels.matmul(x, panels), axis=-1))
  counts, agree, steps = [], 0, 0
  for name in names:
    entry = doc["prompts"][name]
    out = entry["modes"]["target"]["token_ids"]
    ids = jnp.asarray(entry["prompt_ids"] + out, jnp.int32)
    x = forward(params, ids, len(entry["prompt_ids"]))  # [N, D]
    c = np.asarray(count(head, x))
    counts.append(c)
    same = int(np.sum(np.asarray(argmax(panels, x)) == np.asarray(out)))
    agree += same
    steps += len(out)
    print(f"{name}: {len(out)} steps, candidates max {c.max()}, median {np.median(c):.0f}; "
          f"argmax = recorded token at {same}/{len(out)}", flush=True)
  c = np.concatenate(counts)
  p50, p90, p99 = np.percentile(c, [50, 90, 99])
  over = int(np.sum(c > greedy_head.CAPACITY))
  print(f"all {steps} steps: candidates median {p50:.0f}, 90% {p90:.0f}, 99% {p99:.0f}, "
        f"max {c.max()}; over capacity ({greedy_head.CAPACITY}): {over}; "
        f"argmax = recorded token at {agree}/{steps}")


if __name__ == "__main__":
  main()
