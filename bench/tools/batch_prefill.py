"""`python -m bench.tools.batch_prefill`: a batch's prefill row by row against all rows together.

    python -m bench.tools.batch_prefill [--model target|draft] [--lengths 35,78,...]
                                        [--max-new-tokens 128] [--reps 2] [--out F.json]

Times `decode.encode` of one batch of prompts of the given lengths (random
ids; the default lengths are `serve_load`'s eight suite prompts) on the
default pair's model as `jspec.load` holds it, padded as `api.request`
pads a batch: all rows in every chunk up to the longest prompt (how a batch
was prefilled before), and each row alone as far as its own prompt
(`per_row`, what `decode.prefill` does on one device). The two are
alternated, medians of the repetitions, with the largest logit difference
between them and whether every row's argmax agrees. Then the same for a
batch of equal lengths (every row as long as the mean), where row by row
saves no rows and shows what smaller matmuls cost. The decision it informs
is in docs/decisions.md, "Serving batches".
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import statistics
import sys
import time
from typing import Optional, Sequence

import jax
import numpy as np

import jspec
from jspec import api
from jspec import cache as cache_lib
from jspec import decode
from jspec import model

SERVE_LOAD_LENGTHS = "35,78,157,92,62,112,98,113"  # serve_load's prompts, in tokens


def _time(m, lengths: list[int], max_new: int, reps: int) -> dict:
  """Both ways on one batch of prompts of `lengths`: medians, logit agreement."""
  longest = max(lengths)
  p_width, width = api.widths(longest, max_new, 8)  # as `api.request` pads a batch
  rng = np.random.RandomState(len(lengths) * 1000 + longest)
  prompt = np.zeros((len(lengths), p_width), np.int32)
  for r, n in enumerate(lengths):
    prompt[r, :n] = rng.randint(0, m.cfg.vocab_size, size=n)
  prompt_len = np.asarray(lengths, np.int32)

  def way(per_row):  # params as an argument: a closure would copy them into the program
    return jax.jit(lambda w, p, n: decode.encode(
        functools.partial(model.forward, m.arch, w), cache_lib.init(m.cfg, len(lengths), width),
        p, n, per_row=per_row, head=functools.partial(model.logits, m.arch, w))[0])

  ways = {"together": way(False), "row_by_row": way(True)}
  logits = {name: np.asarray(jax.block_until_ready(fn(m.params, prompt, prompt_len)))
            for name, fn in ways.items()}  # compiles, warms up
  times = {name: [] for name in ways}
  for _ in range(reps):
    for name, fn in ways.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn(m.params, prompt, prompt_len))
      times[name].append(time.perf_counter() - t0)
  medians = {name: statistics.median(t) for name, t in times.items()}
  chunks = {"together": len(lengths) * -(-longest // decode.PREFILL_CHUNK),
            "row_by_row": sum(-(-n // decode.PREFILL_CHUNK) for n in lengths)}
  return {"lengths": lengths, "width": width, "median_s": medians, "times_s": times,
          "row_chunks": chunks,
          "row_by_row_over_together": medians["row_by_row"] / medians["together"],
          "max_abs_logit_diff": float(np.max(np.abs(logits["row_by_row"] - logits["together"]))),
          "same_argmax": bool(np.array_equal(logits["row_by_row"].argmax(-1),
                                             logits["together"].argmax(-1)))}


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Runs both batches and prints a JSON line for each.

  Args:
    argv: arguments without the program name (None: sys.argv[1:]).

  Returns:
    Exit status.
  """
  parser = argparse.ArgumentParser(prog="python -m bench.tools.batch_prefill",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="target", choices=("target", "draft"))
  parser.add_argument("--lengths", default=SERVE_LOAD_LENGTHS,
                      help=f"prompt lengths of the batch (default: {SERVE_LOAD_LENGTHS})")
  parser.add_argument("--max-new-tokens", type=int, default=128,
                      help="sizes the buffer as a request would (default: 128, the server's)")
  parser.add_argument("--reps", type=int, default=2)
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(
      "bench/results/batch_prefill_cpu.json"))
  args = parser.parse_args(argv)
  try:
    lengths = [int(x) for x in args.lengths.split(",")]
  except ValueError:
    parser.error(f"--lengths {args.lengths!r}: expected comma-separated token counts")
  if len(lengths) < 2 or min(lengths) < 1 or args.reps < 1 or args.max_new_tokens < 1:
    parser.error("expected at least two lengths, each >= 1, and --reps and --max-new-tokens >= 1")
  m = getattr(jspec.load(progress=False), args.model)
  mean = round(sum(lengths) / len(lengths))
  result = {"command": "python -m bench.tools.batch_prefill " + " ".join(
      argv if argv is not None else sys.argv[1:]), "model": args.model,
            "date": time.strftime("%Y-%m-%d %H:%M"), "loadavg_before": os.getloadavg(),
            "batches": []}
  for batch in (lengths, [mean] * len(lengths)):
    result["batches"].append(_time(m, batch, args.max_new_tokens, args.reps))
    print(json.dumps(result["batches"][-1]), flush=True)
  tmp = args.out.with_name(f".{args.out.name}.{os.getpid()}.tmp")
  tmp.write_text(json.dumps(result, indent=1) + "\n")
  os.replace(tmp, args.out)
  return 0


if __name__ == "__main__":
  sys.exit(main())
