"""Issue 34: the compiled loop on a `jax.sharding` mesh (`jspec.mesh`), checked on fake CPU devices.

JAX fixes a process's device count when it starts, and the suite's process
has one CPU device, so the sharded checks live in `mesh_check.py` and run
in child processes with `--xla_force_host_platform_device_count=8` (the
suite's compiler flags are inherited). Each test here runs one group of
them and shows its output when it fails. The multi-process test starts two
processes of two CPU devices each, joined by `jax.distributed` over
127.0.0.1 (gloo collectives), every wait bounded.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import jax
import pytest

import jspec
from jspec import cli
from jspec import mesh as mesh_lib

HERE = pathlib.Path(__file__).resolve().parent
CHECK = HERE / "mesh_check.py"
TIMEOUT_S = 600


def _env(devices: int | None = None) -> dict:
  env = dict(os.environ)
  if devices is not None:
    env["XLA_FLAGS"] = (f"{env.get('XLA_FLAGS', '')} "
                        f"--xla_force_host_platform_device_count={devices}").strip()
  env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")])
  return env


def _check(*args: str) -> str:
  """Runs one group of `mesh_check.py` on 8 fake devices; its output, or the test fails with it."""
  proc = subprocess.run([sys.executable, str(CHECK), *args], env=_env(), capture_output=True,
                        text=True, timeout=TIMEOUT_S)
  assert proc.returncode == 0, f"mesh_check {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
  return proc.stdout


def test_fast_group_on_a_2x2_mesh():
  """Bad meshes refused before compiling; greedy equal on (2, 2); placement and collectives."""
  out = _check("fast")
  assert "errors: 7 bad inputs refused" in out
  assert "greedy model-fixed mesh (2, 2): equal" in out
  assert "collectives run" in out


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["1x1", "2x1", "1x2", "2x2", "4x2"])
def test_greedy_every_method_equals_one_device(shape):
  out = _check("greedy", shape)
  assert out.count(": equal") == 5, out


@pytest.mark.slow
def test_kernel_forms_run_sharded_with_the_same_numbers():
  """Float32 panels (+ greedy head), int8 blocks and an int8-panel draft, unpacked for the mesh."""
  out = _check("kernels")
  assert out.count("gives its one-device ids") == 2 or "skipped" in out, out


@pytest.mark.slow
def test_placement_on_a_4x2_mesh():
  assert "collectives run" in _check("placement", "4x2")


@pytest.mark.slow
def test_caches_on_a_mesh_equal_a_fresh_prefill():
  assert _check("cache").count("equal to a fresh prefill") == 2


@pytest.mark.slow
def test_sharded_sampling_is_lossless():
  assert _check("lossless").count("chi-square p") == 2


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_generate_one_process_tokens(tmp_path):
  """2 processes x 2 CPU devices, one (2, 2) mesh: both get one device's greedy tokens."""
  port = _free_port()
  outs = [tmp_path / f"p{i}.json" for i in range(2)]
  procs = [subprocess.Popen([sys.executable, str(CHECK), "--worker", str(i), "2", str(port),
                             str(outs[i])], env=_env(devices=2), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for i in range(2)]
  logs = []
  try:
    for p in procs:
      logs.append(p.communicate(timeout=TIMEOUT_S)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  assert all(p.returncode == 0 for p in procs), "\n".join(logs)
  got = [json.loads(o.read_text()) for o in outs]
  assert got[0] == got[1]
  assert got[0]["devices"] == 4
  assert got[0]["sharded"] == got[0]["one_device"]


def test_cli_mesh_option(monkeypatch, capsys):
  """--mesh DxM reaches load as a mesh; a bad value is one error line and status 2."""
  loads = []

  def fake_load(target, draft, **kwargs):
    loads.append(kwargs)
    raise ValueError("stop here")

  monkeypatch.setattr(cli.loading, "load", fake_load)
  assert cli.main(["generate", "hi", "--mesh", "1x1"]) == cli.EXIT_USAGE
  mesh = loads[-1]["mesh"]
  assert dict(mesh.shape) == {"data": 1, "model": 1}
  assert cli.main(["generate", "hi"]) == cli.EXIT_USAGE and loads[-1]["mesh"] is None
  capsys.readouterr()
  for bad, message in (("2by2", "expected DATAxMODEL"), ("1x2", "needs 2 devices; there are 1")):
    assert cli.main(["generate", "hi", "--mesh", bad]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("jspec: error: --mesh:") and message in err and err.count("\n") == 1


@pytest.mark.slow
def test_a_mesh_of_one_device_runs_in_process():
  """In the suite's own process: a 1x1 mesh from `jax.make_mesh` (Explicit axes) runs and agrees."""
  import tiny  # pylint: disable=import-outside-toplevel

  bundle = tiny.pair(2, kernels=False, draft_int8=False)
  mesh = jax.make_mesh((1, 1), ("data", "model"))
  sharded = jspec.shard(bundle, mesh)
  assert sharded.target.placement.mesh.axis_types == (jax.sharding.AxisType.Auto,) * 2
  assert not sharded.target.placement.vocab_parallel or tiny.VOCAB % 1 == 0
  got = jspec.generate(sharded, [1, 2, 3], max_new_tokens=6, policy="fixed", gamma=2)
  assert got.token_ids == jspec.generate(bundle, [1, 2, 3], max_new_tokens=6,
                                         method="target").token_ids
  assert mesh_lib.PROGRAMS.compiles >= 2
