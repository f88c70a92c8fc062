"""bench.tools.large_target on its smoke shape: the whole tool, end to end, on tiny random models.

The smoke target has the tool's structure at a tiny size: every matrix in
int8 blocks (Q4_K-like and Q6_K-like, as for the 7B), a vocabulary padded
past the draft's, the derived figures from the real pair's histograms file.
"""

import json
import math

import jax.numpy as jnp
import pytest

from bench.tools import large_target
from jspec import cpu_kernels
from jspec import weights


def test_estimate_counts_every_matrix():
  cfg = large_target.SHAPES["7b"]
  est = large_target.estimate(cfg, "bf16")
  # Qwen2.5-7B: 7.07B in the layers + 2 x 152064 x 3584 in the embedding and the untied head.
  assert est["params"] == 28 * (2 * 3584 * 3584 + 2 * 3584 * 512 + 3 * 3584 * 18944) \
      + 2 * 152064 * 3584
  assert est["matrix_bytes"] == 2 * est["params"]
  blocks = large_target.estimate(cfg, "blocks")["matrix_bytes"]
  # Q6_K-like 1 + 4/16 bytes a weight, Q4_K-like 1/2 + 8/32 (two values a byte)
  q6 = sum(o * i for n, (o, i) in large_target._matrices(cfg)
           if not large_target.form_of(n, "blocks")[1])
  assert blocks == pytest.approx(1.25 * q6 + 0.75 * (est["params"] - q6), rel=1e-9)


def test_blocks_form_and_magnitude():
  cfg = large_target.SHAPES["smoke"]
  params = large_target.build(cfg, "blocks")
  down = params["layers"]["0"]["mlp"]["down"]["w"]
  gate = params["layers"]["0"]["mlp"]["gate"]["w"]
  if not cpu_kernels.available():
    pytest.skip("no CPU kernels: blocks are stored widened")
  assert isinstance(down, weights.Blocks) and down.offset is None  # Q6_K-like
  assert isinstance(gate, weights.Blocks) and gate.offset is not None  # Q4_K-like
  assert down.block == 16 and down.q.dtype == jnp.int8
  assert gate.block == 32 and gate.q.dtype == jnp.uint8  # values 0..15: two a byte
  w = weights.matrix(gate)
  assert 0.005 < float(abs(w).mean()) < 0.02


def test_smoke_run_writes_finite_figures(tmp_path):
  out = tmp_path / "large_smoke.json"
  rc = large_target.main(["--shape", "smoke", "--storage", "blocks", "--max-new-tokens", "4",
                          "--gammas", "1", "--out", str(out)])
  assert rc == 0
  doc = json.loads(out.read_text())
  assert doc["vocab_limit"] == large_target.SMOKE_DRAFT.vocab_size  # padded target, masked
  assert doc["finite_check"]["finite"] and doc["tokens_produced"]
  s = doc["summary"]
  for key in ("target_bytes", "draft_bytes", "peak_rss_bytes", "peak_rss_over_loaded",
              "target_decode_tokens_per_s", "target_tokens_per_s"):
    assert isinstance(s[key], (int, float)) and math.isfinite(s[key]) and s[key] > 0, key
  (row,) = s["gammas"]
  assert row["gamma"] == 1
  for key in ("round_ms", "E", "derived_decode_tokens_per_s", "derived_tokens_per_s",
              "E_suite", "derived_suite_decode_tokens_per_s"):
    assert isinstance(row[key], float) and math.isfinite(row[key]) and row[key] > 0, key
  rec = doc["prompts"]["unit_tests"]["modes"]["spec_g1"]
  assert rec["derived"]["histogram_from"] == "prompt"
  assert doc["derived"]["source"].endswith("gamma_sweep_cpu.json")


def test_matrices_are_the_models():
  import jax  # pylint: disable=import-outside-toplevel
  from jspec import model  # pylint: disable=import-outside-toplevel
  cfg = large_target.SHAPES["smoke"]
  leaves, _ = jax.tree_util.tree_flatten_with_path(model.abstract_params(cfg),
                                                   is_leaf=weights.is_leaf)
  want = {model.path_name(p): tuple(reversed(leaf.shape)) for p, leaf in leaves
          if weights.is_leaf(leaf)}
  assert dict(large_target._matrices(cfg)) == want  # pylint: disable=protected-access
