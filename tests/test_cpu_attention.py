"""jspec.cpu_attention: the in-place decode attention kernel equals the attention of jspec.model."""

from __future__ import annotations

import dataclasses
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
import tiny
from jspec import api
from jspec import cache as cache_lib
from jspec import cpu_attention
from jspec import cpu_kernels
from jspec import decode
from jspec import bundle as bundle_lib
from jspec import model

pytestmark = pytest.mark.skipif(not cpu_kernels.available(),
                                reason=f"kernels unavailable: {cpu_kernels.unavailable_reason()}")

L, B, S = 3, 2, 24  # layers, rows, cache slots


def _random(shape, seed):
  return np.random.RandomState(seed).standard_normal(shape).astype(np.float32)


def _operands(t, n, k, h, seed=0):
  """q [B, T, N, H], the chunk's k and v [B, T, K, H], caches [L, B, S, K, H] of noise."""
  return (_random((B, t, n, h), seed), _random((B, t, k, h), seed + 1),
          _random((B, t, k, h), seed + 2), _random((L, B, S, k, h), seed + 3),
          _random((L, B, S, k, h), seed + 4))


def _reference(q, k_new, v_new, k_buf, v_buf, layer, starts):
  """The chunk written into layer `layer`, then masked softmax attention in float64 (numpy)."""
  b, t, n, h = q.shape
  k = k_new.shape[2]
  out = np.zeros((b, t, n, h))
  for row in range(b):
    keys, values = k_buf[layer, row].astype(np.float64), v_buf[layer, row].astype(np.float64)
    keys[starts[row]:starts[row] + t] = k_new[row]
    values[starts[row]:starts[row] + t] = v_new[row]
    for i in range(t):
      visible = starts[row] + i + 1
      for head in range(n):
        kv = head // (n // k)
        scores = keys[:visible, kv] @ q[row, i, head] / np.sqrt(h)  # [visible]
        p = np.exp(scores - scores.max())
        out[row, i, head] = (p / p.sum()) @ values[:visible, kv]
  return out


def _attend(q, k_new, v_new, k_buf, v_buf, layer, starts):
  fn = jax.jit(cpu_attention.attend)
  return np.asarray(fn(*map(jnp.asarray, (q, k_new, v_new, k_buf, v_buf)), jnp.int32(layer),
                       jnp.asarray(starts, jnp.int32)))


@pytest.mark.parametrize("t", [1, 4])
@pytest.mark.parametrize("n,k,h", [(6, 2, 16), (4, 4, 20), (3, 1, 8), (6, 2, 128), (2, 1, 80),
                                   (14, 2, 64), (10, 1, 32)])
def test_attend_matches_the_written_cache_attention(t, n, k, h):
  # Groups of 3, 1 and 3 query heads per kv head; H = 20 leaves a tail past
  # the vector lanes; H = 128 (the real target's) and 80 go through the
  # weighted sum's blocks of four vectors, 80 with a tail after them. Groups
  # of 7 (the real draft's) and 10 take more than one batch of the scores'
  # and the weighted sums' heads. Rows start at different slots, one at 0
  # (no cache), one far enough in for the cache rows ahead to be prefetched.
  q, k_new, v_new, k_buf, v_buf = _operands(t, n, k, h)
  starts = [19, 0]
  for layer in (0, 2):
    got = _attend(q, k_new, v_new, k_buf, v_buf, layer, starts)
    want = _reference(q, k_new, v_new, k_buf, v_buf, layer, starts)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("h", [16, 128])
def test_a_position_comes_out_bit_for_bit_the_same_whatever_chunk_it_is_in(h):
  # A verify of T tokens and the T decode steps it stands for: once the
  # earlier tokens are in the cache, the same query gives the same bits.
  n, k, t = 6, 2, 4
  q, k_new, v_new, k_buf, v_buf = _operands(t, n, k, h, seed=5)
  starts = np.array([9, 3])
  together = _attend(q, k_new, v_new, k_buf, v_buf, 1, starts)
  for i in range(t):
    alone = _attend(q[:, i:i + 1], k_new[:, i:i + 1], v_new[:, i:i + 1], k_buf, v_buf, 1,
                    starts + i)
    np.testing.assert_array_equal(together[:, i], alone[:, 0])
    for row in range(B):  # now cache token i, as the decode step would have
      k_buf[1, row, starts[row] + i] = k_new[row, i]
      v_buf[1, row, starts[row] + i] = v_new[row, i]


def test_attend_refuses_shapes_that_do_not_fit():
  q, k_new, v_new, k_buf, v_buf = _operands(2, 6, 4, 16)  # 4 kv heads do not divide 6
  with pytest.raises(ValueError, match=r"K dividing N"):
    cpu_attention.attend(*map(jnp.asarray, (q, k_new, v_new, k_buf, v_buf)), jnp.int32(0),
                         jnp.zeros((B,), jnp.int32))


@pytest.mark.slow
def test_the_layer_loop_attends_with_the_kernel_as_xla_does():
  # A kernel model's layers run as one loop (`modules.Qwen2._scan_layers`)
  # whose attention is the kernel's: the same logits and caches as XLA's
  # attention, for a prompt and then a 3-token chunk after it.
  cfg = dataclasses.replace(tiny.PACKABLE_TARGET, num_layers=3)
  params = model.init_params(cfg, jax.random.key(1), scale=0.3)
  prompt = jax.random.randint(jax.random.key(2), (2, 9), 0, cfg.vocab_size)
  chunk = jnp.array([[3, 5, 7], [11, 13, 17]], jnp.int32)
  results = {}
  for fused in (False, True):
    m = bundle_lib.prepare(cfg, params, settings=jspec.Settings(kernels=True,
                                                                fused_attention=fused))
    fwd = jax.jit(lambda p, x, c, arch=m.arch: model.forward(arch, p, x, c))
    hlo = fwd.lower(m.params, chunk, cache_lib.init(cfg, 2, 40)).as_text()
    assert (cpu_kernels.TARGET_ATTEND in hlo) == fused
    logits, cache = fwd(m.params, prompt, cache_lib.init(cfg, 2, 40))
    more, cache = fwd(m.params, chunk, cache_lib.with_lengths(cache, jnp.array([9, 6])))
    results[fused] = (logits, more, cache.k, cache.v)
  chex.assert_trees_all_close(results[True], results[False], rtol=1e-4, atol=1e-4)


def _cache_copies(req: api.Request) -> list[str]:
  """The compiled loop's copies and transposes whose shape is one of its caches'."""
  state = req.prefill(*req.args)
  caches = {tuple(sorted(leaf.shape)) for leaf in jax.tree.leaves(state) if leaf.ndim == 5}
  assert caches, "no cache in the loop's state"
  copies = []
  for line in req.run.program().as_text().splitlines():
    m = re.search(r"= \w+\[([\d,]+)\]\S* (copy|transpose)\(", line)
    if m and tuple(sorted(int(d) for d in m.group(1).split(","))) in caches:
      copies.append(line.strip()[:120])
  return copies


def test_a_batched_decode_loop_writes_the_caches_in_place():
  # Each step writes every row's new keys and values at the row's own slot.
  # Done as a vmapped per-row update, XLA transposed the whole cache to rows
  # first and back around that write, every step: copies that grow with the
  # buffer and the batch. The compiled target-only loop (what a served batch
  # runs) must hold no cache-sized copy.
  bundle = tiny.packable_pair(kernels=True)
  rows = [tiny.prompt(seed, 5 + seed, tiny.PACKABLE_VOCAB) for seed in range(4)]
  req = api.request(bundle, rows, jspec.Options(max_new_tokens=24, method="target"))
  copies = _cache_copies(req)
  assert not copies, f"the loop copies a cache: {copies[:3]}"


@pytest.mark.parametrize("rows", [1, 2])
def test_the_speculative_loop_writes_the_caches_outside_its_switches(rows):
  # The verify picks its width, and the draft's catch-up its chunk, with a
  # `lax.switch`. A cache written inside the branches is copied into and out
  # of the switch every round; the branches return their keys and values
  # and one write follows the switch. Both models here run their layers as
  # one loop, as the real pair does: the draft's k and v projections fill a
  # panel, and it has two layers (a one-layer loop is inlined, and XLA then
  # copies the cache around the draft's steps, which no real draft has).
  draft_cfg = dataclasses.replace(tiny.PACKABLE_DRAFT, num_kv_heads=2, num_layers=2)
  kt, kd = jax.random.split(jax.random.key(0))
  bundle = bundle_lib.make(
      (tiny.PACKABLE_TARGET, model.init_params(tiny.PACKABLE_TARGET, kt, scale=0.3)),
      (draft_cfg, model.init_params(draft_cfg, kd, scale=0.3)),
      settings=jspec.Settings(kernels=True))
  prompts = [tiny.prompt(seed, 5 + seed, tiny.PACKABLE_VOCAB) for seed in range(rows)]
  req = api.request(bundle, prompts, jspec.Options(max_new_tokens=24))
  assert req.spec.method == "model" and len(decode.verify_widths(req.spec)) > 1
  copies = _cache_copies(req)
  assert not copies, f"the loop copies a cache: {copies[:3]}"
