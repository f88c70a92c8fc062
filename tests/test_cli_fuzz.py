"""The command line under random input: every run is exit 0, or exit 2 with one line; never a traceback.

Hypothesis draws argv from the real flags with random values (numbers in
and out of range, words, empty strings, huge integers), and prompts from
random bytes on stdin or in argv, and runs `jspec generate` in process on a
tiny real pair. A failing run must print nothing on stdout (no partial
output) and exactly one `jspec: error: ...` line on stderr.
"""

from __future__ import annotations

import io
import sys

import hypothesis
import hypothesis.strategies as st
import pytest

import test_load
from jspec import cli


_NUMBERS = st.one_of(
    st.integers(-3, 40), st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["0", "1", "0.5", "1e-38", "1e308", "nan", "-inf", "", "ten", "0x10", "3.0"]))
_FLAGS = {
    "--max-new-tokens": _NUMBERS, "--temperature": _NUMBERS, "--top-p": _NUMBERS,
    "--top-k": _NUMBERS, "--gamma": _NUMBERS, "--gamma-max": _NUMBERS,
    "--min-confidence": _NUMBERS, "--seed": _NUMBERS, "--ngram": _NUMBERS,
    "--method": st.sampled_from(["model", "prompt_lookup", "lookup_model", "target", "none", ""]),
    "--policy": st.sampled_from(["fixed", "heuristic", "confidence", "cumulative", "x"]),
    "--dtype": st.sampled_from(["float32", "int8"]),
}
_SWITCHES = ["--float-draft", "--json", "--stats", "--chat"]


@st.composite
def _argv(draw):
  flags = draw(st.lists(st.sampled_from(sorted(_FLAGS)), max_size=4, unique=True))
  args = []
  for flag in flags:
    value = draw(_FLAGS[flag])
    args += [flag, str(value)]
  args += draw(st.lists(st.sampled_from(_SWITCHES), max_size=2, unique=True))
  return args


@pytest.fixture(scope="module")
def pair(tmp_path_factory, make_hf_model, write_gguf, tiny_vocab):
  return test_load.write_pair(tmp_path_factory.mktemp("fuzz"), make_hf_model, write_gguf,
                              tiny_vocab)


@pytest.mark.parametrize("examples", [8, pytest.param(40, marks=pytest.mark.slow)])
def test_random_arguments_and_bytes_end_in_exit_0_or_one_line(pair, capsys, monkeypatch, examples):

  @hypothesis.settings(max_examples=examples, deadline=None, database=None,
                       suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture,
                                              hypothesis.HealthCheck.too_slow])
  @hypothesis.given(argv=_argv(), prompt=st.binary(min_size=0, max_size=40),
                    on_stdin=st.booleans())
  def check(argv, prompt, on_stdin):
    paths = ["--target", str(pair[0]), "--draft-model", str(pair[1])]
    if "--method" in argv and argv[argv.index("--method") + 1] in ("target", "prompt_lookup"):
      paths = paths[:2]
    full = ["generate", "--max-new-tokens", "3", *argv, *paths]  # a drawn value wins
    if on_stdin:
      monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(prompt)))
    else:  # argv carries undecodable bytes as lone surrogates, as Python's os.fsdecode does
      full.insert(3, prompt.decode("utf-8", "surrogateescape"))
    code = cli.main(full)
    out, err = capsys.readouterr()
    assert code in (0, 2), (full, code, err)
    assert "Traceback" not in err
    if code == 2:
      assert out == "", (full, out)  # nothing half-written on stdout
      assert err.startswith("jspec: error: ") and err.count("\n") == 1, (full, err)

  check()
