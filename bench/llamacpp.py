"""llama.cpp as a peer: its own tools, built from source, on the same GGUF files and prompts.

llama.cpp is not packaged for this machine, but the source distribution of
`llama-cpp-python` on PyPI carries it under `vendor/llama.cpp`. `build`
downloads that sdist (pinned by version and sha256), compiles the command-line
tools once into jspec's cache, and `generate` runs them greedy on a prompt:
`llama-completion` for the target alone, `llama-speculative-simple` with a
draft model for speculative decoding.

Fair terms, as far as llama.cpp's tools allow:
  - the raw prompt text exactly as given (read from a file byte for byte, no
    escape processing, no chat template, no conversation mode), tokenized by
    llama.cpp itself with the GGUF's own BOS rule;
  - greedy (`--temp 0 --top-k 1`), stopping at EOS like jspec (no --ignore-eos);
  - llama.cpp's own timings are recorded as it prints them, beside the wall
    time of the whole process (model load included).

`python -m bench.llamacpp --prompts N --max-new-tokens M --out FILE.json`
runs both modes on the first N prompts of jspec's suite with the real pair;
`python -m bench.llamacpp --build-only` only builds the tools, after which
`python -m bench` runs llama.cpp as a peer in its own runs (it never builds).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import pathlib
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from typing import Any, Optional, Sequence

VERSION = "0.3.36"  # llama-cpp-python, whose sdist vendors llama.cpp
SDIST_NAME = f"llama_cpp_python-{VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
_VENDOR_PREFIX = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"

# Binary name -> attribute of Tools.
TARGETS = {
    "llama-completion": "completion",
    "llama-speculative-simple": "speculative_simple",
    "llama-speculative": "speculative",
    "llama-bench": "bench",
    "llama-tokenize": "tokenize",
}

# Static binaries (BUILD_SHARED_LIBS=OFF) can be moved out of the build tree;
# no OpenSSL, server, web UI or tests: nothing here downloads or serves.
# (LLAMA_CURL is deprecated in this version: setting it only prints a warning.)
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DGGML_CUDA=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
)
# On a CPU with AMX, GGML_NATIVE compiles ggml's AMX matmul, which crashed
# (SIGSEGV at ldtilecfg in ggml_backend_amx_mul_mat, llama.cpp issue 20824)
# on the first decode of the Q4_K_M pair here; without it ggml uses its
# AVX-512 kernels and its CPU weight repacking.
_NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def cmake_options(flags: Optional[str] = None) -> tuple[str, ...]:
  """The cmake options of a build on a CPU with these flags, AMX left out where it would be compiled in.

  Args:
    flags: CPU flags (default: `cpu_flags()` of this host).

  Returns:
    The options, CMAKE_OPTIONS first.
  """
  flags = cpu_flags() if flags is None else flags
  if "amx_tile" not in flags.split():
    return CMAKE_OPTIONS
  return CMAKE_OPTIONS + (f"-DCMAKE_C_FLAGS={_NO_AMX}", f"-DCMAKE_CXX_FLAGS={_NO_AMX}")


_MANIFEST = "build.json"
_DOWNLOAD_TIMEOUT_S = 900
_BUILD_TIMEOUT_S = 4 * 3600


class LlamaCppError(RuntimeError):
  """llama.cpp can not be built, or one of its tools failed."""


@dataclasses.dataclass(frozen=True)
class Tools:
  """The built llama.cpp binaries.

  Attributes:
    root: the directory holding them and build.json.
    completion: llama-completion (target alone).
    speculative_simple: llama-speculative-simple (target with a draft model).
    speculative: llama-speculative (tree speculation, kept for manual runs).
    bench: llama-bench.
    tokenize: llama-tokenize.
    version: the llama-cpp-python version whose vendored llama.cpp was built.
  """

  root: pathlib.Path
  completion: pathlib.Path
  speculative_simple: pathlib.Path
  speculative: pathlib.Path
  bench: pathlib.Path
  tokenize: pathlib.Path
  version: str = VERSION


def cpu_flags() -> str:
  """The host's CPU feature flags, because GGML_NATIVE=ON binaries only run where they were built.

  Returns:
    The sorted flags of /proc/cpuinfo joined by spaces, or the machine and
    processor names where /proc/cpuinfo has none.
  """
  try:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith(("flags", "Features")):
        return " ".join(sorted(set(line.split(":", 1)[1].split())))
  except OSError:
    pass
  return f"{platform.machine()} {platform.processor()}"


# llama.cpp's logger writes from a thread that exit does not wait for (it leaks
# the logger on purpose, llama.cpp issue 22142), so a busy host loses a run's
# last lines, its text and timings among them. The build pauses the logger at
# exit, which drains its queue and joins the thread.
_LOG_FILE = "common/log.cpp"
_LOG_ANCHOR = ("        log = new common_log;\n"
               "        // Set default to auto-detect colors\n"
               "        log->set_colors(tty_can_use_colors());\n")
_LOG_PATCH = "        std::atexit([]() { common_log_pause(log); });  // jspec: flush at exit\n"


def patch_source(source: pathlib.Path) -> None:
  """Makes the tools flush their log at exit (see `_LOG_PATCH`).

  Args:
    source: the extracted llama.cpp source tree.

  Raises:
    LlamaCppError: the logger's code is not the one the patch was written
      for (the anchor is missing or appears more than once).
  """
  path = source / _LOG_FILE
  text = path.read_text(encoding="utf-8")
  if text.count(_LOG_ANCHOR) != 1:
    raise LlamaCppError(f"{_LOG_FILE} has {text.count(_LOG_ANCHOR)} copies of the logger set-up line"
                        f" the exit flush is inserted after, expected exactly 1")
  text = text.replace(_LOG_ANCHOR, _LOG_ANCHOR + _LOG_PATCH)
  text = "#include <cstdlib>\n" + text
  tmp = path.with_suffix(".jspec-tmp")
  tmp.write_text(text, encoding="utf-8")
  os.replace(tmp, path)


def build_key(flags: Optional[str] = None) -> str:
  """Names one build, so that another version, CPU or set of options never reuses it.

  Args:
    flags: CPU flags (default: `cpu_flags()` of this host).

  Returns:
    "<version>-<machine>-<12 hex digits of a hash of the flags, options, targets
    and source patch>".
  """
  flags = cpu_flags() if flags is None else flags
  digest = hashlib.sha256("\n".join([flags, *cmake_options(flags), *sorted(TARGETS),
                                     _LOG_PATCH]).encode())
  return f"{VERSION}-{platform.machine()}-{digest.hexdigest()[:12]}"


def _tools_in(root: pathlib.Path) -> Optional[Tools]:
  """The tools in a finished build directory, or None if it is missing or incomplete."""
  if not (root / _MANIFEST).is_file():
    return None
  paths = {attr: root / name for name, attr in TARGETS.items()}
  if not all(p.is_file() and os.access(p, os.X_OK) for p in paths.values()):
    return None
  return Tools(root=root, **paths)


def _default_root() -> pathlib.Path:
  from jspec import fetch  # pylint: disable=import-outside-toplevel (keeps the CLI's --help light)
  return fetch.cache_dir() / "llamacpp"


def _require_build_tools() -> dict[str, str]:
  """Finds cmake, a build tool and C/C++ compilers, naming every one that is missing."""
  found = {
      "cmake": shutil.which("cmake"),
      "C compiler": next(filter(None, map(shutil.which, ("cc", "gcc", "clang"))), None),
      "C++ compiler": next(filter(None, map(shutil.which, ("c++", "g++", "clang++"))), None),
      "ninja or make": shutil.which("ninja") or shutil.which("make"),
  }
  missing = [name for name, path in found.items() if path is None]
  if missing:
    raise LlamaCppError(f"cannot build llama.cpp: no {', no '.join(missing)} on PATH"
                        " (on Debian: apt-get install cmake build-essential)")
  return found


def _run_step(what: str, cmd: Sequence[str], log: pathlib.Path, progress: bool,
              timeout: float, cwd: Optional[pathlib.Path] = None) -> None:
  """Runs one build step, its output appended to `log` (and shown with progress)."""
  with open(log, "a", encoding="utf-8") as out:
    out.write(f"$ {' '.join(cmd)}\n")
    out.flush()
    try:
      if progress:
        print(f"llamacpp: {what}: {' '.join(cmd)}", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, cwd=cwd, timeout=timeout, check=False,
                              stdout=sys.stderr, stderr=sys.stderr)
      else:
        proc = subprocess.run(cmd, cwd=cwd, timeout=timeout, check=False,
                              stdout=out, stderr=subprocess.STDOUT)
    except FileNotFoundError as e:
      raise LlamaCppError(f"{what} failed: {cmd[0]} not found") from e
    except subprocess.TimeoutExpired as e:
      raise LlamaCppError(f"{what} timed out after {timeout:.0f} s") from e
  if proc.returncode != 0:
    tail = "" if progress else " | ".join(log.read_text(errors="replace").splitlines()[-15:])
    raise LlamaCppError(f"{what} failed (exit {proc.returncode}): {tail}")


def _download_sdist(directory: pathlib.Path, log: pathlib.Path, progress: bool) -> pathlib.Path:
  """Fetches the pinned sdist with pip and checks its sha256."""
  _run_step(f"pip download of llama-cpp-python=={VERSION}",
            [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
             f"llama-cpp-python=={VERSION}", "-d", str(directory)],
            log, progress, _DOWNLOAD_TIMEOUT_S)
  sdist = directory / SDIST_NAME
  if not sdist.is_file():
    raise LlamaCppError(f"pip download of llama-cpp-python=={VERSION} left no {SDIST_NAME}"
                        f" in {directory}")
  digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
  if digest != SDIST_SHA256:
    raise LlamaCppError(f"{SDIST_NAME} has sha256 {digest}, expected {SDIST_SHA256}")
  return sdist


def _extract_vendor(sdist: pathlib.Path, directory: pathlib.Path) -> pathlib.Path:
  """Extracts only vendor/llama.cpp from the sdist, refusing unsafe members."""
  try:
    with tarfile.open(sdist, "r:gz") as tar:
      members = [m for m in tar.getmembers() if m.name.startswith(_VENDOR_PREFIX)]
      if not members:
        raise LlamaCppError(f"{sdist.name} holds no {_VENDOR_PREFIX}")
      tar.extractall(directory, members=members, filter="data")
  except (tarfile.TarError, OSError) as e:
    raise LlamaCppError(f"cannot extract {_VENDOR_PREFIX} from {sdist.name}: {e}") from e
  return directory / _VENDOR_PREFIX


def _compile(source: pathlib.Path, build_dir: pathlib.Path, log: pathlib.Path, progress: bool,
             jobs: int, found: dict[str, str]) -> pathlib.Path:
  """Configures and builds the targets; returns the directory holding the binaries."""
  generator = ["-G", "Ninja"] if found["ninja or make"].endswith("ninja") else []
  _run_step("cmake configure", [found["cmake"], "-S", str(source), "-B", str(build_dir),
                                *generator, *cmake_options()], log, progress, _BUILD_TIMEOUT_S)
  _run_step("cmake build", [found["cmake"], "--build", str(build_dir), "--config", "Release",
                            "-j", str(jobs), "--target", *TARGETS], log, progress,
            _BUILD_TIMEOUT_S)
  return build_dir / "bin"


def build(cache_dir: Optional[os.PathLike] = None, progress: bool = False,
          jobs: Optional[int] = None) -> Tools:
  """Builds llama.cpp's tools once per version and CPU, so that every run compares against the same binaries.

  The tools are built in a temporary directory and renamed into
  `<cache_dir>/<build_key()>` only when complete, under a file lock, so a
  killed build never leaves something that looks finished.

  Args:
    cache_dir: where builds live (default: `<jspec cache>/llamacpp`).
    progress: stream pip's and cmake's output to stderr.
    jobs: parallel compile jobs (default: the number of CPUs).

  Returns:
    The `Tools`.

  Raises:
    LlamaCppError: no cmake or compiler, the download was refused or does
      not verify, or the build failed (with the tail of its log).
  """
  from jspec import fetch  # pylint: disable=import-outside-toplevel (keeps the CLI's --help light)
  root = pathlib.Path(cache_dir) if cache_dir is not None else _default_root()
  final = root / build_key()
  tools = _tools_in(final)
  if tools is not None:
    return tools
  root.mkdir(parents=True, exist_ok=True)
  with fetch.FileLock(final):
    tools = _tools_in(final)  # another process may have just finished it
    if tools is not None:
      return tools
    found = _require_build_tools()
    if final.exists():  # incomplete: never produced by the rename below, but be safe
      shutil.rmtree(final)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(dir=root, prefix=".work-") as work:
      work = pathlib.Path(work)
      log = work / "build.log"
      sdist = _download_sdist(work / "sdist", log, progress)
      source = _extract_vendor(sdist, work / "src")
      patch_source(source)
      bin_dir = _compile(source, work / "build", log, progress, jobs or os.cpu_count() or 1, found)
      staging = pathlib.Path(tempfile.mkdtemp(dir=root, prefix=f".{final.name}.", suffix=".partial"))
      try:
        for name in TARGETS:
          if not (bin_dir / name).is_file():
            raise LlamaCppError(f"cmake build produced no {name} in {bin_dir}")
          shutil.copy2(bin_dir / name, staging / name)
        manifest = {"version": VERSION, "key": final.name, "sdist_sha256": SDIST_SHA256,
                    "cmake_options": list(cmake_options()), "targets": list(TARGETS),
                    "build_seconds": round(time.monotonic() - start, 1),
                    "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "tools": found}
        (staging / _MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        os.chmod(staging, 0o755)
        os.replace(staging, final)
      except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
  tools = _tools_in(final)
  if tools is None:
    raise LlamaCppError(f"llama.cpp build in {final} is incomplete after renaming")
  return tools


# --- parsing what the tools print -------------------------------------------------------------

_NUM = r"(-?(?:\d+(?:\.\d*)?|inf|nan))"  # printf's %f of a 0/0 or x/0 prints nan or inf
_PERF_PATTERNS = {
    "load": re.compile(r"load time\s*=\s*" + _NUM + r" ms\s*$", re.M),
    "prompt_eval": re.compile(r"prompt eval time\s*=\s*" + _NUM + r" ms /\s*(\d+) tokens \(\s*"
                              + _NUM + r" ms per token,\s*" + _NUM + r" tokens per second\)"),
    "eval": re.compile(r"(?<!prompt )eval time\s*=\s*" + _NUM + r" ms /\s*(\d+) runs\s*\(\s*"
                       + _NUM + r" ms per token,\s*" + _NUM + r" tokens per second\)"),
    "total": re.compile(r"total time\s*=\s*" + _NUM + r" ms /\s*(\d+) tokens"),
    "samplers": re.compile(r"samplers time\s*=\s*" + _NUM + r" ms /\s*(\d+) (?:tokens|runs)"),
}
_CODED = re.compile(r"(encoded|decoded)\s+(\d+) tokens in\s+" + _NUM + r" seconds, speed:\s*"
                    + _NUM + r" t/s")
_SPEC_COUNTS = re.compile(r"^(n_draft|n_predict|n_drafted|n_accept)\s*=\s*(\d+)\s*$", re.M)
_SPEC_ACCEPT = re.compile(r"^accept\s*=\s*" + _NUM + r"%", re.M)
_SPEC_STATS = re.compile(r"statistics\s+(\S+):.*?#gen drafts =\s*(\d+), #acc drafts =\s*(\d+),"
                         r" #gen tokens =\s*(\d+), #acc tokens =\s*(\d+)"
                         r"(?:, #mean acc len =\s*" + _NUM + r")?")
_PROMPT_COUNT = re.compile(r"number of tokens in prompt = (\d+)")
_PROMPT_TOKEN = re.compile(r"^\s*(\d+) -> '", re.M)
# This version starts every log line with its time and level ("0.09.588.823 I ").
_LOG_PREFIX = re.compile(r"^\d+(?:\.\d+)+ [A-Z] ", re.M)
_END_OF_TEXT = " [end of text]\n"


def _unprefix(log: str) -> str:
  """Drops the time-and-level prefix of each log line, so the patterns read the lines as printed."""
  return _LOG_PREFIX.sub("", log)


def _num(text: str) -> Optional[float]:
  """A printed number as a float, None where llama.cpp printed inf or nan (e.g. 0 runs)."""
  value = float(text)
  return value if value == value and abs(value) != float("inf") else None


def parse_perf(log: str) -> dict[str, Any]:
  """Reads llama.cpp's own timing lines (the last of each kind), so its figures are recorded as it prints them.

  Args:
    log: a tool's stderr.

  Returns:
    Keys, each present only where its line was found: load_ms; prompt_eval_ms,
    prompt_eval_tokens, prompt_eval_tok_s; eval_ms, eval_runs, eval_tok_s;
    total_ms, total_tokens; samples (the sampler's count: llama-completion
    counts the prompt's tokens in it too).
  """
  out: dict[str, Any] = {}
  log = _unprefix(log)
  for kind, pattern in _PERF_PATTERNS.items():
    matches = pattern.findall(log)
    if not matches:
      continue
    m = matches[-1]
    if kind == "load":
      out["load_ms"] = _num(m)
    elif kind in ("prompt_eval", "eval"):
      unit = "tokens" if kind == "prompt_eval" else "runs"
      out[f"{kind}_ms"], out[f"{kind}_{unit}"] = _num(m[0]), int(m[1])
      out[f"{kind}_tok_s"] = _num(m[3])
    elif kind == "total":
      out["total_ms"], out["total_tokens"] = _num(m[0]), int(m[1])
    else:
      out["samples"] = int(m[1])
  return out


def parse_speculative(log: str) -> dict[str, Any]:
  """Reads llama-speculative-simple's summary, so the draft and accept counts are its own.

  Args:
    log: llama-speculative-simple's stderr.

  Returns:
    Keys present where found: encoded_tokens, encode_s, encode_tok_s;
    decoded_tokens, decode_s, decode_tok_s; n_draft, n_predict, n_drafted,
    n_accept; accept_pct; and, where it is printed (trace verbosity only),
    from the statistics line spec_type, gen_drafts, acc_drafts, gen_tokens,
    acc_tokens, mean_acc_len.
  """
  out: dict[str, Any] = {}
  log = _unprefix(log)
  for kind, tokens, seconds, speed in _CODED.findall(log):
    prefix = "encode" if kind == "encoded" else "decode"
    out[f"{kind}_tokens"], out[f"{prefix}_s"] = int(tokens), _num(seconds)
    out[f"{prefix}_tok_s"] = _num(speed)
  for name, value in _SPEC_COUNTS.findall(log):
    out[name] = int(value)
  accept = _SPEC_ACCEPT.findall(log)
  if accept:
    out["accept_pct"] = _num(accept[-1])
  stats = _SPEC_STATS.findall(log)
  if stats:
    kind, gen_d, acc_d, gen_t, acc_t, mean = stats[-1]
    out.update(spec_type=kind, gen_drafts=int(gen_d), acc_drafts=int(acc_d), gen_tokens=int(gen_t),
               acc_tokens=int(acc_t), mean_acc_len=_num(mean) if mean else None)
  return out


def parse_prompt_tokens(log: str) -> Optional[list[int]]:
  """Reads the prompt's token ids that llama-completion lists with --verbose-prompt, to compare tokenizers.

  Args:
    log: llama-completion's stderr.

  Returns:
    The ids in order, or None where the listing is absent or shorter than the count it announces.
  """
  log = _unprefix(log)
  m = _PROMPT_COUNT.search(log)
  if m is None:
    return None
  count = int(m.group(1))
  ids = [int(i) for i in _PROMPT_TOKEN.findall(log, m.end())[:count]]
  return ids if len(ids) == count else None


def completion_text(stdout: str) -> tuple[str, bool]:
  """Cuts llama-completion's stdout (run with --no-display-prompt) down to the generated text.

  Args:
    stdout: the whole stdout, decoded.

  Returns:
    (text, stopped_at_eog): the continuation, and whether it ended at an
    end-of-generation token (llama.cpp then prints " [end of text]").

  Raises:
    LlamaCppError: stdout does not end the way llama-completion ends it.
  """
  if not stdout.endswith("\n\n"):
    raise LlamaCppError(f"llama-completion stdout does not end with its blank lines: {stdout[-80:]!r}")
  text = stdout[:-2]
  if text.endswith(_END_OF_TEXT):
    return text[:-len(_END_OF_TEXT)], True
  return text, False


def speculative_text(stdout: str, prompt: str) -> str:
  """Cuts llama-speculative-simple's stdout (two newlines, the prompt, the text, blank lines) down to the text.

  Args:
    stdout: the whole stdout, decoded.
    prompt: the prompt text as given (the tool echoes its tokens, which
      byte-level BPE turns back into the same text).

  Returns:
    The continuation.

  Raises:
    LlamaCppError: the echo is not the prompt, or the blank lines are missing.
  """
  head = "\n\n" + prompt
  if not stdout.startswith(head):
    raise LlamaCppError("llama-speculative-simple did not echo the prompt as given; stdout starts"
                        f" {stdout[:80]!r}")
  if not stdout.endswith("\n\n\n\n"):
    raise LlamaCppError("llama-speculative-simple stdout does not end with its blank lines:"
                        f" {stdout[-80:]!r}")
  return stdout[len(head):-4]


# --- running the tools ------------------------------------------------------------------------


def _tail(text: str, lines: int = 12) -> str:
  return " | ".join(line for line in text.strip().splitlines()[-lines:] if line.strip())


def _ctx_size(prompt: str, n_predict: int, draft_max: int) -> int:
  """A context that holds the prompt and the generation: byte-level BPE never has more tokens than bytes."""
  need = len(prompt.encode("utf-8")) + n_predict + draft_max + 16
  return max(512, -(-need // 256) * 256)


_ATTEMPTS = 3


def _finished(stdout: str, stderr: str, speculative: bool) -> bool:
  """Whether a tool's output reached its last line (its logger may drop the end, see `_run_tool`)."""
  if speculative:
    return stdout.endswith("\n\n\n\n")
  return "graphs reused" in stderr


def _run_tool(argv: list[str], timeout: float, env: Optional[dict[str, str]],
              speculative: bool) -> tuple[str, str, float, int]:
  """Runs a tool, again where it exited cleanly but its output was cut short.

  The build flushes llama.cpp's logger at exit (`patch_source`); a build
  without that, or a log cut short some other way, can exit 0 before its
  last lines are written. Such a run is repeated, up to _ATTEMPTS times in
  all.

  Returns:
    (stdout, stderr, wall seconds of the run kept, attempts).
  """
  name = pathlib.Path(argv[0]).name
  for attempt in range(1, _ATTEMPTS + 1):
    start = time.perf_counter()
    try:
      proc = subprocess.run(argv, capture_output=True, timeout=timeout, check=False,
                            stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})})
    except FileNotFoundError as e:
      raise LlamaCppError(f"{argv[0]} not found; run bench.llamacpp.build() first") from e
    except subprocess.TimeoutExpired as e:
      stderr = (e.stderr or b"").decode("utf-8", "replace")
      raise LlamaCppError(f"{name} timed out after {timeout:.0f} s: {_tail(stderr)}") from e
    wall = time.perf_counter() - start
    stdout = proc.stdout.decode("utf-8", "replace")
    stderr = proc.stderr.decode("utf-8", "replace")
    if proc.returncode != 0:
      raise LlamaCppError(f"{name} exited with {proc.returncode}: {_tail(stderr)}")
    if _finished(stdout, stderr, speculative):
      return stdout, stderr, wall, attempt
  raise LlamaCppError(f"{name} exited 0 without its last lines {_ATTEMPTS} times (llama.cpp's"
                      f" logger drops lines at exit): {_tail(stderr)}")


WAIT_POLICIES = ("PASSIVE", "ACTIVE")  # OMP_WAIT_POLICY values `fastest_wait_policy` tries


def fastest_wait_policy(tools: Tools, model_path: os.PathLike, threads: int = 2,
                        n_gen: int = 32, rounds: int = 2,
                        timeout: float = 300) -> dict[str, Any]:
  """The OpenMP wait policy under which llama.cpp decodes fastest on this host now.

  Spinning threads (ACTIVE, llama.cpp's own default) win on a quiet host and
  lose badly on one shared with other work, so a peer is timed under
  whichever is faster where it runs: `llama-bench` decodes `n_gen` tokens
  under each policy, alternated for `rounds` rounds.

  Args:
    tools: from `build`.
    model_path: the target GGUF.
    threads: CPU threads.
    n_gen: tokens each llama-bench run decodes (no prompt).
    rounds: alternations of the policies.
    timeout: seconds per llama-bench process.

  Returns:
    {"policy": the faster, "tokens_per_s": {policy: best decode tokens/s},
    "n_gen", "rounds", "threads"}.

  Raises:
    LlamaCppError: llama-bench failed or printed no figure.
  """
  rates: dict[str, list[float]] = {p: [] for p in WAIT_POLICIES}
  argv = [str(tools.bench), "-m", str(model_path), "-t", str(threads), "-p", "0",
          "-n", str(n_gen), "-r", "1", "-o", "json"]
  for _ in range(rounds):
    for policy in WAIT_POLICIES:
      try:
        proc = subprocess.run(argv, capture_output=True, timeout=timeout, check=False,
                              stdin=subprocess.DEVNULL,
                              env={**os.environ, "OMP_WAIT_POLICY": policy})
      except (OSError, subprocess.TimeoutExpired) as e:
        raise LlamaCppError(f"llama-bench under OMP_WAIT_POLICY={policy} failed: {e}") from e
      try:
        rows = json.loads(proc.stdout.decode("utf-8", "replace"))
        rates[policy].append(float(rows[0]["avg_ts"]))
      except (ValueError, LookupError, TypeError) as e:
        raise LlamaCppError(f"llama-bench under OMP_WAIT_POLICY={policy} printed no decode "
                            f"rate (exit {proc.returncode}): "
                            f"{_tail(proc.stderr.decode('utf-8', 'replace'))}") from e
  best = {p: max(r) for p, r in rates.items()}
  return {"policy": max(best, key=best.get), "tokens_per_s": best, "n_gen": n_gen,
          "rounds": rounds, "threads": threads}


def command(tools: Tools, model_path: os.PathLike, prompt_file: os.PathLike, n_predict: int,
            threads: int = 2, draft_path: Optional[os.PathLike] = None,
            draft_max: Optional[int] = None, ctx_size: Optional[int] = None) -> list[str]:
  """The command line of one greedy generation, kept apart from `generate` so its terms can be checked.

  Args:
    tools: from `build`.
    model_path: the target GGUF.
    prompt_file: a file holding the prompt's exact bytes (-bf reads it whole;
      -f would drop a final newline).
    n_predict: tokens to generate at most.
    threads: CPU threads (target and draft).
    draft_path: the draft GGUF, or None for the target alone.
    draft_max: tokens drafted per step (required with draft_path).
    ctx_size: the context length (the model's own, often 32k, would
      allocate a KV cache far larger than needed).

  Returns:
    argv.
  """
  common = ["-m", str(model_path), "-bf", str(prompt_file), "--no-escape", "-t", str(threads),
            "--temp", "0", "--top-k", "1"]
  if ctx_size is not None:
    common += ["-c", str(ctx_size)]
  if draft_path is None:
    return [str(tools.completion), *common, "-n", str(n_predict), "-no-cnv",
            "--no-display-prompt", "--verbose-prompt"]
  if draft_max is None or draft_max < 1:
    raise ValueError(f"speculative decoding needs draft_max >= 1, got {draft_max!r}")
  # llama-speculative-simple stops only once it has more than -n tokens: given
  # n_predict - 1 it makes at least n_predict (more where a draft overshoots).
  return [str(tools.speculative_simple), *common, "-n", str(n_predict - 1),
          "-md", str(draft_path), "--spec-type", "draft-simple",
          "--spec-draft-n-max", str(draft_max), "-td", str(threads)]


def generate(tools: Tools, model_path: os.PathLike, prompt_text: str, n_predict: int,
             threads: int = 2, draft_path: Optional[os.PathLike] = None,
             draft_max: Optional[int] = None, timeout: float = 900,
             env: Optional[dict[str, str]] = None) -> dict[str, Any]:
  """Runs one greedy llama.cpp generation, so that it can be set beside jspec's on the same prompt.

  Args:
    tools: from `build`.
    model_path: the target GGUF.
    prompt_text: the raw prompt, passed byte for byte (no chat template).
    n_predict: tokens to generate at most; it stops earlier at an
      end-of-generation token.
    threads: CPU threads.
    draft_path: the draft GGUF for speculative decoding, or None for the target alone.
    draft_max: tokens drafted per step (with draft_path).
    timeout: seconds before the process is killed.
    env: variables set for the process on top of this one's (e.g.
      OMP_WAIT_POLICY=PASSIVE: its OpenMP threads otherwise spin, which on
      a machine busy with other work slowed 2 threads below 1).

  Returns:
    {"mode": "target" | "speculative", "draft_max", "text" (the continuation
    only), "n_tokens" (generated, an end-of-generation token not counted),
    "stopped_at_eog", "prompt_tokens", "prompt_token_ids" (target mode;
    None otherwise), "timings" (`parse_perf`; with a draft, of the target's
    context), "speculative" (`parse_speculative`, or None), "tok_s_reported"
    (llama.cpp's eval tokens/s, or its decode speed with a draft), "wall_s"
    (the whole process, model loading included), "tok_s_wall",
    "loadavg_1m" (the host's load when it started: other work on a shared
    machine slows llama.cpp's spinning threads), "env", "attempts" (see
    `_run_tool`), "command"}.
    With a draft, llama-speculative-simple may make up to draft_max tokens
    more than n_predict (its last step's draft is not cut to the budget);
    n_tokens and the text are what it made.

  Raises:
    ValueError: n_predict < 1, or a draft without draft_max >= 1.
    LlamaCppError: a file is missing, the tool failed or timed out (with
      the tail of its stderr), or its output is not as expected.
  """
  if n_predict < 1:
    raise ValueError(f"n_predict must be >= 1, got {n_predict}")
  for path in (model_path, draft_path):
    if path is not None and not pathlib.Path(path).is_file():
      raise LlamaCppError(f"no GGUF file at {path}")
  with tempfile.TemporaryDirectory(prefix="jspec-llamacpp-") as tmp:
    prompt_file = pathlib.Path(tmp) / "prompt.txt"
    prompt_file.write_bytes(prompt_text.encode("utf-8"))
    argv = command(tools, model_path, prompt_file, n_predict, threads, draft_path, draft_max,
                   _ctx_size(prompt_text, n_predict, draft_max or 0))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    stdout, stderr, wall, attempts = _run_tool(argv, timeout, env, draft_path is not None)
  name = pathlib.Path(argv[0]).name
  perf = parse_perf(stderr)
  if draft_path is None:
    text, eog = completion_text(stdout)
    if "samples" not in perf:
      raise LlamaCppError(f"{name} printed no sampler count: {_tail(stderr)}")
    spec, reported = None, perf.get("eval_tok_s")
    prompt_ids = parse_prompt_tokens(stderr)
    prompt_tokens = len(prompt_ids) if prompt_ids is not None else perf.get("prompt_eval_tokens")
    if prompt_tokens is None:
      raise LlamaCppError(f"{name} printed no prompt token count: {_tail(stderr)}")
    # Its sampler count takes in the prompt's tokens and the end-of-generation one.
    n_tokens = perf["samples"] - prompt_tokens - eog
  else:
    text = speculative_text(stdout, prompt_text)
    spec = parse_speculative(stderr)
    if "n_predict" not in spec:
      raise LlamaCppError(f"{name} printed no n_predict: {_tail(stderr)}")
    # It stops once its n_predict (every token the target accepted, an
    # end-of-generation one included) exceeds -n, or at end of generation.
    eog = spec["n_predict"] <= n_predict - 1
    n_tokens = spec["n_predict"] - eog
    reported, prompt_ids = spec.get("decode_tok_s"), None
    prompt_tokens = spec.get("encoded_tokens")
  return {
      "mode": "target" if draft_path is None else "speculative",
      "draft_max": draft_max if draft_path is not None else None,
      "text": text,
      "n_tokens": n_tokens,
      "stopped_at_eog": bool(eog),
      "prompt_tokens": prompt_tokens,
      "prompt_token_ids": prompt_ids,
      "timings": perf,
      "speculative": spec,
      "tok_s_reported": reported,
      "wall_s": round(wall, 4),
      "tok_s_wall": round(n_tokens / wall, 3) if wall > 0 else None,
      "loadavg_1m": load,
      "env": dict(env or {}),
      "attempts": attempts,
      "command": argv,
  }


# --- the suite ---------------------------------------------------------------------------------

DEFAULT_SWEEP = (2, 4, 8, 16)
BUILD_COMMAND = "python -m bench.llamacpp --build-only"  # what a skipped peer's reason names
TARGET_MODEL = "qwen2.5-coder-1.5b"
DRAFT_MODEL = "qwen2.5-coder-0.5b"


def prompt_text(prompt: Any, tokenizer: Any = None) -> str:
  """The exact text llama.cpp is given for a suite prompt, rendered as jspec renders it.

  Args:
    prompt: a `bench.prompts.Prompt`.
    tokenizer: a `jspec.tokenizer.Tokenizer` (needed for chat prompts).

  Returns:
    The prompt text; for chat and edit prompts the chat template's rendering,
    whose special tokens both llama.cpp and jspec's tokenizer parse as such.

  Raises:
    ValueError: a chat prompt without a tokenizer.
  """
  if not prompt.chat:
    return prompt.text
  if tokenizer is None:
    raise ValueError(f"prompt {prompt.name!r} goes through the chat template: pass a tokenizer")
  return tokenizer.apply_chat_template([{"role": "user", "content": prompt.text}])


def texts_agree(target: dict[str, Any], spec: dict[str, Any]) -> bool:
  """Whether a speculative run's text is the target's, allowing for the tokens it makes past the budget.

  Args:
    target: a target-only `generate` result.
    spec: a speculative `generate` result for the same prompt and budget.

  Returns:
    Equal texts where the target stopped at end of generation; else the
    target's text a prefix of the speculative one.
  """
  if target["stopped_at_eog"]:
    return spec["text"] == target["text"]
  return spec["text"].startswith(target["text"])


def _median(values: Sequence[Optional[float]]) -> Optional[float]:
  values = [v for v in values if v is not None]
  return round(statistics.median(values), 3) if values else None


def medians(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
  """Summarizes the per-prompt records of a run, so that one line per mode can be quoted.

  Args:
    records: the "prompts" entries of a run document.

  Returns:
    {mode: {"tok_s_reported", "tok_s_wall", "n_tokens", "prompts"}} for
    "target" and "speculative", plus "speedup_reported" and "speedup_wall":
    medians over prompts of speculative / target.
  """
  out: dict[str, Any] = {}
  for mode in ("target", "speculative"):
    rows = [r[mode] for r in records if r.get(mode)]
    out[mode] = {"tok_s_reported": _median([r["tok_s_reported"] for r in rows]),
                 "tok_s_wall": _median([r["tok_s_wall"] for r in rows]),
                 "n_tokens": _median([r["n_tokens"] for r in rows]), "prompts": len(rows)}
  for key in ("tok_s_reported", "tok_s_wall"):
    ratios = [r["speculative"][key] / r["target"][key] for r in records
              if r.get("target") and r.get("speculative") and r["target"][key]
              and r["speculative"][key] is not None]
    out[f"speedup_{key[6:]}"] = _median(ratios)
  return out


def _e2e_tok_s(run: dict[str, Any]) -> Optional[float]:
  """Prefill and decode tokens/s of one `generate` result, by llama.cpp's own clock (loading excluded).

  Args:
    run: a `generate` result.

  Returns:
    n_tokens over the prompt's and the generation's seconds as llama.cpp
    prints them (prompt eval + eval; encode + decode with a draft), or
    None where it printed neither.
  """
  if run["speculative"] is None:
    parts = [run["timings"].get("prompt_eval_ms"), run["timings"].get("eval_ms")]
    seconds = None if None in parts else sum(parts) / 1000
  else:
    parts = [run["speculative"].get("encode_s"), run["speculative"].get("decode_s")]
    seconds = None if None in parts else sum(parts)
  return round(run["n_tokens"] / seconds, 3) if seconds else None


def peer_record(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
  """One llama.cpp mode's record in a `python -m bench` document, from its repetitions on one prompt.

  Args:
    runs: `generate` results of one mode on one prompt, one per repetition.

  Returns:
    {"engine": "llamacpp", "mode", "draft_max", "text" and "new_tokens"
    and "stopped_at_eog" (the first repetition's), "reps_identical" (every
    repetition made that text), "tokens_per_s" (prefill + decode by
    llama.cpp's own timings, `_e2e_tok_s`), "decode_tokens_per_s" (its
    reported eval tokens/s, or decode speed with a draft), "wall_s" and
    "wall_tokens_per_s" (the whole process, model loading included),
    "prompt_tokens", "accept_pct" (with a draft), "reps" (each
    repetition's figures), "command", "env"}; tokens/s and seconds are
    medians over the repetitions.
  """
  first = runs[0]
  reps = [{"tokens_per_s": _e2e_tok_s(r), "decode_tokens_per_s": r["tok_s_reported"],
           "wall_s": r["wall_s"], "wall_tokens_per_s": r["tok_s_wall"], "n_tokens": r["n_tokens"],
           "loadavg_1m": r["loadavg_1m"], "attempts": r["attempts"], "timings": r["timings"],
           "speculative": r["speculative"]} for r in runs]
  return {
      "engine": "llamacpp", "mode": first["mode"], "draft_max": first["draft_max"],
      "text": first["text"], "new_tokens": first["n_tokens"],
      "stopped_at_eog": first["stopped_at_eog"],
      "reps_identical": all(r["text"] == first["text"] for r in runs),
      **{key: _median([rep[key] for rep in reps])
         for key in ("tokens_per_s", "decode_tokens_per_s", "wall_s", "wall_tokens_per_s")},
      "prompt_tokens": first["prompt_tokens"],
      "accept_pct": (first["speculative"] or {}).get("accept_pct"),
      "reps": reps, "command": first["command"], "env": first["env"]}


def peer_records(tools: Tools, target_path: os.PathLike, draft_path: os.PathLike, text: str,
                 max_new_tokens: int, reps: int, modes: dict[str, dict[str, Any]],
                 env: Optional[dict[str, str]] = None,
                 timeout: float = 900) -> dict[str, dict[str, Any]]:
  """Runs llama.cpp's peer modes on one prompt of a `python -m bench` run, repetitions alternating between modes.

  A mode given several draft lengths runs at each of them (alternated
  within each repetition too) and keeps the one whose median decode is
  fastest on this prompt: llama.cpp's speculative decode at its best draft
  length, which differs from prompt to prompt.

  Args:
    tools: from `build` or `find_built`.
    target_path: the target GGUF.
    draft_path: the draft GGUF.
    text: the prompt text (`prompt_text`).
    max_new_tokens: tokens per generation at most (llama.cpp stops at end of generation).
    reps: repetitions per mode.
    modes: mode name -> {"threads", "draft_max"}: no draft_max, the target
      alone; an int or a sequence of ints, drafts per step.
    env: extra environment of every llama.cpp process (see `generate`).
    timeout: seconds per process.

  Returns:
    Mode name -> `peer_record`, with "prompt_token_ids" (llama.cpp's
    tokenization of the prompt, from the target-alone mode; None with a
    draft), and for several draft lengths "draft_max_sweep": per length,
    its median decode and prefill + decode tokens/s and acceptance.

  Raises:
    LlamaCppError: a tool failed (see `generate`).
    ValueError: an empty sequence of draft lengths.
  """
  lengths: dict[str, list[Optional[int]]] = {}
  for name, settings in modes.items():
    draft_max = settings.get("draft_max")
    lengths[name] = ([draft_max] if draft_max is None or isinstance(draft_max, int)
                     else list(draft_max))
    if not lengths[name]:
      raise ValueError(f"{name}: draft_max is an empty sequence; expected one or more lengths")
  runs: dict[tuple[str, Optional[int]], list[dict[str, Any]]] = {
      (name, d): [] for name, ds in lengths.items() for d in ds}
  for _ in range(reps):
    for (name, draft_max), rs in runs.items():
      rs.append(generate(tools, target_path, text, max_new_tokens,
                         modes[name].get("threads", 2),
                         draft_path if draft_max else None, draft_max, timeout, env))
  out = {}
  for name, ds in lengths.items():
    records = {d: peer_record(runs[(name, d)]) for d in ds}
    best = max(ds, key=lambda d: records[d]["decode_tokens_per_s"] or 0.0)
    out[name] = records[best]
    if len(ds) > 1:
      out[name]["draft_max_sweep"] = [
          {"draft_max": d, **{key: records[d][key] for key in
                              ("decode_tokens_per_s", "tokens_per_s", "accept_pct")}}
          for d in ds]
    out[name]["prompt_token_ids"] = runs[(name, best)][0]["prompt_token_ids"]
  return out


def manifest(tools: Tools) -> dict[str, Any]:
  """The build's build.json, so a results file names the llama.cpp it measured.

  Args:
    tools: from `build` or `find_built`.

  Returns:
    Its contents, or {} where it is unreadable.
  """
  return _manifest(tools)


def _write_json(doc: dict[str, Any], path: pathlib.Path) -> None:
  from bench import results  # pylint: disable=import-outside-toplevel (light; only when writing)
  results.write(doc, path)


def run_suite(tools: Tools, target_path: os.PathLike, draft_path: os.PathLike,
              prompts: Sequence[Any], max_new_tokens: int, out: Optional[pathlib.Path] = None,
              threads: int = 2, sweep: Sequence[int] = DEFAULT_SWEEP,
              tokenizer: Any = None, timeout: float = 900, log: Any = None,
              env: Optional[dict[str, str]] = None) -> dict[str, Any]:
  """Runs llama.cpp target-only and speculative on each prompt, the draft length picked on the first.

  The draft lengths in `sweep` are all tried on the first prompt; the one
  with the best tokens/s as llama.cpp reports it is used for the rest (and
  its run is the first prompt's speculative record). The document is
  rewritten after every prompt, so a stopped run keeps whole prompts.

  Args:
    tools: from `build`.
    target_path: the target GGUF.
    draft_path: the draft GGUF.
    prompts: `bench.prompts.Prompt`s, in run order.
    max_new_tokens: tokens per generation at most (both stop at EOS).
    out: the JSON file, or None to write nothing.
    threads: CPU threads.
    sweep: draft lengths to try on the first prompt.
    tokenizer: jspec's tokenizer of the target (chat templates, and its ids
      to compare with llama.cpp's).
    timeout: seconds per process.
    log: a text stream for progress lines, or None.
    env: extra environment of every llama.cpp process (see `generate`).

  Returns:
    {"kind": "llamacpp", "version", "build" (build.json), "config", "sweep"
    ([{"draft_max", "tok_s_reported", "tok_s_wall", "n_tokens", "accept_pct",
    "agrees_with_target"}] on the first prompt), "draft_max" (the one
    kept), "prompts" ([{"name", "kind", "chat", "prompt_chars",
    "jspec_prompt_ids", "prompt_ids_equal", "target", "speculative" (each a
    `generate` result), "texts_agree" (`texts_agree`)}]), "medians" (`medians`), "complete"}.
  """
  doc: dict[str, Any] = {
      "kind": "llamacpp", "version": tools.version, "build": _manifest(tools),
      "config": {"target": str(target_path), "draft": str(draft_path),
                 "max_new_tokens": max_new_tokens, "threads": threads, "sweep": list(sweep),
                 "greedy": "--temp 0 --top-k 1", "stop_at_eos": True, "env": dict(env or {})},
      "sweep": [], "draft_max": None, "prompts": [], "medians": None, "complete": False}
  say = (lambda msg: print(msg, file=log, flush=True)) if log else (lambda msg: None)
  draft_max = None
  for index, prompt in enumerate(prompts):
    text = prompt_text(prompt, tokenizer)
    record: dict[str, Any] = {"name": prompt.name, "kind": prompt.kind, "chat": prompt.chat,
                              "prompt_chars": len(text)}
    if tokenizer is not None:
      record["jspec_prompt_ids"] = list(tokenizer.encode(text))
    record["target"] = generate(tools, target_path, text, max_new_tokens, threads,
                                timeout=timeout, env=env)
    if tokenizer is not None:
      record["prompt_ids_equal"] = record["target"]["prompt_token_ids"] == record["jspec_prompt_ids"]
    say(f"{prompt.name}: target {record['target']['n_tokens']} tokens, "
        f"{record['target']['tok_s_reported']} tok/s reported, {record['target']['tok_s_wall']} wall")
    if index == 0:
      runs = []
      for n in sweep:
        run = generate(tools, target_path, text, max_new_tokens, threads, draft_path, n, timeout,
                       env)
        runs.append(run)
        doc["sweep"].append({"draft_max": n, "tok_s_reported": run["tok_s_reported"],
                             "tok_s_wall": run["tok_s_wall"], "n_tokens": run["n_tokens"],
                             "accept_pct": (run["speculative"] or {}).get("accept_pct"),
                             "agrees_with_target": texts_agree(record["target"], run)})
        say(f"{prompt.name}: draft_max {n}: {run['tok_s_reported']} tok/s reported, "
            f"{run['tok_s_wall']} wall, accept {(run['speculative'] or {}).get('accept_pct')}%")
      best = max(range(len(runs)), key=lambda i: runs[i]["tok_s_reported"] or 0.0)
      draft_max = sweep[best]
      doc["draft_max"] = draft_max
      record["speculative"] = runs[best]
    else:
      record["speculative"] = generate(tools, target_path, text, max_new_tokens, threads,
                                       draft_path, draft_max, timeout, env)
      say(f"{prompt.name}: speculative {record['speculative']['tok_s_reported']} tok/s reported, "
          f"{record['speculative']['tok_s_wall']} wall")
    record["texts_agree"] = texts_agree(record["target"], record["speculative"])
    doc["prompts"].append(record)
    doc["medians"] = medians(doc["prompts"])
    if out is not None:
      _write_json(doc, out)
  doc["complete"] = True
  if out is not None:
    _write_json(doc, out)
  return doc


def _manifest(tools: Tools) -> dict[str, Any]:
  try:
    return json.loads((tools.root / _MANIFEST).read_text())
  except (OSError, ValueError):
    return {}


def find_built(cache_dir: Optional[os.PathLike] = None) -> Optional[Tools]:
  """The tools if this host already has them built, without building, so tests can skip cheaply.

  Args:
    cache_dir: where builds live (default: `<jspec cache>/llamacpp`).

  Returns:
    The `Tools`, or None.
  """
  root = pathlib.Path(cache_dir) if cache_dir is not None else _default_root()
  return _tools_in(root / build_key())


def main(argv: Optional[Sequence[str]] = None) -> int:
  """`python -m bench.llamacpp`: builds llama.cpp if needed and runs the suite's first prompts (or only builds).

  Args:
    argv: command-line arguments (default: sys.argv[1:]).

  Returns:
    The exit status: 0, or 1 on a build or run failure.
  """
  parser = argparse.ArgumentParser(prog="python -m bench.llamacpp", description=__doc__.split("\n")[0])
  parser.add_argument("--prompts", default="3",
                      help="a count, slice or names, as for python -m bench (default: 3)")
  parser.add_argument("--max-new-tokens", type=int, default=128)
  parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench/results/llamacpp.json"))
  parser.add_argument("--threads", type=int, default=2)
  parser.add_argument("--sweep", default=",".join(map(str, DEFAULT_SWEEP)),
                      help="draft lengths tried on the first prompt (default: 2,4,8,16)")
  parser.add_argument("--timeout", type=float, default=900, help="seconds per llama.cpp process")
  parser.add_argument("--jobs", type=int, default=None, help="compile jobs (default: all CPUs)")
  parser.add_argument("--build-only", action="store_true",
                      help="build the tools (once per version and CPU) and run nothing; "
                           "python -m bench then runs llama.cpp as a peer")
  parser.add_argument("--omp-wait-policy", choices=("default", "fastest", "active", "passive"),
                      default="default",
                      help="OMP_WAIT_POLICY of llama.cpp's OpenMP threads; passive suits a machine"
                           " shared with other work, fastest times both with llama-bench first"
                           " and keeps the faster (default: llama.cpp's own, spinning)")
  args = parser.parse_args(argv)
  try:
    sweep = [int(x) for x in args.sweep.split(",") if x.strip()]
  except ValueError:
    parser.error(f"--sweep {args.sweep!r}: expected comma-separated integers")
  if not sweep or min(sweep) < 1 or args.max_new_tokens < 1:
    parser.error("--sweep values and --max-new-tokens must be >= 1")

  if args.jobs is not None and args.jobs < 1:
    parser.error("--jobs must be >= 1")
  if args.build_only:
    try:
      start = time.monotonic()
      tools = build(progress=True, jobs=args.jobs)
    except LlamaCppError as e:
      print(f"llamacpp: {e}", file=sys.stderr)
      return 1
    print(f"llamacpp: tools in {tools.root} ({time.monotonic() - start:.0f} s)")
    return 0
  from bench import prompts as prompts_lib  # pylint: disable=import-outside-toplevel
  from jspec import fetch  # pylint: disable=import-outside-toplevel
  from jspec import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel
  try:
    chosen = prompts_lib.select(prompts_lib.SUITE, args.prompts)
  except ValueError as e:
    parser.error(str(e))
  try:
    start = time.monotonic()
    tools = build(progress=True, jobs=args.jobs)
    print(f"llamacpp: tools in {tools.root} ({time.monotonic() - start:.0f} s)", file=sys.stderr)
    target = fetch.assemble(fetch.get_source(TARGET_MODEL))
    draft = fetch.assemble(fetch.get_source(DRAFT_MODEL))
    tok = tokenizer_lib.from_gguf(target)
    if args.omp_wait_policy == "fastest":
      probe = fastest_wait_policy(tools, target, args.threads, timeout=args.timeout)
      print(f"llamacpp: OMP_WAIT_POLICY={probe['policy']} ("
            + ", ".join(f"{k} {v:.2f} tok/s" for k, v in probe["tokens_per_s"].items()) + ")",
            file=sys.stderr)
      env = {"OMP_WAIT_POLICY": probe["policy"]}
    else:
      env = ({} if args.omp_wait_policy == "default"
             else {"OMP_WAIT_POLICY": args.omp_wait_policy.upper()})
    doc = run_suite(tools, target, draft, chosen, args.max_new_tokens, args.out, args.threads,
                    sweep, tok, args.timeout, sys.stderr, env)
  except (LlamaCppError, fetch.FetchError) as e:
    print(f"llamacpp: {e}", file=sys.stderr)
    return 1
  m = doc["medians"]
  print(f"llama.cpp target: {m['target']['tok_s_reported']} tok/s reported,"
        f" {m['target']['tok_s_wall']} wall; speculative (draft_max {doc['draft_max']}):"
        f" {m['speculative']['tok_s_reported']} tok/s reported, {m['speculative']['tok_s_wall']}"
        f" wall; written to {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
