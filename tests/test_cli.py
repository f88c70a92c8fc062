"""The `jspec` command, in process through `cli.main`: output, option wiring, bad input.

Real generations use tiny checkpoints (an HF directory target, a GGUF draft)
through --target/--draft-model; the option-wiring tests replace the model
and the API with recorders, so they cost no compile.
"""

import io
import json
import re
import sys
import types

import pytest

import convert
import jspec
import test_load
from jspec import api
from jspec import cli
from jspec import cpu_kernels
from jspec import fetch
from jspec import loading
from jspec import tokenizer as tokenizer_lib

PROMPT = test_load.PROMPT


@pytest.fixture(scope="module")
def pair(tmp_path_factory, make_hf_model, write_gguf, tiny_vocab):
  return test_load.write_pair(tmp_path_factory.mktemp("cli"), make_hf_model, write_gguf,
                              tiny_vocab)


@pytest.fixture(scope="module")
def bundle(pair):
  return jspec.load(*pair, progress=False)


def _paths(pair):
  return ["--target", str(pair[0]), "--draft-model", str(pair[1])]


def _run(capsys, argv):
  code = cli.main(argv)
  out = capsys.readouterr()
  return code, out.out, out.err


# Real generations.

@pytest.mark.slow
def test_stream_json_and_generate_agree_with_stats(pair, bundle, capsys):
  want = jspec.generate(bundle, PROMPT, max_new_tokens=12)
  code, out, err = _run(capsys, ["generate", PROMPT, "--max-new-tokens", "12", "--stats",
                                 *_paths(pair)])
  assert code == 0 and out == want.text  # a pipe gets the exact text, no added newline
  # The stats line starts a line of its own, whether or not the text ended one.
  assert err.startswith("jspec:" if out.endswith("\n") else "\njspec:")
  assert re.fullmatch(r"\n?jspec: 12 tokens, [\d.]+ tokens/s \(prefill [\d.]+ s, decode [\d.]+ s, "
                      r"compile [\d.]+ s\), acceptance [\d.]+%, [\d.]+ accepted per round "
                      r"\([\d.]+ tokens per round, \d+ rounds\)\n", err), err
  code, out, err = _run(capsys, ["generate", PROMPT, "--max-new-tokens", "12", "--json",
                                 *_paths(pair)])
  got = json.loads(out)
  assert code == 0 and err == ""
  assert got["text"] == want.text and got["token_ids"] == want.token_ids
  assert got["stats"]["drafted"] == want.stats["drafted"]
  assert got["settings"]["max_new_tokens"] == 12 and got["settings"]["method"] == "model"
  assert (got["settings"]["target"], got["settings"]["draft_model"]) == tuple(map(str, pair))


def test_text_that_is_not_unicode_is_a_value_error_in_the_api(bundle):
  with pytest.raises(ValueError, match="not valid Unicode text: surrogates not allowed at "
                                       "position 1"):
    jspec.generate(bundle, "a\ud800b", max_new_tokens=2)


@pytest.mark.slow
def test_sampling_options_match_generate(pair, bundle, capsys):
  options = dict(temperature=0.8, top_p=0.9, top_k=50, seed=7, gamma=3, max_new_tokens=10)
  want = jspec.generate(bundle, PROMPT, **options)
  argv = ["generate", PROMPT, "--temperature", "0.8", "--top-p", "0.9", "--top-k", "50",
          "--seed", "7", "--gamma", "3", "--max-new-tokens", "10", *_paths(pair)]
  code, streamed, _ = _run(capsys, argv)
  assert code == 0 and streamed == want.text
  code, out, _ = _run(capsys, argv + ["--json"])
  assert json.loads(out)["token_ids"] == want.token_ids


@pytest.mark.parametrize("argv,options", [
    (["--method", "prompt_lookup", "--ngram", "2", "--policy", "heuristic", "--gamma-max", "6"],
     dict(method="prompt_lookup", ngram=2, policy="heuristic", gamma_max=6)),
    (["--method", "target"], dict(method="target")),
    (["--method", "lookup_model", "--ngram", "2"], dict(method="lookup_model", ngram=2)),
    (["--float-draft"], dict(method="model")),
], ids=["prompt_lookup", "target", "lookup_model", "float-draft"])
@pytest.mark.slow
def test_draft_methods_match_generate(pair, bundle, capsys, argv, options):
  if "--float-draft" in argv:
    bundle = jspec.load(*pair, progress=False, draft_int8=False)
  want = jspec.generate(bundle, PROMPT, max_new_tokens=12, **options)
  paths = _paths(pair) if jspec.Options(**options).uses_draft else ["--target", str(pair[0])]
  code, out, _ = _run(capsys, ["generate", PROMPT, "--max-new-tokens", "12", "--json", *argv,
                               *paths])
  got = json.loads(out)
  assert code == 0 and got["token_ids"] == want.token_ids
  if options["method"] == "target":
    assert got["stats"]["acceptance_rate"] is None  # strict JSON: no NaN


# Option wiring, with the model and the API replaced by recorders.

class Recorder:
  """Stands in for loading.load, api.stream and api.generate, recording their arguments."""

  STATS = {"new_tokens": 3, "rounds": 1, "drafted": 4, "accepted": 2, "acceptance_rate": 0.5,
           "mean_tokens_per_round": 2.0, "accepted_histogram": [0, 0, 1], "gamma_trace": [4],
           "compile_s": 1.0, "prefill_s": 0.1, "decode_s": 0.2, "tokens_per_s": 10.0}

  def __init__(self, monkeypatch, tokenizer, pieces=(("ab", [1]), ("c", [2]))):
    self.tokenizer, self.pieces = tokenizer, pieces
    self.loads, self.calls = [], []
    monkeypatch.setattr(loading, "load", self.load)
    monkeypatch.setattr(api, "stream", self.stream)
    monkeypatch.setattr(api, "generate", self.generate)

  def load(self, target, draft=None, **kwargs):
    self.loads.append((target, draft, kwargs))
    return types.SimpleNamespace(tokenizer=self.tokenizer)

  def stream(self, bundle, prompt, options):
    self.calls.append(("stream", prompt, options))
    for piece in self.pieces:
      yield piece
    return dict(self.STATS)

  def generate(self, bundle, prompt, options):
    self.calls.append(("generate", prompt, options))
    return api.Result("abc", [1, 2], dict(self.STATS))


@pytest.fixture
def recorder(monkeypatch, pair):
  return Recorder(monkeypatch, tokenizer_lib.from_hf_dir(pair[0]))


def test_every_generate_option_reaches_the_api(recorder, capsys):
  code, out, _ = _run(capsys, [
      "generate", "hi", "--max-new-tokens", "7", "--temperature", "0.5", "--top-p", "0.75",
      "--top-k", "11", "--gamma", "2", "--gamma-max", "5", "--policy", "confidence",
      "--min-confidence", "0.25", "--seed", "9", "--method", "prompt_lookup", "--ngram", "4",
      "--model", "qwen2.5-coder", "--dtype", "bfloat16", "--json"])
  assert code == 0
  (kind, prompt, options), = recorder.calls
  assert (kind, prompt) == ("generate", "hi")
  assert options == jspec.Options(max_new_tokens=7, temperature=0.5, top_p=0.75, top_k=11,
                                  gamma=2, gamma_max=5, policy="confidence", min_confidence=0.25,
                                  seed=9, method="prompt_lookup", ngram=4)
  # No draft model is loaded for prompt lookup: the pair's target alone.
  (target, draft, kwargs), = recorder.loads
  assert (target, draft) == (fetch.PAIRS["qwen2.5-coder"][0], None)
  assert kwargs["dtype"] == "bfloat16"
  got = json.loads(out)
  assert got["text"] == "abc" and got["settings"]["top_p"] == 0.75
  assert got["settings"]["dtype"] == "bfloat16" and got["settings"]["draft_model"] is None
  assert got["settings"]["target"] == fetch.PAIRS["qwen2.5-coder"][0]


def test_defaults_and_paths_reach_load(recorder, capsys, pair):
  assert cli.main(["generate", "hi"]) == 0
  assert recorder.loads[-1][:2] == fetch.PAIRS[loading.DEFAULT_PAIR]
  assert recorder.calls[-1][2] == jspec.Options()  # the API's defaults, exactly
  assert recorder.loads[-1][2]["settings"] == jspec.Settings()
  assert cli.main(["generate", "hi", "--float-draft"]) == 0
  assert recorder.loads[-1][2]["settings"] == jspec.Settings(draft_int8=False)
  assert cli.main(["generate", "hi", *_paths(pair), "--tokenizer", str(pair[0])]) == 0
  target, draft, kwargs = recorder.loads[-1]
  assert (target, draft) == (str(pair[0]), str(pair[1]))
  assert kwargs["tokenizer"] == str(pair[0]) and kwargs["dtype"] is None
  assert cli.main(["generate", "hi", "--method", "target", "--target", str(pair[0])]) == 0
  assert recorder.loads[-1][1] is None and recorder.calls[-1][2].method == "target"
  assert capsys.readouterr().out == "abc" * 4


def test_chat_wraps_the_prompt_in_the_template(recorder, capsys):
  assert cli.main(["generate", "hi", "--chat"]) == 0
  assert recorder.calls[-1][1] == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("argv", [["generate"], ["generate", "-"]], ids=["omitted", "dash"])
def test_prompt_from_stdin(recorder, capsys, monkeypatch, argv):
  monkeypatch.setattr(sys, "stdin", io.StringIO("def f(x):\n"))
  assert cli.main(argv) == 0
  assert recorder.calls[-1][1] == "def f(x):\n"


def test_stats_line_after_stream(recorder, capsys):
  code, out, err = _run(capsys, ["generate", "hi", "--stats"])
  assert code == 0 and out == "abc"
  # On a line of its own (after a newline: "abc" ended without one), on stderr.
  assert err == ("\njspec: 3 tokens, 10.00 tokens/s (prefill 0.10 s, decode 0.20 s, compile 1.0 s), "
                 "acceptance 50.0%, 2.00 accepted per round (2.00 tokens per round, 1 rounds)\n")
  recorder.pieces = (("ab\n", [1]),)
  code, out, err = _run(capsys, ["generate", "hi", "--stats"])
  assert out == "ab\n" and err.startswith("jspec: 3 tokens")


@pytest.mark.parametrize("data, where", [(b"\xff\xfe hi", "stdin"), (b"ok \xc3", "stdin")])
def test_a_prompt_that_is_not_utf8_is_one_line(recorder, capsys, monkeypatch, data, where):
  monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
  code, out, err = _run(capsys, ["generate"])
  assert code == 2 and out == "" and not recorder.loads
  assert err.startswith(f"jspec: error: {where} is not UTF-8 text") and err.count("\n") == 1
  code, out, err = _run(capsys, ["generate", "a\udcffb"])  # argv keeps bad bytes as surrogates
  assert code == 2 and "the PROMPT argument is not UTF-8 text" in err and err.count("\n") == 1


def test_interrupt_and_broken_pipe(monkeypatch, recorder, capsys):
  def interrupted(bundle, prompt, options):
    yield "a", [1]
    raise KeyboardInterrupt

  monkeypatch.setattr(api, "stream", interrupted)
  code, out, err = _run(capsys, ["generate", "hi"])
  assert code == 130 and out == "a" and "interrupted" in err and "Traceback" not in err

  class ClosedPipe(io.StringIO):
    def write(self, text):
      raise BrokenPipeError(32, "Broken pipe")

  monkeypatch.setattr(api, "stream", recorder.stream)
  monkeypatch.setattr(sys, "stdout", ClosedPipe())
  assert cli.main(["generate", "hi"]) == 141
  assert capsys.readouterr().err == ""


def test_bugs_keep_their_traceback(monkeypatch, recorder):
  def broken(bundle, prompt, options):
    raise RuntimeError("a bug")
    yield  # pylint: disable=unreachable

  monkeypatch.setattr(api, "stream", broken)
  with pytest.raises(RuntimeError, match="a bug"):
    cli.main(["generate", "hi"])
  monkeypatch.setenv("JSPEC_DEBUG", "1")  # and user errors show theirs on request
  with pytest.raises(cli.UsageError, match="empty prompt"):
    cli.main(["generate", ""])


# Bad input: one line on stderr, no traceback, status 2.

def _bad(root, kind, pair, make_hf_model, tiny_vocab, write_gguf):
  """The extra arguments of `jspec generate` that make one kind of bad input."""
  target, draft = pair
  if kind == "other-vocab":
    other = test_load.write_hf(root / "other", make_hf_model(seed=3, **test_load.DRAFT_SIZES),
                               tiny_vocab, swap=(100, 101))
    return [PROMPT, "--target", str(target), "--draft-model", str(other)]
  if kind == "llama":
    llama = root / "llama"
    llama.mkdir()
    config = json.loads((target / "config.json").read_text())
    config.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (llama / "config.json").write_text(json.dumps(config))
    (llama / "model.safetensors").write_bytes((target / "model.safetensors").read_bytes())
    return [PROMPT, "--target", str(llama), "--method", "target"]
  if kind in ("corrupt-jspec", "jspec-no-tokenizer"):
    out = convert.convert_checkpoint(target, root / "t.jspec.safetensors")
    if kind == "corrupt-jspec":
      out.write_bytes(out.read_bytes()[:-1000])
    return [PROMPT, "--target", str(out), "--method", "target"]
  if kind == "corrupt-gguf":
    bad = root / "bad.gguf"
    bad.write_bytes(draft.read_bytes()[:5000])
    return [PROMPT, "--target", str(target), "--draft-model", str(bad)]
  if kind in ("missing", "not-a-checkpoint", "pickle"):
    return [PROMPT, "--target", str(test_load._bad_path(root, kind)), "--method", "target"]
  if kind == "pickle-dir":
    (root / "p").mkdir()
    (root / "p" / "config.json").write_text((target / "config.json").read_text())
    (root / "p" / "pytorch_model.bin").write_bytes(b"\x80\x04junk")
    return [PROMPT, "--target", str(root / "p"), "--method", "target"]
  if kind == "too-long":
    return ["x" * 600, "--target", str(target), "--method", "target"]
  raise AssertionError(kind)


@pytest.mark.parametrize("kind,words", [
    ("other-vocab", ("different vocabularies", "token id 100")),
    ("llama", ("model_type", "llama")),
    ("corrupt-jspec", ("t.jspec.safetensors", "truncated")),
    ("jspec-no-tokenizer", ("no tokenizer", "--tokenizer")),
    ("corrupt-gguf", ("bad.gguf",)),
    ("missing", ("missing.gguf", "no such file")),
    ("not-a-checkpoint", ("empty", "config.json")),
    ("pickle", ("m.bin", "pickle", "safetensors")),
    ("pickle-dir", ("pytorch_model.bin", "safetensors")),
    ("too-long", ("exceeds", "context of 512")),
])
def test_bad_checkpoints_and_prompts(tmp_path, capsys, pair, make_hf_model, tiny_vocab,
                                     write_gguf, kind, words):
  argv = _bad(tmp_path, kind, pair, make_hf_model, tiny_vocab, write_gguf)
  capsys.readouterr()  # what writing the checkpoints printed
  code, out, err = _run(capsys, ["generate", *argv])
  assert code == 2 and out == ""
  assert err.startswith("jspec: error: ") and err.count("\n") == 1, err
  assert "Traceback" not in err
  for word in words:
    assert word in err, err


@pytest.mark.parametrize("argv,words", [
    (["--model", "llama-7b"], ("unknown model", "qwen2.5-coder")),
    (["--max-new-tokens", "0"], ("--max-new-tokens",)),
    (["--max-new-tokens", "ten"], ("'ten' is not an integer",)),
    (["--temperature", "-1"], ("--temperature",)),
    (["--temperature", "nan"], ("--temperature",)),
    (["--temperature", "1e308"], ("--temperature", "1000")),
    (["--temperature", "1e-38"], ("--temperature", "0.001")),
    (["--top-p", "0"], ("--top-p", "(0, 1]")),
    (["--top-p", "1.5"], ("--top-p",)),
    (["--top-k", "-1"], ("--top-k",)),
    (["--gamma", "0"], ("--gamma",)),
    (["--gamma", "100000", "--policy", "fixed"], ("--gamma", "[1, 32]")),
    (["--gamma", "5", "--gamma-max", "3"], ("gamma=5 exceeds gamma_max=3",)),
    (["--seed", "-1"], ("--seed",)),
    (["--seed", str(2**64)], ("--seed",)),
    (["--ngram", "0"], ("--ngram",)),
    (["--ngram", "100000", "--method", "prompt_lookup"], ("--ngram", "[1, 16]")),
    (["--policy", "greedy"], ("--policy",)),
    (["--policy", "cumulative"], ("--policy",)),
    (["--method", "eagle"], ("--method",)),
    (["--draft-vocab", "-1"], ("--draft-vocab", "expected a positive int")),
    (["--draft-vocab", "10", "--method", "prompt_lookup"], ("--draft-vocab", "prompt_lookup")),
    (["--float-draft", "--method", "prompt_lookup"], ("--float-draft", "prompt_lookup")),
    (["--method", "target", "--draft-model", "x.gguf"], ("--draft-model", "--method target")),
    (["--dtype", "int8"], ("--dtype",)),
    (["--model", "qwen2.5-coder", "--target", "x"], ("not allowed with",)),
    (["--target", "/nonexistent/t.gguf"], ("/nonexistent/t.gguf", "no such file")),
    (["--target", "."], ("--draft-model",)),  # --draft model without a draft
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_options(capsys, recorder, argv, words):
  code, out, err = _run(capsys, ["generate", PROMPT, *argv])
  assert code == 2 and out == "" and not recorder.calls
  assert err.startswith("jspec: error: ") and err.count("\n") == 1, err
  for word in words:
    assert word in err, err


def test_empty_prompts(capsys, recorder, monkeypatch):
  for argv, stdin in ([[""], ""], [[], ""], [["-"], ""]):
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code, _, err = _run(capsys, ["generate", *argv])
    assert code == 2 and err == "jspec: error: empty prompt: expected at least one character\n"
  assert not recorder.loads  # refused before loading anything
  code, _, err = _run(capsys, ["frobnicate"])
  assert code == 2 and err.count("\n") == 1 and "frobnicate" in err
  assert cli.main(["generate", "--help"]) == 0
  assert "--max-new-tokens" in capsys.readouterr().out


# The other subcommands.

def test_info_text_and_json(capsys, monkeypatch, tmp_path):
  source = fetch.ModelSource("fake-model", ("no_such_chunk_abc",), ("data/part01.bin",),
                             "0" * 64, 10, "fake.gguf", ("no-such-chunk-abc",), "1.0")
  monkeypatch.setattr(fetch, "MODELS", {"fake-model": source})
  monkeypatch.setattr(fetch, "PAIRS", {"fake-pair": ("fake-model", "fake-model")})
  monkeypatch.setenv("JSPEC_CACHE", str(tmp_path))
  loading.converted_path(tmp_path / "fake.gguf", "float32").write_bytes(b"x")
  code, out, _ = _run(capsys, ["info"])
  assert code == 0
  assert "cpu" in out and str(tmp_path) in out and "pair fake-pair" in out
  assert re.search(r"fake-model: packages missing \(no-such-chunk-abc; .*converted: float32", out)
  code, out, _ = _run(capsys, ["info", "--json"])
  got = json.loads(out)
  assert got["cache_dir"] == str(tmp_path) and got["devices"]
  (row,) = got["models"]
  assert not row["installed"] and list(row["converted"]) == ["float32"]
  kernels = got["cpu_kernels"]
  assert kernels["built"] == cpu_kernels.available()


def test_info_says_which_cpu_kernels_run(capsys, monkeypatch):
  if not cpu_kernels.available():
    pytest.skip(f"kernels unavailable: {cpu_kernels.unavailable_reason()}")
  code, out, _ = _run(capsys, ["info"])
  assert code == 0 and re.search(r"cpu kernels: built \(int8: \w+; default draft: [\w-]+\)", out)
  draft = "4-bit" if cpu_kernels.int4_available() else "int8"
  assert f"default draft: {draft})" in out
  monkeypatch.setattr(cpu_kernels, "available", lambda: False)
  monkeypatch.setattr(cpu_kernels, "unavailable_reason", lambda: "no compiler (test)")
  code, out, _ = _run(capsys, ["info"])
  assert "cpu kernels: not built (no compiler (test))" in out
  code, out, _ = _run(capsys, ["info", "--json"])
  assert json.loads(out)["cpu_kernels"]["reason"] == "no compiler (test)"


def test_convert_delegates(capsys, pair, tmp_path):
  out = tmp_path / "t.jspec.safetensors"
  code, _, err = _run(capsys, ["convert", str(pair[0]), str(out), "--dtype", "bfloat16"])
  assert code == 0 and out.is_file() and "wrote" in err
  code, _, err = _run(capsys, ["convert", str(tmp_path / "nope"), str(tmp_path / "x")])
  assert code == 2 and err.count("\n") == 1 and err.startswith("jspec convert: error:")


def test_bench_forwards_or_explains(capsys, monkeypatch):
  seen = []
  monkeypatch.setitem(sys.modules, "bench.__main__",
                      types.SimpleNamespace(main=lambda argv, prog: seen.append((argv, prog)) or 3))
  assert cli.main(["bench", "--quick", "x"]) == 3
  assert seen == [(["--quick", "x"], "jspec bench")]
  monkeypatch.setitem(sys.modules, "bench.__main__", None)  # not importable
  code, _, err = _run(capsys, ["bench"])
  assert code == 2 and err.count("\n") == 1 and "bench" in err
