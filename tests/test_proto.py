"""The measurement prototype of bench/proto: its rows and its error, which a decision record cites."""

import os
import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCE = ROOT / "bench" / "proto" / "digits_q4k.cc"


def _has_vnni() -> bool:
  try:
    return "avx512_vnni" in pathlib.Path("/proc/cpuinfo").read_text()
  except OSError:
    return False


@pytest.fixture(scope="module")
def binary(tmp_path_factory) -> pathlib.Path:
  if shutil.which("g++") is None or not _has_vnni():
    pytest.skip("needs g++ and an AVX-512 VNNI host")
  out = tmp_path_factory.mktemp("proto") / "digits_q4k"
  subprocess.run(["g++", "-O2", "-march=native", "-fopenmp", "-o", str(out), str(SOURCE)],
                 check=True, capture_output=True, timeout=300)
  return out


def test_digits_rows_match_one_row_and_error_is_within_float32s(binary):
  """Every row of a several-row call equals a one-row call bit for bit (else exit 1), and the error is a float32 sum's."""
  env = dict(os.environ, SMALL="1", ROWS="1", OMP_NUM_THREADS="2")
  run = subprocess.run([str(binary), "1"], env=env, capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stdout + run.stderr
  assert len(re.findall(r"^digits M=\d+:", run.stdout, re.M)) == 14  # 7 row counts, 2 rounds
  errs = re.findall(r"maxerr ([0-9.e+-]+) \(fp32 fma chain ([0-9.e+-]+)", run.stdout)
  assert errs
  for digits, fp32 in errs:
    assert 0 < float(digits) <= float(fp32)
