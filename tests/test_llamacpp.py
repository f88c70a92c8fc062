"""bench.llamacpp: parsing llama.cpp's output, the command lines, the build's cache, a real run.

The parse tests read excerpts captured from the real tools (llama.cpp vendored
by llama-cpp-python 0.3.36, built by `bench.llamacpp.build`). A fake tool (a
Python script printing the same format) checks `generate`'s arguments, its
timeout and its errors without llama.cpp. The end-to-end test runs only where
the real tools are already built.
"""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from bench import llamacpp
from bench import prompts as prompts_lib

# --- a fake tool printing the same format ---------------------------------------------------

_FAKE = r'''
import json, os, pathlib, sys, time

argv = sys.argv[1:]
name = pathlib.Path(sys.argv[0]).name
opt = lambda flag: argv[argv.index(flag) + 1]
prompt = pathlib.Path(opt("-bf")).read_bytes()
with open(os.environ["FAKE_LLAMA_LOG"], "a") as f:
  f.write(json.dumps({"name": name, "argv": argv, "prompt": prompt.decode("utf-8")}) + "\n")
mode = os.environ.get("FAKE_LLAMA_MODE", "ok")
if mode == "hang":
  sys.stderr.write("llama_model_loader: loaded meta data\n")
  sys.stderr.flush()
  time.sleep(60)
if mode == "fail":
  sys.stderr.write("llama_model_load: error loading model: tensor 'output.weight' not found\n")
  sys.exit(1)
n = int(opt("-n"))
eog = mode == "eog"
out, err = sys.stdout.write, sys.stderr.write
err("print_info: EOG token        = 151643 '<|endoftext|>'\n")
err("print_info: EOG token        = 151645 '<|im_end|>'\n")
if name == "llama-completion":
  made = 2 if eog else n
  err(f"main: number of tokens in prompt = {len(prompt)}\n")
  for b in prompt:
    err(f"{b:6d} -> '{chr(b)}'\n")
  out("".join(f" t{i}" for i in range(made)) + (" [end of text]\n" if eog else "") + "\n\n")
  samples = made + eog
  err(f"common_perf_print:    sampling time =       1.00 ms\n"
      f"common_perf_print:    samplers time =       0.50 ms / {samples:5d} tokens\n"
      f"common_perf_print:        load time =     100.00 ms\n"
      f"common_perf_print: prompt eval time =      50.00 ms / {len(prompt):5d} tokens ("
      f"    1.00 ms per token,  1000.00 tokens per second)\n"
      f"common_perf_print:        eval time =     100.00 ms / {samples - 1:5d} runs   ("
      f"   10.00 ms per token,    25.00 tokens per second)\n"
      f"common_perf_print:       total time =     300.00 ms / {len(prompt) + samples:5d} tokens\n")
else:
  draft_max = int(opt("--spec-draft-n-max"))
  made = 2 if eog else n + 1  # like the real tool: one more than -n
  speed = 500.0 if draft_max == 4 else 50.0 + draft_max
  out("\n\n" + prompt.decode("utf-8") + "".join(f" t{i}" for i in range(made)) + "\n\n")
  err(f"encoded {len(prompt):4d} tokens in    0.100 seconds, speed:  100.000 t/s\n"
      f"decoded {made + eog:4d} tokens in    1.000 seconds, speed: {speed:8.3f} t/s\n\n"
      f"n_draft   = {draft_max}\nn_predict = {made + eog}\nn_drafted = 12\nn_accept  = 9\n"
      f"accept    = 75.000%\n")
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
  result = llamacpp.generate(tools, gguf_files[0], TRICKY_PROMPT, 5, threads=3)
  (call,) = calls()
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
  assert result["eog_tokens"] == [[151643, "<|endoftext|>"], [151645, "<|im_end|>"]]


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
  assert result["text"] == " t0 t1 t2 t3 t4 t5"
  assert result["n_tokens"] == 6 and result["stopped_at_eog"] is False
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
                           sweep=(2, 4, 8), tokenizer=_FakeTokenizer())
  assert [s["draft_max"] for s in doc["sweep"]] == [2, 4, 8]
  assert doc["draft_max"] == 4  # the fake is fastest at 4
  spec_calls = [c for c in calls() if c["name"] == "llama-speculative-simple"]
  assert [_value(c["argv"], "--spec-draft-n-max") for c in spec_calls] == ["2", "4", "8", "4", "4"]
  chat_call = [c for c in calls() if c["name"] == "llama-completion"][1]
  assert chat_call["prompt"] == "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"
  assert [r["name"] for r in doc["prompts"]] == ["one", "two", "three"]
  first = doc["prompts"][0]
  assert first["speculative"]["draft_max"] == 4 and first["same_text"] is True
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
    return _fake_binaries(build_dir / "bin", produce["names"])

  monkeypatch.setattr(llamacpp, "_download_sdist", lambda d, log, progress: d / "x.tar.gz")
  monkeypatch.setattr(llamacpp, "_extract_vendor", lambda sdist, d: d)
  monkeypatch.setattr(llamacpp, "_compile", compile_)
  return compiled, produce


def test_build_builds_once_then_returns_the_cached_tools(tmp_path, fake_pipeline, monkeypatch):
  compiled, _ = fake_pipeline
  tools = llamacpp.build(cache_dir=tmp_path, jobs=2)
  assert compiled == [2]
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
