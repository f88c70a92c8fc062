"""Server throughput: 8 concurrent greedy requests against the same 8 sent one at a time.

    python -m bench.tools.serve_load [--smoke] [--concurrency 8] [--max-tokens 128] [--reps 3]
                                     [--model NAME | --target PATH --draft PATH] [--out F.json]

Starts `jspec serve`'s application in this process on 127.0.0.1 (a free
port), and sends the bench suite's prompts (`bench.prompts.SUITE`, as the
token ids `bench.prompts.encode` gives every engine) to /v1/completions
over HTTP (httpx; tests/test_serve.py covers the `openai` client): greedy,
EOS ignored so that every
request generates exactly --max-tokens tokens, streamed so that the time to
the first token is seen too. First all of them at once (one thread each,
released together), then one after the other; a pass of both, untimed,
compiles every program first. Reported per mode: total tokens/s (all
generated tokens over the pass's wall time), the ratio concurrent over
sequential (issue 37's target: at least 3), per-request latency and
time-to-first-token percentiles, the batches the server formed, and
whether every greedy answer was the same both ways. The JSON and a plot of
the latency distribution (`<out>.latency.png`) are written atomically.
`--smoke` runs tiny random models with a byte-level tokenizer in seconds.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import multiprocessing
import os
import pathlib
import statistics
import tempfile
import threading
import time
from typing import Any, Optional, Sequence

import httpx
import numpy as np

import jspec
from bench import machine
from bench import models
from bench import prompts as prompts_lib
from bench import shapes
from jspec import batching
from jspec import serve
from jspec import tokenizer as tokenizer_lib

TARGET_RATIO = 3.0  # issue 37: concurrent tok/s at least 3x one-at-a-time
NAME = "bench"  # the model id the server answers to
REQUEST_TIMEOUT_S = 600.0  # one request, compile included, on a loaded CPU
SMOKE_CONTROL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_tokenizer(vocab_size: int) -> tokenizer_lib.Tokenizer:
  """A byte-level tokenizer for tiny random models: one id per byte, then control tokens.

  Args:
    vocab_size: the models' vocabulary (at least 256 + 3).

  Returns:
    The tokenizer; ids past the control tokens are spare special tokens.
  """
  printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
               + list(range(ord("®"), ord("ÿ") + 1)))
  extra = iter(range(256, 512))
  tokens = [chr(b) if b in printable else chr(next(extra)) for b in range(256)]  # GPT-2's bytes
  special = list(SMOKE_CONTROL) + [f"<|spare_{i}|>" for i in range(vocab_size - 256 - 3)]
  backend = tokenizer_lib.from_vocab(tokens + special, [], [1] * 256 + [3] * len(special))
  return tokenizer_lib.Tokenizer(backend, [256 + 2, 256], chat_template=CHATML,
                                 eos_token="<|im_end|>")


def _load(args) -> tuple[jspec.Bundle, dict[str, Any]]:
  loaded = models.load(args.model, args.target, args.draft, args.dtype, random_weights=False,
                       smoke=args.smoke)
  bundle = loaded.bundle
  if bundle.tokenizer is None:
    bundle = jspec.Bundle(bundle.target, bundle.draft,
                          byte_tokenizer(shapes.SMOKE_TARGET.vocab_size))
  return bundle, loaded.info


def _one(http, request, start: Optional[threading.Barrier]) -> dict:
  """Sends one prepared streaming request and reads its events; its text, counts and times."""
  if start is not None:
    start.wait(REQUEST_TIMEOUT_S)
  t0 = time.perf_counter()
  first, text, usage = None, [], None
  response = http.send(request, stream=True)
  try:
    response.raise_for_status()
    for line in response.iter_lines():
      if not line.startswith("data: {"):
        continue
      chunk = json.loads(line[len("data: "):])
      if "error" in chunk:
        raise RuntimeError(f"the server failed a request: {chunk['error']['message']}")
      if chunk["choices"] and chunk["choices"][0]["text"]:
        first = first or time.perf_counter()
        text.append(chunk["choices"][0]["text"])
      usage = chunk.get("usage") or usage
  finally:
    response.close()
  t1 = time.perf_counter()
  return {"start": t0, "end": t1, "latency_s": t1 - t0,
          "ttft_s": (first - t0) if first else None, "text": "".join(text),
          "completion_tokens": usage["completion_tokens"], "batch_size": usage["batch_size"],
          "acceptance_rate": usage["acceptance_rate"],
          "tokens_per_round": usage["tokens_per_round"]}


def _pass(url: str, batch: list[list[int]], max_tokens: int, concurrent: bool) -> dict:
  """Sends every prompt, all at once or one after another; the pass's figures.

  The requests are built and each client's connection opened before the
  clock starts, so that the clients' own Python time (one process, one
  interpreter lock) spreads their arrivals as little as it can.
  """
  clients = [httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT_S) for _ in batch]
  try:
    for http in clients:
      http.get("/health").raise_for_status()  # opens the connection it keeps
    requests = [http.build_request("POST", "/v1/completions", json={
        "model": NAME, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True})
                for http, ids in zip(clients, batch)]
    if concurrent:
      start = threading.Barrier(len(batch))
      with concurrent_pool(len(batch)) as pool:
        futures = [pool.submit(_one, http, req, start) for http, req in zip(clients, requests)]
        rows = [f.result(timeout=2 * REQUEST_TIMEOUT_S) for f in futures]
    else:
      rows = [_one(http, req, None) for http, req in zip(clients, requests)]
  finally:
    for http in clients:
      http.close()
  wall = max(r["end"] for r in rows) - min(r["start"] for r in rows)
  tokens = sum(r["completion_tokens"] for r in rows)
  return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "requests": rows}


def concurrent_pool(n: int) -> concurrent.futures.ThreadPoolExecutor:
  """A pool of `n` client threads."""
  return concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix="client")


def _percentiles(values: Sequence[float]) -> dict[str, float]:
  v = np.asarray([x for x in values if x is not None], float)
  if not v.size:
    return {}
  return {"p50": float(np.percentile(v, 50)), "p90": float(np.percentile(v, 90)),
          "p99": float(np.percentile(v, 99)), "max": float(v.max()), "mean": float(v.mean())}


def _write_json(doc: dict, path: pathlib.Path) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
  with os.fdopen(fd, "w") as f:
    json.dump(doc, f, indent=1)
    f.write("\n")
  os.replace(tmp, path)


def plot(doc: dict, path: pathlib.Path) -> pathlib.Path:
  """The per-request latency distribution of both modes (empirical CDFs), written atomically.

  Args:
    doc: this tool's results document.
    path: the PNG to write.

  Returns:
    path.
  """
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
  summary = doc["summary"]
  for mode, color in (("concurrent", "tab:green"), ("sequential", "tab:blue")):
    for ax, key in zip(axes, ("latency_s", "ttft_s")):
      values = sorted(r[key] for rep in doc["reps"] for r in rep[mode]["requests"]
                      if r[key] is not None)
      if values:
        ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post", color=color,
                label=f"{mode}: {summary[mode + '_tokens_per_s']:.1f} tok/s in all")
        ax.plot(values, np.arange(1, len(values) + 1) / len(values), "o", color=color, alpha=0.5)
  s = doc["settings"]
  axes[0].set_title(f"request latency, {s['concurrency']} greedy requests of "
                    f"{s['max_tokens']} tokens")
  axes[1].set_title("time to first token")
  for ax in axes:
    ax.set_xlabel("seconds")
    ax.set_ylabel("fraction of requests")
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
  fig.suptitle(f"jspec serve ({doc['model']['source']}): concurrent / one at a time = "
               f"{summary['ratio']:.2f}x (target {TARGET_RATIO:g}x)", fontsize=10)
  fig.tight_layout()
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".png")
  os.close(fd)
  fig.savefig(tmp, dpi=110)
  plt.close(fig)
  os.replace(tmp, path)
  return path


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Runs the measurement and writes the results.

  Args:
    argv: command-line arguments (see the module docstring).

  Returns:
    0 when every greedy answer was the same both ways, else 1.
  """
  parser = argparse.ArgumentParser(prog="python -m bench.tools.serve_load", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--smoke", action="store_true", help="tiny random models, in seconds")
  parser.add_argument("--model", default="qwen2.5-coder", help="known pair")
  parser.add_argument("--target", help="target checkpoint path (with --draft)")
  parser.add_argument("--draft", help="draft checkpoint path")
  parser.add_argument("--dtype", default=None, choices=("exact", "float32", "bfloat16", "float16"),
                      help="as jspec.load (default: its own, the target exact on CPU)")
  parser.add_argument("--concurrency", type=int, default=8, help="requests (default 8)")
  parser.add_argument("--max-tokens", type=int, default=None,
                      help="tokens per request (default 128; smoke 32)")
  parser.add_argument("--reps", type=int, default=None, help="timed passes (default 3; smoke 1)")
  parser.add_argument("--batch-window-ms", type=float, default=5.0,
                      help="the server's batch window (default 5, as jspec serve)")
  parser.add_argument("--speculate-max-batch", type=int, default=batching.SPECULATE_MAX_BATCH,
                      help="larger batches decode target-only (default: jspec serve's)")
  parser.add_argument("--out", help="results JSON (default bench/results/serve_load_<smoke|cpu>"
                                    ".json); the plot goes beside it")
  args = parser.parse_args(argv)
  max_tokens = args.max_tokens or (32 if args.smoke else 128)
  reps = args.reps or (1 if args.smoke else 3)
  if not 1 <= args.concurrency <= 64 or reps < 1 or max_tokens < 1:
    parser.error("--concurrency must be 1 to 64, --reps and --max-tokens at least 1")
  out = pathlib.Path(args.out or pathlib.Path(__file__).resolve().parents[1] / "results"
                     / f"serve_load_{'smoke' if args.smoke else 'cpu'}.json")
  bundle, info = _load(args)
  chosen = [prompts_lib.SUITE[i % len(prompts_lib.SUITE)] for i in range(args.concurrency)]
  tokenizer = None if args.smoke else bundle.tokenizer
  batch = [prompts_lib.encode(p, tokenizer) for p in chosen]
  server = serve.Server(bundle, NAME, max_batch=max(16, args.concurrency), max_queue=64,
                        batch_window_s=args.batch_window_ms / 1000,
                        speculate_max_batch=args.speculate_max_batch)
  running = serve.Background(server)
  # The clients run in a process of their own, as real clients would: in
  # this one they would compete with the server for the interpreter.
  clients = concurrent.futures.ProcessPoolExecutor(
      1, mp_context=multiprocessing.get_context("spawn"))
  send = lambda together: clients.submit(_pass, running.url, batch, max_tokens,
                                         together).result(timeout=4 * REQUEST_TIMEOUT_S)
  try:
    t0 = time.perf_counter()
    send(True)  # compiles the batch programs
    send(False)  # and the one-row ones
    warmup_s = time.perf_counter() - t0
    print(f"warm-up (compiles) {warmup_s:.1f} s", flush=True)
    results = []
    for rep in range(reps):
      before = dict(server.scheduler.counts)
      together = send(True)
      after = dict(server.scheduler.counts)
      together["batches"] = after.get("batches", 0) - before.get("batches", 0)
      alone = send(False)
      results.append({"concurrent": together, "sequential": alone})
      print(f"rep {rep + 1}/{reps}: concurrent {together['tokens_per_s']:.2f} tok/s "
            f"({together['batches']} batches), one at a time {alone['tokens_per_s']:.2f} tok/s",
            flush=True)
  finally:
    clients.shutdown()
    running.stop()
  identical = all(a["text"] == b["text"] for rep in results
                  for a, b in zip(rep["concurrent"]["requests"], rep["sequential"]["requests"]))
  conc = statistics.median(r["concurrent"]["tokens_per_s"] for r in results)
  seq = statistics.median(r["sequential"]["tokens_per_s"] for r in results)
  pick = lambda mode, key: [q[key] for r in results for q in r[mode]["requests"]]
  summary = {
      "concurrent_tokens_per_s": conc, "sequential_tokens_per_s": seq, "ratio": conc / seq,
      "target_ratio": TARGET_RATIO, "meets_target": conc / seq >= TARGET_RATIO,
      "identical_greedy_text": identical,
      "latency_s": {m: _percentiles(pick(m, "latency_s")) for m in ("concurrent", "sequential")},
      "ttft_s": {m: _percentiles(pick(m, "ttft_s")) for m in ("concurrent", "sequential")},
      "concurrent_batches": [r["concurrent"]["batches"] for r in results],
      "acceptance_rate": {m: _percentiles(pick(m, "acceptance_rate"))
                          for m in ("concurrent", "sequential")},
  }
  doc = {"tool": "bench.tools.serve_load", "command": machine.command(argv),
         "machine": machine.describe(), "git": machine.git(), "model": info,
         "settings": {"concurrency": args.concurrency, "max_tokens": max_tokens, "reps": reps,
                      "batch_window_ms": args.batch_window_ms,
                      "speculate_max_batch": args.speculate_max_batch, "greedy": True, "ignore_eos": True,
                      "prompts": [p.name for p in chosen],
                      "prompt_tokens": [len(ids) for ids in batch],
                      "server_options": dataclasses.asdict(server.base)},
         "warmup_s": warmup_s, "summary": summary,
         "reps": [{m: {**r[m], "requests": [{k: v for k, v in q.items() if k != "text"}
                                            for q in r[m]["requests"]]}
                   for m in ("concurrent", "sequential")} for r in results]}
  _write_json(doc, out)
  png = plot(doc, out.with_suffix(".latency.png"))
  lat = summary["latency_s"]
  print(f"concurrent {conc:.2f} tok/s, one at a time {seq:.2f} tok/s: {conc / seq:.2f}x "
        f"(target {TARGET_RATIO:g}x: {'met' if summary['meets_target'] else 'NOT met'})")
  for mode in ("concurrent", "sequential"):
    print(f"  {mode:10s} latency p50 {lat[mode]['p50']:.3f} s, p90 {lat[mode]['p90']:.3f} s, "
          f"max {lat[mode]['max']:.3f} s; first token p50 {summary['ttft_s'][mode]['p50']:.3f} s")
  print(f"greedy text identical both ways: {identical}")
  print(f"wrote {out} and {png}")
  return 0 if identical else 1


if __name__ == "__main__":
  raise SystemExit(main())
