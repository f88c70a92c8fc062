"""`python -m bench`: jspec's decoding modes against HF transformers and llama.cpp, in one run.

Examples:
  python -m bench                                    # full suite, every mode, real pair
  python -m bench --prompts 2 --max-new-tokens 32 --reps 1 --gammas 2,4
  python -m bench --suite humaneval --limit 20 --modes target,spec_g4,heuristic
  python -m bench --resume --out bench/results/suite_cpu.json   # continue a run that died
  python -m bench --smoke                            # tiny random models, seconds
  python -m bench.llamacpp --build-only              # once: builds llama.cpp (minutes),
  python -m bench --prompts 3 --modes target,spec_g4,llamacpp   # then it is a peer
  python -m bench --random-weights --dtype bfloat16 --device gpu \\
      --histograms bench/results/suite_cpu.json       # GPU, no weight files

Exit status: 0; 1 if any jspec mode's greedy ids differ from jspec
target-only's (the correctness gate); 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
from typing import Optional, Sequence

from jspec import options as options_lib


def _ints(text: str) -> list[int]:
  try:
    values = [int(x) for x in text.split(",") if x.strip()]
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None
  if not values or any(v < 1 for v in values):
    raise argparse.ArgumentTypeError(f"{text!r}: expected integers >= 1")
  return values


def _positive(text: str) -> int:
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r}: expected an integer") from None
  if value < 1:
    raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= 1")
  return value


def build_parser(prog: str = "python -m bench") -> argparse.ArgumentParser:
  """The command-line options.

  Args:
    prog: the program name shown in help.

  Returns:
    The parser.
  """
  p = argparse.ArgumentParser(prog=prog, description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  what = p.add_argument_group("what to run")
  what.add_argument("--suite", choices=("suite", "humaneval"), default="suite",
                    help="the fixed prompt suite (bench/prompts.py) or HumanEval's 164 prompts")
  what.add_argument("--limit", type=int, help="keep the first N prompts of the suite")
  what.add_argument("--prompts", help="a count (first N), a slice (4:8), or comma-separated "
                                      "names and kinds (code, edit, chat)")
  what.add_argument("--modes", help="comma-separated modes (target, spec_g<G>, heuristic, "
                                    "confidence, confidence_f32, prompt_lookup, lookup_model, "
                                    "hf_target, hf_assisted, llamacpp_target, llamacpp_spec) or "
                                    "groups (spec, adaptive, lookup, hf, llamacpp, jspec); target "
                                    "is always run")
  what.add_argument("--gammas", type=_ints, help="fixed gammas (default 1,2,...,8)")
  what.add_argument("--adaptive-gamma-max", type=int, default=8,
                    help="static gamma bound of the heuristic policy (default 8)")
  what.add_argument("--confidence-gamma", type=int,
                    default=options_lib.DEFAULT_GAMMA["confidence"],
                    help="the confidence policy's cap (default "
                         f"{options_lib.DEFAULT_GAMMA['confidence']}, the library's)")
  what.add_argument("--lookup-model-gamma-max", type=int, default=16,
                    help="static gamma bound of lookup_model (default 16)")
  what.add_argument("--min-confidence", type=float, default=options_lib.DEFAULT_MIN_CONFIDENCE,
                    help="threshold of the confidence policy (default "
                         f"{options_lib.DEFAULT_MIN_CONFIDENCE}, the library's)")
  what.add_argument("--lookup-gamma", type=int, default=4, help="prompt lookup drafts (default 4)")
  what.add_argument("--ngram", type=int, default=3, help="prompt lookup n-gram (default 3)")
  what.add_argument("--float-draft", action="store_true",
                    help="add a confidence_f32 mode: the confidence policy with a second "
                         "draft loaded with its float weights (the default drafts with int8 "
                         "ones on CPU)")
  what.add_argument("--draft-vocab", type=int, default=None, metavar="K",
                    help="load the draft with its head cut to the K most frequent tokens "
                         "(jspec.Settings(draft_vocab=K); default: the Settings default)")
  what.add_argument("--draft-int4", action=argparse.BooleanOptionalAction, default=None,
                    help="load the draft with 4-bit weights (jspec.Settings(draft_int4=True)), "
                         "or with --no-draft-int4 int8 ones (default: the Settings default, "
                         "4-bit where the CPU has AVX-512 VNNI)")
  what.add_argument("--max-new-tokens", type=int, help="tokens per generation (default 128)")
  what.add_argument("--reps", type=int, help="timed repetitions; figures are medians (default 3)")
  what.add_argument("--stop-at-eos", action="store_true",
                    help="stop at EOS on both sides (default: EOS disabled on both, so every "
                         "generation is --max-new-tokens long)")
  what.add_argument("--no-hf", action="store_true", help="skip the HF transformers peers")
  what.add_argument("--no-llamacpp", action="store_true",
                    help="skip the llama.cpp peers (by default they run on a GGUF pair where "
                         "llama.cpp's tools are already built: python -m bench.llamacpp "
                         "--build-only; a run never builds them)")
  what.add_argument("--llamacpp-draft-max", type=_ints, default=[4, 8],
                    help="llamacpp_spec's drafts per step, --spec-draft-n-max: one or more, "
                         "comma-separated; each prompt runs at each and keeps the fastest "
                         "(default 4,8)")
  what.add_argument("--llamacpp-wait-policy", choices=("fastest", "passive", "active"),
                    default="fastest",
                    help="OMP_WAIT_POLICY of llama.cpp's threads: fastest (default) times both "
                         "with llama-bench first and uses the faster on this host now")
  what.add_argument("--llamacpp-threads", type=_positive, default=2,
                    help="CPU threads of the llama.cpp peers (default 2)")
  what.add_argument("--no-bracket", action="store_true",
                    help="do not time jspec target-only again after the HF peers (by default "
                         "it is, and the ratio to HF target-only uses the mean of both times)")
  what.add_argument("--no-paired-reads", action="store_true",
                    help="no memory bandwidth read just before and after each jspec "
                         "target-only repetition (by default there is, and the roofline "
                         "verdict pairs each repetition with its own reads)")
  models = p.add_argument_group("models")
  models.add_argument("--model", default="qwen2.5-coder", help="known pair (default qwen2.5-coder)")
  models.add_argument("--target", help="target checkpoint path (GGUF, HF dir or jspec file)")
  models.add_argument("--draft", help="draft checkpoint path")
  models.add_argument("--dtype", default=None, choices=("exact", "float32", "bfloat16", "float16"),
                      help="how jspec stores the weights, as `jspec.load` (default: its own: "
                      "the target exact on CPU, float32 elsewhere; random weights and the HF "
                      "peers: float32)")
  models.add_argument("--device", default="auto", choices=("auto", "cpu", "gpu"),
                      help="JAX platform (and the HF peers' device)")
  models.add_argument("--random-weights", action="store_true",
                      help="random weights of the real shapes (no weight files, no network)")
  models.add_argument("--histograms", help="a results JSON of the real pair: derive speculative "
                                           "tokens/s from its accepted-length histograms")
  models.add_argument("--smoke", action="store_true",
                      help="tiny random models, three prompts, 16 tokens: the whole pipeline "
                           "in seconds")
  out = p.add_argument_group("output")
  out.add_argument("--out", help="results JSON (default bench/results/<suite>_<device>.json in "
                                 "this checkout); plots are written beside it")
  out.add_argument("--resume", action="store_true",
                   help="keep the records already in --out and measure only the missing ones")
  out.add_argument("--allow-mismatch", action="store_true",
                   help="finish the run after a greedy mismatch (the exit status is still 1)")
  out.add_argument("--bandwidth-bytes", type=int, help="array size of the bandwidth probe "
                                                       "(default 1 GiB; smoke 64 MiB)")
  return p


def _defaults(opts: argparse.Namespace) -> argparse.Namespace:
  """Fills the defaults that depend on --smoke and --random-weights."""
  smoke = opts.smoke
  if opts.gammas is None:
    opts.gammas = [2] if smoke else list(range(1, 9))
  if opts.max_new_tokens is None:
    opts.max_new_tokens = 16 if smoke else 128
  if opts.reps is None:
    opts.reps = 1 if smoke else 3
  if opts.bandwidth_bytes is None:
    opts.bandwidth_bytes = (64 << 20) if smoke else (1 << 30)
  if smoke:
    opts.adaptive_gamma_max = min(opts.adaptive_gamma_max, max(opts.gammas) + 1)
    opts.confidence_gamma = min(opts.confidence_gamma, max(opts.gammas) + 1)
    opts.lookup_model_gamma_max = min(opts.lookup_model_gamma_max, max(opts.gammas) + 1)
  if opts.random_weights and opts.modes is None:
    # On random weights only round costs mean anything: target, fixed gammas, the HF target.
    opts.modes = "target,spec,hf_target"
  if opts.out is None:
    device = {"auto": "cpu", "cpu": "cpu", "gpu": "gpu"}[opts.device]
    kind = "smoke" if smoke else opts.suite
    suffix = "_random" if opts.random_weights else ""
    opts.out = str(pathlib.Path(__file__).resolve().parent / "results"
                   / f"{kind}_{device}{suffix}.json")
  return opts


def main(argv: Optional[Sequence[str]] = None, prog: str = "python -m bench") -> int:
  """Runs the benchmark.

  Args:
    argv: arguments without the program name (None: sys.argv[1:]).
    prog: the program name shown in help (`jspec bench` passes its own).

  Returns:
    The exit status (0 ok, 1 correctness gate failed, 2 bad arguments).
  """
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = build_parser(prog)
  opts = _defaults(parser.parse_args(argv))
  if opts.target and not opts.draft:
    parser.error("--target needs --draft")
  if opts.reps < 1 or opts.max_new_tokens < 1:
    parser.error("--reps and --max-new-tokens must be >= 1")
  if opts.device != "auto":
    # Before JAX is first imported (below), so that it picks this platform.
    os.environ["JAX_PLATFORMS"] = {"cpu": "cpu", "gpu": "cuda"}[opts.device]
  from bench import runner  # pylint: disable=import-outside-toplevel (imports JAX)
  try:
    return runner.run(opts, argv)
  except runner.UsageError as e:  # unknown prompt or mode names, mismatched --resume settings
    parser.error(str(e))
  return 2


if __name__ == "__main__":
  sys.exit(main())
