"""bench.llamacpp: parsing llama.cpp's output, the command lines, the build's cache, a real run.

The parse tests read excerpts captured from the real tools (llama.cpp vendored
by llama-cpp-python 0.3.36, built by `bench.llamacpp.build`). A fake tool (a
Python script printing the same format) checks `generate`'s arguments, its
timeout and its errors without llama.cpp. The end-to-end test runs only where
the real tools are already built.
"""

import json
import pathlib
import sys

import pytest

from bench import llamacpp
from bench import prompts as prompts_lib

# --- excerpts of the real tools' output --------------------------------------------------

# llama-completion -m qwen2.5-coder-1.5b-instruct-q4_k_m.gguf -bf prompt.txt --no-escape -t 2
#   --temp 0 --top-k 1 -c 512 -n 8 -no-cnv --no-display-prompt --verbose-prompt --no-repack
# on the suite's first prompt (quicksort); stderr from the prompt listing on, without the
# sampler parameter lines; the whole stdout.
REAL_COMPLETION_STDERR = """\
0.09.588.815 I llama_completion: prompt: 'def quicksort(arr):
    \"\"\"Sort a list of numbers in ascending order with the quicksort algorithm.

    Returns a new list; the input is not modified.
    \"\"\"
'
0.09.588.819 I llama_completion: number of tokens in prompt = 35
0.09.588.823 I    750 -> 'def'
0.09.588.824 I   3974 -> ' quick'
0.09.588.826 I   6860 -> 'sort'
0.09.588.827 I  10939 -> '(arr'
0.09.588.828 I    982 -> '):
'
0.09.588.829 I    262 -> '   '
0.09.588.829 I   4210 -> ' \"\"\"'
0.09.588.830 I  10231 -> 'Sort'
0.09.588.831 I    264 -> ' a'
0.09.588.832 I   1140 -> ' list'
0.09.588.832 I    315 -> ' of'
0.09.588.833 I   5109 -> ' numbers'
0.09.588.834 I    304 -> ' in'
0.09.588.835 I  35388 -> ' ascending'
0.09.588.836 I   1973 -> ' order'
0.09.588.837 I    448 -> ' with'
0.09.588.837 I    279 -> ' the'
0.09.588.838 I   3974 -> ' quick'
0.09.588.838 I   6860 -> 'sort'
0.09.588.839 I  12111 -> ' algorithm'
0.09.588.840 I    382 -> '.

'
0.09.588.840 I    262 -> '   '
0.09.588.841 I   5184 -> ' Returns'
0.09.588.841 I    264 -> ' a'
0.09.588.842 I    501 -> ' new'
0.09.588.842 I   1140 -> ' list'
0.09.588.843 I     26 -> ';'
0.09.588.844 I    279 -> ' the'
0.09.588.845 I   1946 -> ' input'
0.09.588.845 I    374 -> ' is'
0.09.588.846 I    537 -> ' not'
0.09.588.847 I  10807 -> ' modified'
0.09.588.847 I    624 -> '.
'
0.09.588.848 I    262 -> '   '
0.09.588.849 I   3190 -> ' \"\"\"
'
0.09.588.849 I 
0.09.588.862 I sampler seed: 2311550657
0.09.588.889 I sampler params: 
0.09.588.895 I sampler chain: logits -> ?penalties -> ?dry -> ?top-n-sigma -> top-k -> ?typical -> top-p -> min-p -> ?xtc -> temp-ext -> dist 
0.09.588.896 I generate: n_ctx = 512, n_batch = 2048, n_predict = 8, n_keep = 0
0.09.588.896 I 
0.27.596.979 I common_perf_print:    sampling time =       4.17 ms
0.27.596.982 I common_perf_print:    samplers time =       1.02 ms /    43 tokens
0.27.596.986 I common_perf_print:        load time =    7782.33 ms
0.27.596.989 I common_perf_print: prompt eval time =    7246.94 ms /    35 tokens (  207.06 ms per token,     4.83 tokens per second)
0.27.596.992 I common_perf_print:        eval time =   10752.62 ms /     7 runs   ( 1536.09 ms per token,     0.65 tokens per second)
0.27.596.993 I common_perf_print:       total time =   18011.94 ms /    42 tokens
0.27.596.995 I common_perf_print: unaccounted time =       8.20 ms /   0.0 %      (total - sampling - prompt eval - eval) / (total)
0.27.596.996 I common_perf_print:    graphs reused =          6
"""
REAL_COMPLETION_STDOUT = '    if len(arr) <= 1\n\n'

# llama-speculative-simple, the same target and prompt, -n 7 -md qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
#   --spec-type draft-simple --spec-draft-n-max 4 -td 2: stderr from its summary on; stdout.
REAL_SPECULATIVE_STDERR = """\
0.42.778.622 I encoded   35 tokens in    8.885 seconds, speed:    3.939 t/s
0.42.778.625 I decoded   12 tokens in   20.166 seconds, speed:    0.595 t/s
0.42.778.625 I 
0.42.778.626 I n_draft   = 4
0.42.778.627 I n_predict = 12
0.42.778.627 I n_drafted = 9
0.42.778.628 I n_accept  = 9
0.42.778.629 I accept    = 100.000%
0.42.778.630 I 
0.42.778.630 I draft:

0.42.778.680 I 
0.42.778.680 I target:

0.42.778.683 I common_perf_print:    sampling time =      22.77 ms
0.42.778.685 I common_perf_print:    samplers time =       1.91 ms /    12 tokens
0.42.778.686 I common_perf_print:        load time =    5192.53 ms
0.42.778.689 I common_perf_print: prompt eval time =   21445.79 ms /    48 tokens (  446.79 ms per token,     2.24 tokens per second)
0.42.778.691 I common_perf_print:        eval time =       0.00 ms /     1 runs   (    0.00 ms per token,      inf tokens per second)
0.42.778.693 I common_perf_print:       total time =   34373.38 ms /    49 tokens
0.42.778.695 I common_perf_print: unaccounted time =   12904.82 ms /  37.5 %      (total - sampling - prompt eval - eval) / (total)
0.42.778.695 I common_perf_print:    graphs reused =          1
"""
REAL_SPECULATIVE_STDOUT = '\n\ndef quicksort(arr):\n    """Sort a list of numbers in ascending order with the quicksort algorithm.\n\n    Returns a new list; the input is not modified.\n    """\n    if len(arr) <= 1:\n        return arr\n\n\n\n'


def _unprefixed(log):
  return "".join(line.split(" I ", 1)[1] if line[:1].isdigit() and " I " in line else line
                 for line in log.splitlines(keepends=True))


def test_parse_perf_reads_real_completion_timings():
  perf = llamacpp.parse_perf(REAL_COMPLETION_STDERR)
  assert perf == {"load_ms": 7782.33, "prompt_eval_ms": 7246.94, "prompt_eval_tokens": 35,
                  "prompt_eval_tok_s": 4.83, "eval_ms": 10752.62, "eval_runs": 7,
                  "eval_tok_s": 0.65, "total_ms": 18011.94, "total_tokens": 42, "samples": 43}
  assert llamacpp.parse_perf(_unprefixed(REAL_COMPLETION_STDERR)) == perf  # older, unprefixed logs


def test_parse_prompt_tokens_reads_the_real_listing_with_newline_pieces():
  ids = llamacpp.parse_prompt_tokens(REAL_COMPLETION_STDERR)
  assert len(ids) == 35
  assert ids[:7] == [750, 3974, 6860, 10939, 982, 262, 4210]  # "):\n" is id 982
  assert ids[-3:] == [624, 262, 3190]
  assert llamacpp.parse_prompt_tokens(_unprefixed(REAL_COMPLETION_STDERR)) == ids
  cut = REAL_COMPLETION_STDERR[:REAL_COMPLETION_STDERR.index("   3190 ->")]
  assert llamacpp.parse_prompt_tokens(cut) is None  # fewer ids than announced
  assert llamacpp.parse_prompt_tokens("no listing") is None


def test_completion_text_real_and_end_of_text():
  assert llamacpp.completion_text(REAL_COMPLETION_STDOUT) == ("    if len(arr) <= 1", False)
  assert llamacpp.completion_text("    return 1\n [end of text]\n\n\n") == ("    return 1\n", True)
  with pytest.raises(llamacpp.LlamaCppError, match="does not end"):
    llamacpp.completion_text("cut short")


def test_parse_speculative_reads_the_real_summary():
  spec = llamacpp.parse_speculative(REAL_SPECULATIVE_STDERR)
  assert spec == {"encoded_tokens": 35, "encode_s": 8.885, "encode_tok_s": 3.939,
                  "decoded_tokens": 12, "decode_s": 20.166, "decode_tok_s": 0.595, "n_draft": 4,
                  "n_predict": 12, "n_drafted": 9, "n_accept": 9, "accept_pct": 100.0}
  assert llamacpp.parse_speculative(_unprefixed(REAL_SPECULATIVE_STDERR)) == spec
  # The target's context counts the verification batches as prompt eval; 0 runs print inf.
  perf = llamacpp.parse_perf(REAL_SPECULATIVE_STDERR)
  assert perf["eval_runs"] == 1 and perf["eval_tok_s"] is None and perf["prompt_eval_tokens"] == 48


def test_parse_speculative_reads_the_trace_statistics_line():
  line = ("0.42.778.680 I statistics     draft-simple: #calls(b,g,a) =    1      3      3,"
          " #gen drafts =      3, #acc drafts =     3, #gen tokens =      9, #acc tokens =     9,"
          " #mean acc len = 4.00, #acc rate/pos = (1.000, 1.000)\n")
  spec = llamacpp.parse_speculative(line)
  assert spec == {"spec_type": "draft-simple", "gen_drafts": 3, "acc_drafts": 3, "gen_tokens": 9,
                  "acc_tokens": 9, "mean_acc_len": 4.0}


def test_speculative_text_strips_the_real_echo():
  prompt = prompts_lib.SUITE[0].text
  text = llamacpp.speculative_text(REAL_SPECULATIVE_STDOUT, prompt)
  assert text == "    if len(arr) <= 1:\n        return arr"
  # -n 7 asked for 8 tokens; the 4-token drafts ran on to 12, the target's 8 a prefix of them.
  target = {"text": llamacpp.completion_text(REAL_COMPLETION_STDOUT)[0], "stopped_at_eog": False}
  assert llamacpp.texts_agree(target, {"text": text})
  with pytest.raises(llamacpp.LlamaCppError, match="did not echo the prompt"):
    llamacpp.speculative_text(REAL_SPECULATIVE_STDOUT, prompt.replace("quicksort", "mergesort"))
  with pytest.raises(llamacpp.LlamaCppError, match="does not end"):
    llamacpp.speculative_text(REAL_SPECULATIVE_STDOUT[:-2], prompt)


# --- a fake tool printing the same format ---------------------------------------------------

_FAKE = r'''
import json, os, pathlib, sys, time

argv = sys.argv[1:]
name = pathlib.Path(sys.argv[0]).name
opt = lambda flag: argv[argv.index(flag) + 1]
if name == "llama-bench":  # decode rate by OpenMP wait policy: FAKE_LLAMA_FAST names the faster
  policy = os.environ.get("OMP_WAIT_POLICY")
  with open(os.environ["FAKE_LLAMA_LOG"], "a") as f:
    f.write(json.dumps({"name": name, "argv": argv, "prompt": None, "omp": policy}) + "\n")
  fast = os.environ.get("FAKE_LLAMA_FAST", "ACTIVE")
  print(json.dumps([{"n_gen": int(opt("-n")), "avg_ts": 20.0 if policy == fast else 10.0}]))
  sys.exit(0)
prompt = pathlib.Path(opt("-bf")).read_bytes()
with open(os.environ["FAKE_LLAMA_LOG"], "a") as f:
  f.write(json.dumps({"name": name, "argv": argv, "prompt": prompt.decode("utf-8"),
                      "omp": os.environ.get("OMP_WAIT_POLICY")}) + "\n")
mode = os.environ.get("FAKE_LLAMA_MODE", "ok")
if mode == "hang":
  sys.stderr.write("llama_model_loader: loaded meta data\n")
  sys.stderr.flush()
  time.sleep(60)
if mode == "fail":
  sys.stderr.write("llama_model_load: error loading model: tensor 'output.weight' not found\n")
  sys.exit(1)
if mode.startswith("cut"):  # "cutN": the first N runs lose their last lines, as the real ones may
  count_file = pathlib.Path(os.environ["FAKE_LLAMA_LOG"] + ".runs")
  runs = int(count_file.read_text()) + 1 if count_file.exists() else 1
  count_file.write_text(str(runs))
  if runs <= int(mode[3:]):
    sys.stderr.write("generate: n_ctx = 512, n_batch = 2048, n_predict = 8, n_keep = 0\n")
    sys.exit(0)
n = int(opt("-n"))
# FAKE_LLAMA_TEXTS: a JSON file, prompt -> {"target": text, "spec": text, "eog": bool}, for
# the bench's peer phase (its texts are compared with jspec's); other prompts make " t0 t1 ...".
texts = (json.loads(pathlib.Path(os.environ["FAKE_LLAMA_TEXTS"]).read_text())
         if os.environ.get("FAKE_LLAMA_TEXTS") else {})
given = texts.get(prompt.decode("utf-8"))
eog = mode == "eog" or bool(given and given.get("eog"))
out, err = sys.stdout.write, sys.stderr.write
P = "0.09.588.819 I "  # the time-and-level prefix of this version's log lines
if name == "llama-completion":
  made = 2 if eog else n
  err(f"{P}llama_completion: number of tokens in prompt = {len(prompt)}\n")
  for b in prompt:
    err(f"{P}{b:6d} -> '{chr(b)}'\n")
  text = given["target"] if given else "".join(f" t{i}" for i in range(made))
  out(text + (" [end of text]\n" if eog else "") + "\n\n")
  samples = len(prompt) + made + eog  # like the real tool: the prompt's tokens count too
  err(f"{P}common_perf_print:    sampling time =       1.00 ms\n"
      f"{P}common_perf_print:    samplers time =       0.50 ms / {samples:5d} tokens\n"
      f"{P}common_perf_print:        load time =     100.00 ms\n"
      f"{P}common_perf_print: prompt eval time =      50.00 ms / {len(prompt):5d} tokens ("
      f"    1.00 ms per token,  1000.00 tokens per second)\n"
      f"{P}common_perf_print:        eval time =     100.00 ms / {made - 1:5d} runs   ("
      f"   10.00 ms per token,    25.00 tokens per second)\n"
      f"{P}common_perf_print:       total time =     300.00 ms / {len(prompt) + made:5d} tokens\n"
      f"{P}common_perf_print:    graphs reused =          6\n")
else:
  draft_max = int(opt("--spec-draft-n-max"))
  # Like the real tool: more than -n tokens, here two more than the least.
  made = 2 if eog else n + 3
  speed = 500.0 if draft_max == 4 else 50.0 + draft_max
  text = given["spec"] if given else "".join(f" t{i}" for i in range(made))
  out("\n\n" + prompt.decode("utf-8") + text + "\n\n")
  err(f"{P}encoded {len(prompt):4d} tokens in    0.100 seconds, speed:  100.000 t/s\n"
      f"{P}decoded {made + eog:4d} tokens in    1.000 seconds, speed: {speed:8.3f} t/s\n{P}\n"
      f"{P}n_draft   = {draft_max}\n{P}n_predict = {made + eog}\n{P}n_drafted = 12\n"
      f"{P}n_accept  = 9\n{P}accept    = 75.000%\n")
  out("\n\n")
'''


@pytest.fixture
def fake_tools(tmp_path, monkeypatch):
  """Tools whose binaries are the fake script; returns (tools, read_calls)."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  paths = {}
  for name, attr in llamacpp.TARGETS.items():
    path = bin_dir / name
    path.write_text(f"#!{sys.executable}\n" + _FAKE)
    path.chmod(0o755)
    paths[attr] = path
  log = tmp_path / "calls.jsonl"
  monkeypatch.setenv("FAKE_LLAMA_LOG", str(log))
  monkeypatch.delenv("FAKE_LLAMA_MODE", raising=False)

  def calls():
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

  return llamacpp.Tools(root=bin_dir, **paths), calls


@pytest.fixture
def gguf_files(tmp_path):
  """Two stand-in model files (only their existence is checked before the fake runs)."""
  target, draft = tmp_path / "target.gguf", tmp_path / "draft.gguf"
  target.write_bytes(b"GGUF")
  draft.write_bytes(b"GGUF")
  return target, draft


# Ends with a newline (llama.cpp's -f would drop it), holds a literal backslash-n
# (escape processing would turn it into a newline), a quote and non-ASCII.
TRICKY_PROMPT = 'def f(s):\n    """Split on \\n, café."""\n'


def _value(argv, flag):
  return argv[argv.index(flag) + 1]


def test_generate_target_passes_the_prompt_exactly_and_greedy(fake_tools, gguf_files):
  tools, calls = fake_tools
  result = llamacpp.generate(tools, gguf_files[0], TRICKY_PROMPT, 5, threads=3,
                             env={"OMP_WAIT_POLICY": "PASSIVE"})
  (call,) = calls()
  assert call["omp"] == "PASSIVE" and result["env"] == {"OMP_WAIT_POLICY": "PASSIVE"}
  argv = call["argv"]
  assert call["name"] == "llama-completion"
  assert call["prompt"] == TRICKY_PROMPT
  assert "--no-escape" in argv and "-no-cnv" in argv and "--no-display-prompt" in argv
  assert _value(argv, "--temp") == "0" and _value(argv, "--top-k") == "1"
  assert "--ignore-eos" not in argv and "-f" not in argv and "-p" not in argv
  assert _value(argv, "-n") == "5" and _value(argv, "-t") == "3"
  assert _value(argv, "-m") == str(gguf_files[0])
  assert int(_value(argv, "-c")) >= len(TRICKY_PROMPT.encode()) + 5
  assert result["mode"] == "target" and result["draft_max"] is None
  assert result["text"] == " t0 t1 t2 t3 t4"
  assert result["n_tokens"] == 5 and result["stopped_at_eog"] is False
  assert result["prompt_token_ids"] == list(TRICKY_PROMPT.encode())
  assert result["prompt_tokens"] == len(TRICKY_PROMPT.encode())
  assert result["tok_s_reported"] == 25.0
  assert result["timings"]["prompt_eval_tok_s"] == 1000.0
  assert result["wall_s"] > 0 and result["tok_s_wall"] == pytest.approx(5 / result["wall_s"], 1e-2)
  assert result["loadavg_1m"] >= 0 and result["attempts"] == 1


def test_generate_target_stops_at_eos(fake_tools, gguf_files, monkeypatch):
  tools, _ = fake_tools
  monkeypatch.setenv("FAKE_LLAMA_MODE", "eog")
  result = llamacpp.generate(tools, gguf_files[0], "x = ", 8)
  assert result["text"] == " t0 t1"
  assert result["n_tokens"] == 2 and result["stopped_at_eog"] is True


def test_generate_speculative_arguments_and_count(fake_tools, gguf_files):
  tools, calls = fake_tools
  result = llamacpp.generate(tools, gguf_files[0], TRICKY_PROMPT, 6, threads=2,
                             draft_path=gguf_files[1], draft_max=8)
  (call,) = calls()
  argv = call["argv"]
  assert call["name"] == "llama-speculative-simple"
  assert call["prompt"] == TRICKY_PROMPT
  assert _value(argv, "-md") == str(gguf_files[1])
  assert _value(argv, "--spec-type") == "draft-simple"
  assert _value(argv, "--spec-draft-n-max") == "8" and _value(argv, "-td") == "2"
  assert _value(argv, "-n") == "5"  # the tool makes one more than -n
  assert _value(argv, "--temp") == "0" and "--no-escape" in argv and "--ignore-eos" not in argv
  assert result["mode"] == "speculative" and result["draft_max"] == 8
  assert result["text"] == " t0 t1 t2 t3 t4 t5 t6 t7"  # what it made, past the 6 asked
  assert result["n_tokens"] == 8 and result["stopped_at_eog"] is False
  assert result["tok_s_reported"] == 58.0
  assert result["speculative"]["n_accept"] == 9 and result["speculative"]["accept_pct"] == 75.0
  assert result["prompt_tokens"] == len(TRICKY_PROMPT.encode())


def test_generate_speculative_stops_at_eos(fake_tools, gguf_files, monkeypatch):
  tools, _ = fake_tools
  monkeypatch.setenv("FAKE_LLAMA_MODE", "eog")
  result = llamacpp.generate(tools, gguf_files[0], "x = ", 8, draft_path=gguf_files[1],
                             draft_max=4)
  assert result["text"] == " t0 t1"
  assert result["n_tokens"] == 2 and result["stopped_at_eog"] is True


def test_generate_timeout_names_the_tool_and_its_stderr(fake_tools, gguf_files, monkeypatch):
  tools, _ = fake_tools
  monkeypatch.setenv("FAKE_LLAMA_MODE", "hang")
  with pytest.raises(llamacpp.LlamaCppError, match=r"llama-completion timed out after 2 s.*loaded meta"):
    llamacpp.generate(tools, gguf_files[0], "x", 4, timeout=2)


def test_generate_failure_gives_the_tail_of_stderr(fake_tools, gguf_files, monkeypatch):
  tools, _ = fake_tools
  monkeypatch.setenv("FAKE_LLAMA_MODE", "fail")
  with pytest.raises(llamacpp.LlamaCppError,
                     match=r"llama-speculative-simple exited with 1: .*'output.weight' not found"):
    llamacpp.generate(tools, gguf_files[0], "x", 4, draft_path=gguf_files[1], draft_max=2)


@pytest.mark.parametrize("speculative", [False, True])
def test_generate_reruns_a_run_whose_last_lines_were_lost(fake_tools, gguf_files, monkeypatch,
                                                           speculative):
  tools, calls = fake_tools
  draft = {"draft_path": gguf_files[1], "draft_max": 2} if speculative else {}
  monkeypatch.setenv("FAKE_LLAMA_MODE", "cut2")
  result = llamacpp.generate(tools, gguf_files[0], "x = ", 3, **draft)
  assert result["attempts"] == 3 and len(calls()) == 3
  assert result["text"].startswith(" t0 t1 t2")


def test_generate_gives_up_on_output_lost_every_time(fake_tools, gguf_files, monkeypatch):
  tools, calls = fake_tools
  monkeypatch.setenv("FAKE_LLAMA_MODE", "cut9")
  with pytest.raises(llamacpp.LlamaCppError,
                     match=r"llama-completion exited 0 without its last lines 3 times.*n_ctx = 512"):
    llamacpp.generate(tools, gguf_files[0], "x = ", 3)
  assert len(calls()) == 3


def test_generate_refuses_missing_files_and_bad_arguments(fake_tools, gguf_files, tmp_path):
  tools, calls = fake_tools
  with pytest.raises(llamacpp.LlamaCppError, match="no GGUF file at .*missing.gguf"):
    llamacpp.generate(tools, tmp_path / "missing.gguf", "x", 4)
  with pytest.raises(llamacpp.LlamaCppError, match="no GGUF file at .*nodraft.gguf"):
    llamacpp.generate(tools, gguf_files[0], "x", 4, draft_path=tmp_path / "nodraft.gguf",
                      draft_max=2)
  with pytest.raises(ValueError, match="n_predict"):
    llamacpp.generate(tools, gguf_files[0], "x", 0)
  with pytest.raises(ValueError, match="draft_max"):
    llamacpp.generate(tools, gguf_files[0], "x", 4, draft_path=gguf_files[1])
  gone = llamacpp.Tools(root=tmp_path, completion=tmp_path / "nope", speculative_simple=tmp_path,
                        speculative=tmp_path, bench=tmp_path, tokenize=tmp_path)
  with pytest.raises(llamacpp.LlamaCppError, match="nope not found"):
    llamacpp.generate(gone, gguf_files[0], "x", 4)
  assert calls() == []


def _suite_prompts():
  return [prompts_lib.Prompt("one", "code", "def one():\n"),
          prompts_lib.Prompt("two", "chat", "Say hi.", chat=True),
          prompts_lib.Prompt("three", "code", "def three():\n")]


class _FakeTokenizer:
  """Renders chat as '<|im_start|>user\\n...' and encodes to UTF-8 bytes (as the fake tool does)."""

  def apply_chat_template(self, messages):
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + \
        "<|im_start|>assistant\n"

  def encode(self, text):
    return list(text.encode("utf-8"))


def test_run_suite_sweeps_on_the_first_prompt_and_writes_json(fake_tools, gguf_files, tmp_path):
  tools, calls = fake_tools
  out = tmp_path / "res" / "llamacpp.json"
  doc = llamacpp.run_suite(tools, gguf_files[0], gguf_files[1], _suite_prompts(), 4, out,
                           sweep=(2, 4, 8), tokenizer=_FakeTokenizer(),
                           env={"OMP_WAIT_POLICY": "PASSIVE"})
  assert {c["omp"] for c in calls()} == {"PASSIVE"} and doc["config"]["env"]
  assert [s["draft_max"] for s in doc["sweep"]] == [2, 4, 8]
  assert doc["draft_max"] == 4  # the fake is fastest at 4
  spec_calls = [c for c in calls() if c["name"] == "llama-speculative-simple"]
  assert [_value(c["argv"], "--spec-draft-n-max") for c in spec_calls] == ["2", "4", "8", "4", "4"]
  chat_call = [c for c in calls() if c["name"] == "llama-completion"][1]
  assert chat_call["prompt"] == "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"
  assert [r["name"] for r in doc["prompts"]] == ["one", "two", "three"]
  first = doc["prompts"][0]
  assert first["speculative"]["draft_max"] == 4 and first["texts_agree"] is True
  assert first["prompt_ids_equal"] is True
  assert doc["complete"] is True
  assert doc["medians"]["target"]["tok_s_reported"] == 25.0
  assert doc["medians"]["speculative"]["tok_s_reported"] == 500.0
  assert doc["medians"]["speedup_reported"] == 20.0
  assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
  assert sorted(p.name for p in out.parent.iterdir()) == ["llamacpp.json"]  # no temp file left


def test_run_suite_keeps_whole_prompts_when_a_later_one_fails(fake_tools, gguf_files, tmp_path,
                                                              monkeypatch):
  tools, _ = fake_tools
  out = tmp_path / "llamacpp.json"
  real = llamacpp.generate

  def failing(tools, model, text, *args, **kwargs):
    if "three" in text:
      raise llamacpp.LlamaCppError("boom")
    return real(tools, model, text, *args, **kwargs)

  monkeypatch.setattr(llamacpp, "generate", failing)
  with pytest.raises(llamacpp.LlamaCppError, match="boom"):
    llamacpp.run_suite(tools, gguf_files[0], gguf_files[1], _suite_prompts(), 3, out,
                       sweep=(2,), tokenizer=_FakeTokenizer())
  doc = json.loads(out.read_text())
  assert [r["name"] for r in doc["prompts"]] == ["one", "two"] and doc["complete"] is False


def test_prompt_text_renders_chat_only_with_a_tokenizer():
  code, chat = _suite_prompts()[:2]
  assert llamacpp.prompt_text(code) == code.text
  assert llamacpp.prompt_text(chat, _FakeTokenizer()).endswith("<|im_start|>assistant\n")
  with pytest.raises(ValueError, match="chat template"):
    llamacpp.prompt_text(chat)


def test_texts_agree_allows_only_the_overshoot():
  cut = {"text": " a b", "stopped_at_eog": False}
  ended = {"text": " a b", "stopped_at_eog": True}
  assert llamacpp.texts_agree(cut, {"text": " a b c"})
  assert not llamacpp.texts_agree(cut, {"text": " a c d"})
  assert llamacpp.texts_agree(ended, {"text": " a b"})
  assert not llamacpp.texts_agree(ended, {"text": " a b c"})


def test_medians_and_speedups():
  rec = lambda t, s: {"target": {"tok_s_reported": t, "tok_s_wall": t / 2, "n_tokens": 8},
                      "speculative": {"tok_s_reported": s, "tok_s_wall": s / 4, "n_tokens": 8}}
  m = llamacpp.medians([rec(10.0, 20.0), rec(20.0, 30.0), rec(30.0, 90.0)])
  assert m["target"]["tok_s_reported"] == 20.0 and m["speculative"]["tok_s_reported"] == 30.0
  assert m["speedup_reported"] == 2.0 and m["speedup_wall"] == 1.0
  assert m["target"]["prompts"] == 3


def test_main_rejects_bad_arguments_before_building(monkeypatch, capsys):
  monkeypatch.setattr(llamacpp, "build", lambda **kw: pytest.fail("built"))
  for argv in (["--sweep", "0,4"], ["--sweep", "a"], ["--max-new-tokens", "0"],
               ["--prompts", "no_such_prompt"]):
    with pytest.raises(SystemExit) as e:
      llamacpp.main(argv)
    assert e.value.code == 2


# --- the build's cache -----------------------------------------------------------------------


def test_build_key_names_version_and_changes_with_cpu_flags():
  key = llamacpp.build_key("avx2 fma sse4_2")
  assert key.startswith(f"{llamacpp.VERSION}-")
  assert key == llamacpp.build_key("avx2 fma sse4_2")
  assert key != llamacpp.build_key("avx2 avx512f fma sse4_2")
  assert llamacpp.build_key() == llamacpp.build_key(llamacpp.cpu_flags())


# The logger set-up of llama.cpp 0.3.36's common/log.cpp, around the line the exit flush follows.
_LOG_CPP = """struct common_log * common_log_main() {
    static struct common_log * log;
    static std::once_flag    init_flag;
    std::call_once(init_flag, [&]() {
        log = new common_log;
        // Set default to auto-detect colors
        log->set_colors(tty_can_use_colors());
    });

    return log;
}

void common_log_set_colors(struct common_log * log, log_colors colors) {
    if (colors == LOG_COLORS_AUTO) {
        log->set_colors(tty_can_use_colors());
        return;
    }
}
"""


def test_patch_source_flushes_the_log_at_exit_once_inside_the_set_up(tmp_path):
  (tmp_path / "common").mkdir()
  log_cpp = tmp_path / "common" / "log.cpp"
  log_cpp.write_text(_LOG_CPP)
  llamacpp.patch_source(tmp_path)
  lines = log_cpp.read_text().splitlines()
  assert lines[0] == "#include <cstdlib>"
  flush = [i for i, line in enumerate(lines) if "common_log_pause(log)" in line]
  assert len(flush) == 1 and "std::atexit" in lines[flush[0]]
  assert lines[flush[0] - 1].strip() == "log->set_colors(tty_can_use_colors());"
  assert lines[flush[0] - 3].strip() == "log = new common_log;"
  assert lines[flush[0] + 1].strip() == "});"
  assert [p.name for p in (tmp_path / "common").iterdir()] == ["log.cpp"]


def test_patch_source_refuses_a_logger_it_was_not_written_for(tmp_path):
  (tmp_path / "common").mkdir()
  (tmp_path / "common" / "log.cpp").write_text(_LOG_CPP.replace("log = new common_log;", "log = make();"))
  with pytest.raises(llamacpp.LlamaCppError, match=r"has 0 copies .* expected exactly 1"):
    llamacpp.patch_source(tmp_path)


def test_build_key_changes_with_the_source_patch(monkeypatch):
  key = llamacpp.build_key("avx2 fma")
  monkeypatch.setattr(llamacpp, "_LOG_PATCH", llamacpp._LOG_PATCH.replace("pause", "flush"))  # pylint: disable=protected-access
  assert llamacpp.build_key("avx2 fma") != key


def _fake_binaries(directory, names=None):
  directory.mkdir(parents=True, exist_ok=True)
  for name in names or llamacpp.TARGETS:
    (directory / name).write_text("#!/bin/sh\n")
    (directory / name).chmod(0o755)
  return directory


@pytest.fixture
def fake_pipeline(monkeypatch):
  """Replaces download, extraction and compilation; returns the list of compile calls."""
  compiled = []
  produce = {"names": None}

  def compile_(source, build_dir, log, progress, jobs, found):
    compiled.append(jobs)
    produce["compiled_log_cpp"] = (source / "common" / "log.cpp").read_text()
    return _fake_binaries(build_dir / "bin", produce["names"])

  def extract(sdist, directory):
    (directory / "common").mkdir(parents=True)
    (directory / "common" / "log.cpp").write_text(_LOG_CPP)
    return directory

  monkeypatch.setattr(llamacpp, "_download_sdist", lambda d, log, progress: d / "x.tar.gz")
  monkeypatch.setattr(llamacpp, "_extract_vendor", extract)
  monkeypatch.setattr(llamacpp, "_compile", compile_)
  return compiled, produce


def test_build_builds_once_then_returns_the_cached_tools(tmp_path, fake_pipeline, monkeypatch):
  compiled, produce = fake_pipeline
  tools = llamacpp.build(cache_dir=tmp_path, jobs=2)
  assert compiled == [2]
  assert "std::atexit([]() { common_log_pause(log); });" in produce["compiled_log_cpp"]
  assert tools.root == tmp_path / llamacpp.build_key()
  assert tools.completion == tools.root / "llama-completion" and tools.completion.is_file()
  manifest = json.loads((tools.root / "build.json").read_text())
  assert manifest["version"] == llamacpp.VERSION and manifest["key"] == tools.root.name
  assert sorted(p.name for p in tmp_path.iterdir()) == sorted([tools.root.name,
                                                               tools.root.name + ".lock"])
  monkeypatch.setattr(llamacpp.subprocess, "run", lambda *a, **k: pytest.fail("ran a process"))
  assert llamacpp.build(cache_dir=tmp_path) == tools
  assert compiled == [2]
  assert llamacpp.find_built(tmp_path) == tools


def test_build_never_leaves_a_half_built_directory(tmp_path, fake_pipeline):
  compiled, produce = fake_pipeline
  produce["names"] = ["llama-completion", "llama-bench"]
  with pytest.raises(llamacpp.LlamaCppError, match="produced no llama-speculative-simple"):
    llamacpp.build(cache_dir=tmp_path)
  assert [p.name for p in tmp_path.iterdir()] == [llamacpp.build_key() + ".lock"]
  assert llamacpp.find_built(tmp_path) is None


def test_build_replaces_an_incomplete_directory(tmp_path, fake_pipeline):
  compiled, _ = fake_pipeline
  stale = _fake_binaries(tmp_path / llamacpp.build_key(), ["llama-completion"])
  (stale / "build.json").write_text("{}")
  tools = llamacpp.build(cache_dir=tmp_path)
  assert compiled and tools.tokenize.is_file()


def test_build_names_missing_cmake_and_compiler(tmp_path, monkeypatch):
  monkeypatch.setattr(llamacpp.shutil, "which",
                      lambda name: None if name in ("cmake", "c++", "g++", "clang++") else "/x/" + name)
  with pytest.raises(llamacpp.LlamaCppError, match=r"no cmake, no C\+\+ compiler on PATH"):
    llamacpp.build(cache_dir=tmp_path)


def test_build_reports_a_refused_download(tmp_path, monkeypatch):
  pip = tmp_path / "python"
  pip.write_text("#!/bin/sh\necho 'ERROR: No matching distribution found for llama-cpp-python' >&2\n"
                 "exit 1\n")
  pip.chmod(0o755)
  monkeypatch.setattr(llamacpp.sys, "executable", str(pip))
  cache = tmp_path / "cache"
  with pytest.raises(llamacpp.LlamaCppError,
                     match=r"pip download of llama-cpp-python==0.3.36 failed \(exit 1\): .*No matching"):
    llamacpp.build(cache_dir=cache)
  assert [p.name for p in cache.iterdir()] == [llamacpp.build_key() + ".lock"]


def test_build_refuses_an_sdist_with_the_wrong_hash(tmp_path, monkeypatch):
  pip = tmp_path / "python"
  pip.write_text(f"#!/bin/sh\nfor a; do d=$a; done\nmkdir -p $d\necho junk > $d/{llamacpp.SDIST_NAME}\n")
  pip.chmod(0o755)
  monkeypatch.setattr(llamacpp.sys, "executable", str(pip))
  with pytest.raises(llamacpp.LlamaCppError, match=r"has sha256 \w+, expected 832db069"):
    llamacpp.build(cache_dir=tmp_path / "cache")


def test_extract_vendor_takes_only_llama_cpp_and_refuses_escapes(tmp_path):
  import io
  import tarfile

  def sdist(members):
    path = tmp_path / f"s{len(list(tmp_path.iterdir()))}.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
      for name in members:
        info = tarfile.TarInfo(name)
        info.size = 2
        tar.addfile(info, io.BytesIO(b"ok"))
    return path

  prefix = llamacpp._VENDOR_PREFIX  # pylint: disable=protected-access
  src = llamacpp._extract_vendor(sdist([prefix + "CMakeLists.txt", "llama_cpp_python-0.3.36/setup.py"]),
                                 tmp_path / "a")
  assert (src / "CMakeLists.txt").read_text() == "ok"
  assert not (tmp_path / "a" / "llama_cpp_python-0.3.36" / "setup.py").exists()
  with pytest.raises(llamacpp.LlamaCppError, match="holds no"):
    llamacpp._extract_vendor(sdist(["other/CMakeLists.txt"]), tmp_path / "b")
  with pytest.raises(llamacpp.LlamaCppError, match="cannot extract"):
    llamacpp._extract_vendor(sdist([prefix + "a.txt", prefix + "../../../../evil"]), tmp_path / "c")
  assert not (tmp_path / "evil").exists()


# --- the real tools, where this host has them built --------------------------------------


def _built_tools():
  """The real tools from the user's jspec cache (conftest points JSPEC_CACHE at a temp dir)."""
  import platformdirs
  for root in (None, pathlib.Path(platformdirs.user_cache_dir("jspec")) / "llamacpp"):
    tools = llamacpp.find_built(root)
    if tools is not None:
      return tools
  return None


@pytest.fixture(scope="module")
def real_tools():
  tools = _built_tools()
  if tools is None:
    pytest.skip("llama.cpp's tools are not built on this host (python -m bench.llamacpp builds"
                " them: 20 to 30 minutes on 2 shared cores)")
  return tools


@pytest.fixture
def tiny_gguf(tmp_path, make_hf_model, write_gguf):
  """A tiny random Qwen2 in a GGUF file llama.cpp loads (its head size must divide the width)."""
  model = make_hf_model(seed=3, hidden_size=64, head_dim=16, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=37)
  return write_gguf(tmp_path / "tiny.gguf", model)


def test_real_tools_greedy_target_and_speculative_agree(real_tools, tiny_gguf):
  from jspec import tokenizer as tokenizer_lib
  prompt = 'def the(x):\n    """12 <|im_start|> the\\n"""\n'
  target = llamacpp.generate(real_tools, tiny_gguf, prompt, 12, threads=1, timeout=120)
  spec = llamacpp.generate(real_tools, tiny_gguf, prompt, 12, threads=1, draft_path=tiny_gguf,
                           draft_max=3, timeout=120)
  # llama.cpp's prompt ids are jspec's (the same GGUF vocabulary, special tokens parsed).
  assert target["prompt_token_ids"] == tokenizer_lib.from_gguf(tiny_gguf).encode(prompt)
  assert spec["prompt_tokens"] == target["prompt_tokens"]
  assert target["n_tokens"] >= 1 and target["timings"]["prompt_eval_tokens"] == target["prompt_tokens"]
  # A model drafting for itself: greedy speculative decoding is lossless.
  assert llamacpp.texts_agree(target, spec) and spec["n_tokens"] >= target["n_tokens"]
  assert spec["speculative"]["n_drafted"] >= spec["speculative"]["n_accept"] > 0
  assert target["tok_s_reported"] is None or target["tok_s_reported"] > 0


# --- llama.cpp as a peer in `python -m bench` (the fake tools above) ------------------------


@pytest.fixture
def vocab_gguf(tmp_path, write_gguf):
  """A vocabulary-only GGUF: the peer phase reads its tokenizer; the fake tools never open it."""
  return write_gguf(tmp_path / "pair.gguf")


def _peer_run(tmp_path, gguf, modes="target,spec_g2,llamacpp", reps=2, draft_max=8):
  """A bench document as the jspec phase leaves it, on two code prompts of the tiny vocabulary.

  Returns:
    (opts, doc, out, chosen, prompt list, mode order, tokenizer, jspec target texts by prompt).
  """
  from bench import __main__ as bench_main
  from bench import modes as modes_lib
  from bench import results
  from bench import runner
  from jspec import tokenizer as tokenizer_lib
  opts = bench_main._defaults(bench_main.build_parser().parse_args(  # pylint: disable=protected-access
      ["--modes", modes, "--gammas", "2", "--reps", str(reps), "--max-new-tokens", "6",
       "--llamacpp-draft-max", str(draft_max), "--out", str(tmp_path / "run.json")]))
  every = modes_lib.all_modes(opts.gammas, 8, 0.5, 4, 3, llamacpp_draft_max=opts.llamacpp_draft_max)
  chosen = modes_lib.select(every, opts.modes, llamacpp=not opts.no_llamacpp)
  tok = tokenizer_lib.from_gguf(gguf)
  prompt_list = [prompts_lib.Prompt("one", "code", "def one():\n"),
                 prompts_lib.Prompt("two", "edit", "def the(x):\n", chat=True)]
  eos = tok.eos_token_ids
  # "one" reaches EOS after its text (llama.cpp stops there); "two" runs to the budget.
  ids = {"one": tok.encode("  return 1\n") + [eos[0]] + tok.encode("junk"),
         "two": tok.encode("  return x + 12")}
  doc = results.new(runner._settings(opts, chosen, prompt_list))  # pylint: disable=protected-access
  doc["models"] = {"source": f"paths: target {gguf}, draft {gguf}", "eos_token_ids": eos,
                   "hf_source": {"kind": "gguf", "target": str(gguf), "draft": str(gguf)}}
  for p, speed in zip(prompt_list, (1.0, 2.0)):
    doc["prompts"][p.name] = {"kind": p.kind, "chat": p.chat, "text": p.text,
                              "prompt_ids": prompts_lib.encode(p, tok), "modes": {
        "target": {"engine": "jspec", "token_ids": ids[p.name], "tokens_per_s": 10.0 * speed,
                   "decode_tokens_per_s": 20.0 * speed},
        "spec_g2": {"engine": "jspec", "token_ids": ids[p.name], "tokens_per_s": 15.0 * speed,
                    "decode_tokens_per_s": 29.0 * speed}}}
  order = [m.name for m in chosen]
  texts = {"one": "  return 1\n", "two": "  return x + 12"}
  return opts, doc, tmp_path / "run.json", chosen, prompt_list, order, tok, texts


def test_bench_peer_phase_keeps_each_prompts_fastest_draft_length(fake_tools, vocab_gguf, tmp_path,
                                                                   monkeypatch):
  from bench import runner
  tools, calls = fake_tools
  monkeypatch.setattr(llamacpp, "find_built", lambda cache_dir=None: tools)
  opts, doc, out, chosen, prompt_list, order, _, _ = _peer_run(
      tmp_path, vocab_gguf, modes="target,llamacpp", draft_max="2,4,8")
  assert opts.llamacpp_draft_max == [2, 4, 8]
  runner._llamacpp_phase(opts, doc, out, chosen, prompt_list, order)  # pylint: disable=protected-access
  made = [c for c in calls() if c["name"] != "llama-bench"]
  # Each repetition runs the target, then every draft length, alternated.
  assert [_value(c["argv"], "--spec-draft-n-max") if c["name"] == "llama-speculative-simple"
          else None for c in made] == [None, "2", "4", "8"] * 4
  saved = json.loads(out.read_text())
  for name in ("one", "two"):
    spec = saved["prompts"][name]["modes"]["llamacpp_spec"]
    assert spec["draft_max"] == 4 and spec["decode_tokens_per_s"] == 500.0  # the fake's fastest
    assert len(spec["reps"]) == 2
    assert [(s["draft_max"], s["decode_tokens_per_s"]) for s in spec["draft_max_sweep"]] == \
        [(2, 52.0), (4, 500.0), (8, 58.0)]
    assert "draft_max_sweep" not in saved["prompts"][name]["modes"]["llamacpp_target"]


def test_bench_peer_phase_stops_for_the_run_after_a_failure(fake_tools, vocab_gguf, tmp_path,
                                                             monkeypatch):
  # Called prompt by prompt (`runner.run`), one failure ends the peers, as in one phase.
  from bench import runner
  tools, calls = fake_tools
  monkeypatch.setattr(llamacpp, "find_built", lambda cache_dir=None: tools)
  monkeypatch.setenv("FAKE_LLAMA_MODE", "fail")
  opts, doc, out, chosen, prompt_list, order, _, _ = _peer_run(tmp_path, vocab_gguf,
                                                               modes="target,llamacpp")
  memo = {}
  runner._llamacpp_phase(opts, doc, out, chosen, prompt_list[:1], order, memo)  # pylint: disable=protected-access
  runs = [c for c in calls() if c["name"] != "llama-bench"]
  assert len(runs) == 1 and "error loading model" in doc["llamacpp"]["error"]
  runner._llamacpp_phase(opts, doc, out, chosen, prompt_list[1:], order, memo)  # pylint: disable=protected-access
  runner._llamacpp_phase(opts, doc, out, chosen, prompt_list, order, memo)  # pylint: disable=protected-access
  assert len([c for c in calls() if c["name"] != "llama-bench"]) == 1
  assert len([c for c in calls() if c["name"] == "llama-bench"]) == 4  # the probe, once
  assert "error loading model" in doc["llamacpp"]["error"]


def test_bench_rejects_a_bad_draft_length_list():
  from bench import __main__ as bench_main
  for bad in ("4,x", "0,4", ""):
    with pytest.raises(SystemExit):
      bench_main.build_parser().parse_args(["--llamacpp-draft-max", bad])


def _texts_file(tmp_path, monkeypatch, mapping):
  path = tmp_path / "texts.json"
  path.write_text(json.dumps(mapping))
  monkeypatch.setenv("FAKE_LLAMA_TEXTS", str(path))


def test_bench_peer_phase_records_ratios_and_texts(fake_tools, vocab_gguf, tmp_path,
                                                   monkeypatch):
  from bench import report
  from bench import runner
  tools, calls = fake_tools
  monkeypatch.setattr(llamacpp, "find_built", lambda cache_dir=None: tools)
  opts, doc, out, chosen, prompt_list, order, tok, texts = _peer_run(tmp_path, vocab_gguf)
  # "one": llama.cpp stops at end of generation where jspec's ids reach EOS, the same text;
  # "two": its text parts from jspec's at char 11; its speculative text runs on past its own.
  chat = llamacpp.prompt_text(prompt_list[1], tok)  # through the GGUF's chat template
  _texts_file(tmp_path, monkeypatch, {
      "def one():\n": {"target": texts["one"], "spec": texts["one"], "eog": True},
      chat: {"target": "  return x - 12", "spec": "  return x - 12 + 3"}})
  runner._llamacpp_phase(opts, doc, out, chosen, prompt_list, order)  # pylint: disable=protected-access
  assert [m.name for m in chosen] == ["target", "spec_g2", "llamacpp_target", "llamacpp_spec"]
  made = calls()
  # First llama-bench under each OpenMP wait policy, twice, alternated; the faster is kept.
  probes = [c for c in made if c["name"] == "llama-bench"]
  assert [c["omp"] for c in probes] == ["PASSIVE", "ACTIVE"] * 2
  assert {_value(c["argv"], "-t") for c in probes} == {"2"}
  made = [c for c in made if c["name"] != "llama-bench"]
  # Two repetitions of each mode per prompt, alternating; the prompt text as jspec's.
  assert [c["name"] for c in made] == ["llama-completion", "llama-speculative-simple"] * 4
  assert [c["prompt"] for c in made] == ["def one():\n"] * 4 + [chat] * 4
  assert chat.startswith("<|im_start|>user\ndef the(x):\n<|im_end|>")
  assert {_value(c["argv"], "--spec-draft-n-max") for c in made[1::2]} == {"8"}
  assert {_value(c["argv"], "-t") for c in made} == {"2"} and {c["omp"] for c in made} == {"ACTIVE"}
  assert {_value(c["argv"], "-n") for c in made[::2]} == {"6"}  # jspec's max_new_tokens
  saved = json.loads(out.read_text())
  assert saved["llamacpp"]["target"] == str(vocab_gguf) and "skipped" not in saved["llamacpp"]
  assert saved["llamacpp"]["env"] == {"OMP_WAIT_POLICY": "ACTIVE"}
  assert saved["llamacpp"]["wait_policy_probe"]["tokens_per_s"] == {"PASSIVE": 10.0, "ACTIVE": 20.0}
  one, two = (saved["prompts"][p]["modes"] for p in ("one", "two"))
  lt = two["llamacpp_target"]
  assert lt["engine"] == "llamacpp" and lt["text"] == "  return x - 12" and len(lt["reps"]) == 2
  assert lt["decode_tokens_per_s"] == 25.0 and lt["tokens_per_s"] == pytest.approx(6 / 0.15, 1e-3)
  assert two["llamacpp_spec"]["decode_tokens_per_s"] == 58.0  # the fake's speed at draft_max 8
  assert lt["jspec_text"] == texts["two"] and not lt["jspec_reached_eos"]
  assert one["llamacpp_target"]["jspec_text"] == texts["one"]  # cut at jspec's first EOS
  assert one["llamacpp_target"]["jspec_reached_eos"] and one["llamacpp_target"]["stopped_at_eog"]
  # llama.cpp's prompt ids (bytes, in the fake) against jspec's: "the" is one merge in the vocab.
  assert one["llamacpp_target"]["prompt_ids_equal"] and not lt["prompt_ids_equal"]
  # Ratios: jspec over each llama.cpp mode, per prompt and as medians per kind.
  spec = two["spec_g2"]
  assert spec["decode_speedup_vs_llamacpp_target"] == pytest.approx(58.0 / 25.0)
  assert spec["decode_speedup_vs_llamacpp_spec"] == pytest.approx(58.0 / 58.0)
  assert spec["speedup_vs_llamacpp_target"] == pytest.approx(30.0 / lt["tokens_per_s"])
  assert one["target"]["decode_speedup_vs_llamacpp_target"] == pytest.approx(20.0 / 25.0)
  summary = saved["summary"]
  assert summary["spec_g2"]["decode_speedup_vs_llamacpp_target"] == pytest.approx(
      (29.0 / 25.0 + 58.0 / 25.0) / 2)
  assert summary["spec_g2"]["by_kind"]["edit"]["decode_speedup_vs_llamacpp_spec"] == \
      pytest.approx(1.0)
  assert summary["llamacpp_spec"]["decode_tokens_per_s"] == 58.0
  # Texts: equal on "one"; on "two" where they part, with a piece of each.
  agree = saved["llamacpp_agreement"]
  assert agree["one"]["llamacpp_target"]["equal"] and agree["one"]["llamacpp_spec"]["equal"]
  bad = agree["two"]["llamacpp_target"]
  assert (bad["equal"], bad["first_diff_char"], bad["excerpt_from"]) == (False, 11, 1)
  assert bad["expected"] == " return x + 12" and bad["got"] == " return x - 12"
  assert agree["two"]["llamacpp_spec"]["equal"]  # its target's text, run on past the budget
  assert saved["gate"]["passed"]  # informative, not the gate
  text = report.render(saved, order)
  assert "llama.cpp target-only text equals jspec target-only's" in text and "1/2 prompts" in text
  assert "two: they part at char 11" in text and "no@11" in text
  assert "x lcpp dec" in text and "x lcpp+spec" in text
  from bench import plots
  written = plots.write_all(saved, out, order)
  assert str(tmp_path / "run.vs_llamacpp.png") in written
  with open(tmp_path / "run.vs_llamacpp.png", "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_bench_peer_phase_resumes_and_skips_with_reasons(fake_tools, vocab_gguf, tmp_path,
                                                        monkeypatch):
  from bench import runner
  tools, calls = fake_tools
  built = {"tools": None}
  monkeypatch.setattr(llamacpp, "find_built", lambda cache_dir=None: built["tools"])
  opts, doc, out, chosen, prompt_list, order, _, _ = _peer_run(tmp_path, vocab_gguf, reps=1)
  opts.llamacpp_wait_policy = "passive"  # no llama-bench probe: the calls counted are the runs
  # Not built: one line naming the command that builds them; nothing runs.
  runner._llamacpp_phase(opts, doc, out, chosen, prompt_list, order)  # pylint: disable=protected-access
  assert llamacpp.BUILD_COMMAND in doc["llamacpp"]["skipped"] and calls() == []
  assert "\n" not in doc["llamacpp"]["skipped"]
  built["tools"] = tools
  runner._llamacpp_phase(opts, doc, out, chosen, prompt_list, order)  # pylint: disable=protected-access
  assert len(calls()) == 4 and "skipped" not in doc["llamacpp"]
  first = json.loads(out.read_text())
  # Resumed: a prompt's records are kept; only the missing one is measured.
  del doc["prompts"]["two"]["modes"]["llamacpp_spec"]
  runner._llamacpp_phase(opts, doc, out, chosen, prompt_list, order)  # pylint: disable=protected-access
  assert [c["name"] for c in calls()[4:]] == ["llama-speculative-simple"]
  assert doc["prompts"]["one"]["modes"]["llamacpp_target"] == \
      first["prompts"]["one"]["modes"]["llamacpp_target"]
  runner._llamacpp_phase(opts, doc, out, chosen, prompt_list, order)  # pylint: disable=protected-access
  assert len(calls()) == 5
  # Models that are no GGUF pair (smoke, random weights, HF directories) skip with their source.
  doc["models"] = {"source": "smoke: tiny random models", "hf_source": {"kind": "random"}}
  del doc["prompts"]["one"]["modes"]["llamacpp_target"]
  runner._llamacpp_phase(opts, doc, out, chosen, prompt_list, order)  # pylint: disable=protected-access
  assert doc["llamacpp"]["skipped"] == ("llama.cpp runs GGUF files, and this run's models are "
                                        "not a GGUF pair (smoke: tiny random models)")
  assert len(calls()) == 5


def test_bench_peer_phase_keeps_finished_prompts_when_llamacpp_fails(fake_tools, vocab_gguf,
                                                                    tmp_path, monkeypatch):
  from bench import runner
  tools, _ = fake_tools
  monkeypatch.setattr(llamacpp, "find_built", lambda cache_dir=None: tools)
  opts, doc, out, chosen, prompt_list, order, _, _ = _peer_run(tmp_path, vocab_gguf, reps=1)
  real = llamacpp.generate

  def failing(tools, model, text, *args, **kwargs):
    if "the" in text:
      raise llamacpp.LlamaCppError("llama-completion exited with 1: boom")
    return real(tools, model, text, *args, **kwargs)

  monkeypatch.setattr(llamacpp, "generate", failing)
  runner._llamacpp_phase(opts, doc, out, chosen, prompt_list, order)  # pylint: disable=protected-access
  saved = json.loads(out.read_text())
  assert saved["llamacpp"]["error"] == "two: llama-completion exited with 1: boom"
  assert "llamacpp_spec" in saved["prompts"]["one"]["modes"]
  assert "llamacpp_target" not in saved["prompts"]["two"]["modes"]


def test_bench_selects_the_llamacpp_peers_and_refuses_bad_settings(capsys, monkeypatch):
  from bench import __main__ as bench_main
  from bench import modes as modes_lib
  from bench import runner
  monkeypatch.setattr(runner, "run", lambda *a, **k: pytest.fail("a bad setting reached the run"))
  every = modes_lib.all_modes([2], 8, 0.5, 4, 3, llamacpp_draft_max=5, llamacpp_threads=3)
  names = lambda spec, **kw: [m.name for m in modes_lib.select(every, spec, **kw)]
  assert names("llamacpp") == ["target", "llamacpp_target", "llamacpp_spec"]
  assert names("llamacpp_spec,hf", llamacpp=False) == ["target", "hf_target", "hf_assisted"]
  assert "llamacpp_target" in names(None) and "llamacpp_spec" not in names(None, llamacpp=False)
  spec = {m.name: m for m in every}["llamacpp_spec"]
  assert modes_lib.describe(spec) == {"engine": "llamacpp", "group": "llamacpp", "gamma": None,
                                      "threads": 3, "draft_max": 5}
  for argv in (["--llamacpp-draft-max", "0"], ["--llamacpp-draft-max", "x"],
               ["--llamacpp-threads", "0"]):
    with pytest.raises(SystemExit) as e:
      bench_main.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("python -m bench: error: argument --llamacpp-")


def test_main_build_only_builds_and_runs_nothing(monkeypatch, capsys, tmp_path):
  built = []
  monkeypatch.setattr(llamacpp, "build", lambda **kw: built.append(kw) or llamacpp.Tools(
      tmp_path, *(tmp_path / n for n in llamacpp.TARGETS)))
  monkeypatch.setattr(llamacpp, "run_suite", lambda *a, **k: pytest.fail("ran the suite"))
  assert llamacpp.main(llamacpp.BUILD_COMMAND.split()[3:]) == 0
  assert built == [{"progress": True, "jobs": None}]
  assert str(tmp_path) in capsys.readouterr().out


def test_main_fastest_wait_policy_probes_then_runs_the_suite_under_the_faster(
    fake_tools, gguf_files, monkeypatch, tmp_path):
  from jspec import fetch
  from jspec import tokenizer as tokenizer_lib
  tools, calls = fake_tools
  suites = []
  monkeypatch.setattr(llamacpp, "build", lambda **kw: tools)
  monkeypatch.setattr(fetch, "get_source", lambda name: name)
  monkeypatch.setattr(fetch, "assemble", lambda source: gguf_files[0])
  monkeypatch.setattr(tokenizer_lib, "from_gguf", lambda path: None)
  monkeypatch.setattr(llamacpp, "run_suite", lambda *a: suites.append(a) or {
      "medians": {"target": {"tok_s_reported": 1, "tok_s_wall": 1},
                  "speculative": {"tok_s_reported": 1, "tok_s_wall": 1}}, "draft_max": 4})
  assert llamacpp.main(["--prompts", "1", "--omp-wait-policy", "fastest",
                        "--out", str(tmp_path / "x.json")]) == 0
  assert [c["omp"] for c in calls()] == ["PASSIVE", "ACTIVE"] * 2  # the fake: ACTIVE is faster
  assert suites[0][-1] == {"OMP_WAIT_POLICY": "ACTIVE"}


@pytest.mark.slow
def test_bench_takes_each_prompts_llamacpp_records_right_after_jspecs(fake_tools, tiny_gguf,
                                                                      tmp_path, monkeypatch):
  from bench import __main__ as bench_main
  from bench import engine
  tools, every_call = fake_tools
  monkeypatch.setattr(llamacpp, "find_built", lambda cache_dir=None: tools)
  order = []
  run_modes = engine.run_modes
  monkeypatch.setattr(engine, "run_modes", lambda bundle, ids, *a, **k: order.append(
      ("jspec", len(every_call()))) or run_modes(bundle, ids, *a, **k))
  out = tmp_path / "two.json"
  assert bench_main.main(["--target", str(tiny_gguf), "--draft", str(tiny_gguf),
                          "--prompts", "quicksort,dijkstra", "--modes", "target,llamacpp",
                          "--max-new-tokens", "4", "--reps", "1", "--no-hf",
                          "--llamacpp-draft-max", "3", "--bandwidth-bytes", str(16 << 20),
                          "--out", str(out)]) == 0
  runs = [c for c in every_call() if c["name"] != "llama-bench"]
  probes = [c for c in every_call() if c["name"] == "llama-bench"]
  doc = json.loads(out.read_text())
  texts = [doc["prompts"][p]["text"] for p in ("quicksort", "dijkstra")]
  # quicksort's jspec records, the probe (once), its llama.cpp records, then dijkstra's.
  assert len(probes) == 4 and [c["prompt"] for c in runs] == [texts[0]] * 2 + [texts[1]] * 2
  assert order == [("jspec", 0), ("jspec", len(probes) + 2)]


@pytest.mark.slow
def test_bench_runs_llamacpp_beside_jspec_on_a_gguf_pair_and_resumes(fake_tools, tiny_gguf,
                                                                    tmp_path, monkeypatch,
                                                                    capsys):
  # `python -m bench` end to end on a tiny GGUF pair, with the fake tools as llama.cpp's.
  from bench import __main__ as bench_main
  tools, every_call = fake_tools
  calls = lambda: [c for c in every_call() if c["name"] != "llama-bench"]  # runs, not probes
  monkeypatch.setattr(llamacpp, "find_built", lambda cache_dir=None: tools)
  out = tmp_path / "gguf.json"
  args = ["--target", str(tiny_gguf), "--draft", str(tiny_gguf), "--prompts", "quicksort",
          "--modes", "target,spec_g2,llamacpp", "--gammas", "2", "--max-new-tokens", "8",
          "--reps", "1", "--no-hf", "--llamacpp-draft-max", "3",
          "--bandwidth-bytes", str(16 << 20), "--out", str(out)]
  assert bench_main.main(args) == 0
  doc = json.loads(out.read_text())
  entry = doc["prompts"]["quicksort"]
  assert set(entry["modes"]) == {"target", "spec_g2", "llamacpp_target", "llamacpp_spec"}
  assert [c["prompt"] for c in calls()] == [entry["text"]] * 2
  assert [c["omp"] for c in every_call()[:4]] == ["PASSIVE", "ACTIVE"] * 2  # the probe came first
  assert doc["llamacpp"]["env"] == {"OMP_WAIT_POLICY": "ACTIVE"}
  assert _value(calls()[1]["argv"], "--spec-draft-n-max") == "3"
  assert doc["llamacpp"]["draft"] == str(tiny_gguf) and "llamacpp" in doc["runs"][-1]["phases_s"]
  assert doc["settings"]["mode_args"]["llamacpp_spec"]["draft_max"] == 3
  assert entry["modes"]["spec_g2"]["decode_speedup_vs_llamacpp_target"] is not None
  assert doc["summary"]["spec_g2"]["decode_speedup_vs_llamacpp_spec"] is not None
  # The fake's " t0 t1 ..." is not the random model's text: reported, not a failure.
  mismatch = doc["llamacpp_agreement"]["quicksort"]["llamacpp_target"]
  assert not mismatch["equal"] and mismatch["got"].startswith(" t0 t1")
  assert any(p.endswith(".vs_llamacpp.png") for p in doc["plots"])
  printed = capsys.readouterr().out
  assert "quicksort: they part at char" in printed and "x lcpp+spec dec" in printed
  # Resumed with llama.cpp's records gone and a fake that now writes jspec's text: only
  # llama.cpp runs again (jspec's records are kept), and the texts agree.
  jspec_text = entry["modes"]["llamacpp_target"]["jspec_text"]
  _texts_file(tmp_path, monkeypatch, {entry["text"]: {"target": jspec_text, "spec": jspec_text}})
  for mode in ("llamacpp_target", "llamacpp_spec"):
    del entry["modes"][mode]
  out.write_text(json.dumps(doc))
  assert bench_main.main(args + ["--resume"]) == 0
  again = json.loads(out.read_text())
  assert again["prompts"]["quicksort"]["modes"]["spec_g2"]["reps"] == entry["modes"]["spec_g2"]["reps"]
  assert again["llamacpp_agreement"]["quicksort"]["llamacpp_target"]["equal"]
  assert again["llamacpp_agreement"]["quicksort"]["llamacpp_spec"]["equal"]
  assert len(calls()) == 4 and len(again["runs"]) == 2
  # Once more: every record is there, nothing runs.
  assert bench_main.main(args + ["--resume"]) == 0
  assert len(calls()) == 4
  assert json.loads(out.read_text())["prompts"]["quicksort"]["modes"]["llamacpp_target"] == \
      again["prompts"]["quicksort"]["modes"]["llamacpp_target"]


@pytest.mark.parametrize("fast", ["PASSIVE", "ACTIVE"])
def test_bench_peer_phase_runs_under_the_faster_wait_policy(fake_tools, vocab_gguf, tmp_path,
                                                            monkeypatch, fast):
  """Whichever OpenMP wait policy llama-bench finds faster here is the one every run gets."""
  from bench import runner
  tools, calls = fake_tools
  monkeypatch.setattr(llamacpp, "find_built", lambda cache_dir=None: tools)
  monkeypatch.setenv("FAKE_LLAMA_FAST", fast)
  opts, doc, out, chosen, prompt_list, order, _, _ = _peer_run(tmp_path, vocab_gguf, reps=1)
  runner._llamacpp_phase(opts, doc, out, chosen, prompt_list, order)  # pylint: disable=protected-access
  runs = [c for c in calls() if c["name"] != "llama-bench"]
  assert runs and {c["omp"] for c in runs} == {fast}
  assert json.loads(out.read_text())["llamacpp"]["wait_policy_probe"]["policy"] == fast


def test_bench_peer_phase_keeps_an_asked_wait_policy(fake_tools, vocab_gguf, tmp_path,
                                                     monkeypatch):
  from bench import runner
  tools, calls = fake_tools
  monkeypatch.setattr(llamacpp, "find_built", lambda cache_dir=None: tools)
  opts, doc, out, chosen, prompt_list, order, _, _ = _peer_run(tmp_path, vocab_gguf, reps=1)
  opts.llamacpp_wait_policy = "passive"
  runner._llamacpp_phase(opts, doc, out, chosen, prompt_list, order)  # pylint: disable=protected-access
  made = calls()
  assert made and not [c for c in made if c["name"] == "llama-bench"]  # no probe
  assert {c["omp"] for c in made} == {"PASSIVE"}
  saved = json.loads(out.read_text())["llamacpp"]
  assert saved["env"] == {"OMP_WAIT_POLICY": "PASSIVE"} and saved["wait_policy_probe"] is None
