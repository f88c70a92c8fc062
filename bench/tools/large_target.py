"""Large targets on this machine: random weights of Qwen2.5-7B / 14B shapes beside the real 0.5B draft.

Issue 33, item 4. The target is built one matrix at a time, each drawn
straight into the form it is stored in (never a whole float32 model):

  bf16     every matrix bfloat16, as an HF bf16 checkpoint holds it (kernel
           panels after `jspec.bundle.prepare`, widened exactly in the kernel)
  blocks   the int8 blocks jspec keeps a GGUF k-quant in (`jspec.weights.blocks`):
           Q6_K-like (B = 16, no offsets) for attn_v, ffn_down and the output
           head, as Q4_K_M stores them, Q4_K-like (B = 32, offsets) for every
           other matrix, the token table included

The target's vocabulary is padded past the draft's (152064 rows against
151936; `jspec.bundle.check_pair` masks the padding with the real
tokenizer). The draft is the real Qwen2.5-Coder-0.5B from jspec's cache,
int8 as `jspec.load` prepares it (`--draft smoke`: a tiny random one).

Measured here: target-only speed and the cost of one speculative round at
each fixed gamma, on the prompt ids of a real run (`--histograms`).
Random weights reject almost every draft, so a round emits one token, but
it costs what a real round of that gamma costs. How many tokens a real
round emits comes from the real pair's accepted-length histograms in the
same file (`bench.derive`): those speculative figures are derived, and are
labelled so. The histograms are the 1.5B target's with this draft; a 7B
or 14B target accepts this draft's tokens at its own rate, which only a
real checkpoint can measure.

Before building, the weight bytes are estimated; a shape whose estimate,
with the draft and the KV cache, passes `--max-gib` is refused.

  python -m bench.tools.large_target --shape smoke --storage blocks --draft smoke \\
      --max-new-tokens 8 --gammas 1,2 --out /tmp/large_smoke.json
  python -m bench.tools.large_target --shape 7b --storage blocks --max-new-tokens 16 \\
      --gammas 1,2,4,8 --out bench/results/large_7b_blocks.json
  python -m bench.tools.large_target --shape 7b --storage bf16 --max-new-tokens 16 \\
      --gammas 1,2,4,8 --out bench/results/large_7b_bf16.json
  python -m bench.tools.large_target --shape 14b --storage blocks --max-new-tokens 16 \\
      --gammas 1,2,4,8 --out bench/results/large_14b_blocks.json
  python -m bench.tools.large_target --shape 14b --storage bf16 --estimate-only
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib
import sys
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from bench import derive
from bench import machine
from bench import memory
from bench import modes as modes_lib
from bench import results
from convert import config as config_lib
from jspec import api
from jspec import bundle as bundle_lib
from jspec import cache as cache_lib
from jspec import model as model_lib
from jspec import weights

GIB = 1 << 30
DRAFT_VOCAB = 151936  # Qwen2.5-Coder-0.5B's embedding rows (`bench.shapes.QWEN25_CODER_0_5B`)
PADDED_VOCAB = 152064  # Qwen2.5-7B's and -14B's: past the draft's, as the real checkpoints
HISTOGRAMS = pathlib.Path(__file__).resolve().parents[1] / "results" / "gamma_sweep_cpu.json"
DEFAULT_PROMPT = "unit_tests"

_QWEN = dict(rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
             max_position_embeddings=32768, eos_token_ids=(151645,))
SHAPES = {
    "7b": config_lib.Qwen2Config(vocab_size=PADDED_VOCAB, hidden_size=3584,
                                 intermediate_size=18944, num_layers=28, num_heads=28,
                                 num_kv_heads=4, head_dim=128, **_QWEN),
    "14b": config_lib.Qwen2Config(vocab_size=PADDED_VOCAB, hidden_size=5120,
                                  intermediate_size=13824, num_layers=48, num_heads=40,
                                  num_kv_heads=8, head_dim=128, **_QWEN),
    # Every output width a multiple of 32 and every input width of 32, so each
    # matrix takes the same kernel path as at the real shapes; the vocabulary
    # padded past the smoke draft's, as the real target's is.
    "smoke": config_lib.Qwen2Config(vocab_size=320, hidden_size=64, intermediate_size=96,
                                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                                    rope_theta=1e4, max_position_embeddings=512),
}
SMOKE_DRAFT = config_lib.Qwen2Config(vocab_size=288, hidden_size=32, intermediate_size=64,
                                     num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                                     rope_theta=1e4, max_position_embeddings=512)

# Stored forms: (block size, with offsets) of the int8 blocks.
Q4_LIKE = (32, True)  # Q4_K: 4-bit values, a scale and a minimum per 32
Q6_LIKE = (16, False)  # Q6_K: 6-bit values, a scale per 16
Q6_MATRICES = ("attn/v/w", "mlp/down/w", "head/w")  # where Q4_K_M keeps Q6_K
# Random magnitudes: |W| about 0.01, so activations stay of order one.
BF16_EXPONENT = 0x3C00  # bfloat16 bits of 2**-7: values +-[2**-7, 2**-6)
Q4_SCALE = 0.0025  # (q - 8) * scale, q in 0..15
Q6_SCALE = 0.0006  # q * scale, q in -32..31
WEIGHT_STD = 0.02  # the float32 smoke draft's matrices and every bias


class _Vocab:
  """Stands in for a tokenizer where only its size matters (`bundle.check_pair`, smoke)."""

  def __init__(self, size: int):
    self.vocab_size = size


def _matrices(cfg: config_lib.Qwen2Config) -> list[tuple[str, tuple[int, int]]]:
  """Every weight matrix of a model: (params path, (outputs, inputs)), without building one.

  The same matrices `model.abstract_params` holds (a test checks it), counted
  from the config alone: tracing the modules of a 48-layer model takes
  seconds, and an estimate should not.

  Args:
    cfg: the config.

  Returns:
    The matrices, [out, in] as HF and GGUF orient them (a token table's
    outputs are its rows).
  """
  d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
  nh, kh = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  out = [("embed/table", (v, d))]
  if not cfg.tie_word_embeddings:
    out.append(("head/w", (v, d)))
  for i in range(cfg.num_layers):
    out += [(f"layers/{i}/attn/q/w", (nh, d)), (f"layers/{i}/attn/k/w", (kh, d)),
            (f"layers/{i}/attn/v/w", (kh, d)), (f"layers/{i}/attn/o/w", (d, nh)),
            (f"layers/{i}/mlp/gate/w", (f, d)), (f"layers/{i}/mlp/up/w", (f, d)),
            (f"layers/{i}/mlp/down/w", (d, f))]
  return out


def form_of(name: str, storage: str) -> tuple[int, bool]:
  """The block form a matrix gets under storage "blocks" (see the module docstring).

  Args:
    name: its params path.
    storage: "blocks".

  Returns:
    (block size, with offsets).
  """
  del storage
  return Q6_LIKE if name.endswith(Q6_MATRICES) else Q4_LIKE


def matrix_bytes(name: str, out: int, inp: int, storage: str) -> int:
  """Bytes one matrix holds in a storage form.

  Args:
    name: its params path.
    out, inp: its outputs and inputs.
    storage: "bf16", "blocks" or "f32".

  Returns:
    Bytes: values, plus a float32 scale (and offset) per block for "blocks"
    (Q4_K-like values, in [0, 15], two to a byte: `cpu_kernels.pack_blocks`).
  """
  if storage == "bf16":
    return 2 * out * inp
  if storage == "f32":
    return 4 * out * inp
  size, offsets = form_of(name, storage)
  values = out * inp // 2 if offsets else out * inp
  return values + 4 * (2 if offsets else 1) * out * (inp // size)


def kv_cache_bytes(cfg: config_lib.Qwen2Config, slots: int) -> int:
  """Bytes of a one-row float32 KV cache of `slots` slots (keys and values).

  Args:
    cfg: the model's config.
    slots: cache slots per row.

  Returns:
    Bytes.
  """
  return 2 * 4 * cfg.num_layers * slots * cfg.num_kv_heads * cfg.head_dim


def estimate(cfg: config_lib.Qwen2Config, storage: str) -> dict[str, int]:
  """The weight bytes a model holds in a storage form, before building it.

  Args:
    cfg: the config.
    storage: "bf16", "blocks" or "f32".

  Returns:
    {"matrix_bytes", "other_bytes" (float32 norms and biases), "total_bytes", "params"}.
  """
  mats = sum(matrix_bytes(n, o, i, storage) for n, (o, i) in _matrices(cfg))
  params = sum(o * i for _, (o, i) in _matrices(cfg))
  d, kh = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
  other = 4 * (cfg.num_layers * (2 * d + cfg.num_heads * cfg.head_dim + 2 * kh) + d)
  return {"matrix_bytes": int(mats), "other_bytes": int(other), "total_bytes": int(mats + other),
          "params": int(params)}


def _bf16_matrix(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
  """A random [rows, cols] bfloat16 matrix drawn as bits: a random sign and mantissa, one exponent.

  Args:
    rng: numpy generator.
    rows, cols: its shape.

  Returns:
    The matrix (a numpy bfloat16 array), every |value| in [2**-7, 2**-6).
  """
  bits = np.frombuffer(rng.bytes(2 * rows * cols), np.uint16).reshape(rows, cols)
  bits = (bits & np.uint16(0x807F)) | np.uint16(BF16_EXPONENT)
  return bits.view(jnp.bfloat16)


def _blocks_matrix(rng: np.random.Generator, out: int, inp: int, size: int,
                   offsets: bool) -> weights.Leaf:
  """A random int8 block matrix as jspec stores a GGUF k-quant (`weights.blocks`).

  Args:
    rng: numpy generator.
    out, inp: outputs and inputs ([out, in], HF orientation).
    size: block size B along the inputs.
    offsets: Q4_K-like (values 0..15, a scale and an offset per block) or
      Q6_K-like (values -32..31, a scale per block).

  Returns:
    The `Blocks` leaf.
  """
  q = np.frombuffer(rng.bytes(out * inp), np.uint8).reshape(out, inp)
  jitter = lambda: (0.5 + rng.random((out, inp // size), np.float32)).astype(np.float32)
  if offsets:
    q = (q & np.uint8(15)).view(np.int8)
    scale = Q4_SCALE * jitter()
    offset = -8.0 * scale
  else:
    q = (q & np.uint8(63)).view(np.int8)
    q -= np.int8(32)
    scale = Q6_SCALE * jitter()
    offset = None
  leaf = weights.blocks(q, scale, offset)
  del q
  return leaf


def build(cfg: config_lib.Qwen2Config, storage: str, seed: int = 0,
          log=lambda msg: None) -> dict:
  """A random params tree of `cfg`, every matrix drawn straight into its stored form.

  Holds at most the tree built so far plus one matrix in a scratch form;
  never a float32 copy of the model (but for storage "f32", the smoke draft).

  Args:
    cfg: the config.
    storage: "bf16" (Dense / Table bfloat16 leaves, packed by `bundle.prepare`),
      "blocks" (`weights.Blocks` leaves, packed here) or "f32" (float32
      Dense / Table leaves: small drafts).
    seed: numpy seed.
    log: called with a progress line now and then.

  Returns:
    The params tree `bundle.prepare` takes (norms near one, float32 biases).
  """
  rng = np.random.default_rng(seed)
  abstract = model_lib.abstract_params(cfg)
  leaves, tree = jax.tree_util.tree_flatten_with_path(abstract, is_leaf=weights.is_leaf)
  out = []
  t0 = time.perf_counter()
  for k, (path, leaf) in enumerate(leaves):
    name = model_lib.path_name(path)
    if not weights.is_leaf(leaf):
      shape = tuple(leaf.shape)
      if name.endswith("scale"):  # a norm
        value = 1.0 + 0.1 * rng.standard_normal(shape, np.float32)
      else:  # a bias
        value = WEIGHT_STD * rng.standard_normal(shape, np.float32)
      out.append(jnp.asarray(value, jnp.float32))
      continue
    i, o = leaf.shape
    is_table = isinstance(leaf, weights.Table)
    if storage == "blocks":
      value = _blocks_matrix(rng, o, i, *form_of(name, storage))
      if is_table and isinstance(value, weights.Dense):  # outputs not a multiple of 32
        value = weights.Table(value.w.T)
    elif storage in ("bf16", "f32"):
      # Drawn in the leaf's own layout (Table [V, D], Dense [I, O]): random
      # values need no transpose.
      shape = (o, i) if is_table else (i, o)
      m = (_bf16_matrix(rng, *shape) if storage == "bf16"
           else WEIGHT_STD * rng.standard_normal(shape, np.float32))
      value = (weights.Table if is_table else weights.Dense)(jnp.asarray(m))
      del m
    else:
      raise ValueError(f"storage={storage!r}: expected 'bf16', 'blocks' or 'f32'")
    out.append(jax.block_until_ready(value))
    if name.startswith("layers/") and name.endswith("mlp/up/w"):
      log(f"built layer {name.split('/')[1]} of {cfg.num_layers} "
          f"({time.perf_counter() - t0:.0f}s, RSS {(memory.rss_bytes() or 0) / GIB:.1f} GiB)")
    del value
  return jax.tree_util.tree_unflatten(tree, out)


def load_draft(kind: str, log=lambda msg: None) -> tuple[bundle_lib.Model, Any, dict[str, Any]]:
  """The draft and the tokenizer the pair check uses.

  Args:
    kind: "real" (Qwen2.5-Coder-0.5B from jspec's cache, prepared as
      `jspec.load` prepares a draft: float32 -> int8) or "smoke" (a tiny
      random draft of `SMOKE_DRAFT`).
    log: progress lines.

  Returns:
    (the prepared draft, its tokenizer (a stand-in with only a size for
    "smoke"), what the results record about it).
  """
  if kind == "smoke":
    params = build(SMOKE_DRAFT, "f32", seed=1)
    return (bundle_lib.prepare(SMOKE_DRAFT, params, "draft", consume=True),
            _Vocab(SMOKE_DRAFT.vocab_size), {"source": "smoke: tiny random draft"})
  from bench import models  # pylint: disable=import-outside-toplevel (imports convert, gguf)
  from jspec import fetch  # pylint: disable=import-outside-toplevel
  from jspec import loading  # pylint: disable=import-outside-toplevel
  t_name, d_name = fetch.PAIRS[loading.DEFAULT_PAIR]
  _, path = models.checkpoint_files(loading.DEFAULT_PAIR)
  log(f"loading the draft from {path}")
  draft = models.prepare_checkpoint(path, "draft", bundle_lib.Settings())
  # The target's tokenizer: the pair's, which lists the draft's 151936 rows.
  source = fetch.get_source(t_name)
  gguf = fetch.cache_dir() / source.filename
  tok = loading._read_tokenizer_cache(loading._tokenizer_cache_path(gguf), source.sha256)  # pylint: disable=protected-access
  if tok is None:
    tok = loading._cached_tokenizer(gguf, source.sha256)  # pylint: disable=protected-access
  return draft, tok, {"source": f"{d_name} ({path}), int8 as jspec.load prepares a draft",
                      "tokenizer": f"{t_name} (vocab_size {tok.vocab_size})"}


def finite_check(m: bundle_lib.Model, token: int) -> dict[str, Any]:
  """One forward of one token through the target: its logits must be finite.

  Args:
    m: the prepared target.
    token: the token id.

  Returns:
    {"finite", "logits_abs_max", "logits_std"}.
  """
  cache = cache_lib.init(m.cfg, 1, 8, jnp.dtype(m.backend.dtype))
  fwd = jax.jit(model_lib.forward, static_argnums=(0,))
  logits, _ = fwd(m.arch, m.params, jnp.array([[token]], jnp.int32), cache)
  logits = np.asarray(logits, np.float32)
  return {"finite": bool(np.isfinite(logits).all()),
          "logits_abs_max": float(np.abs(logits).max()), "logits_std": float(logits.std())}


def _warm_tokens(n_prompt: int, n: int, gamma_max: int) -> int:
  """The shortest generation that compiles the same programs as one of n tokens (same width)."""
  width = api.widths(n_prompt, n, gamma_max)[1]
  return max(1, min(n, width // 2 - n_prompt - gamma_max - 1))


def measure(bundle: jspec.Bundle, ids: list[int], chosen: list[modes_lib.Mode], n: int,
            reps: int, warmup: bool, log=lambda msg: None) -> dict[str, dict[str, Any]]:
  """Times every mode on one prompt; repetitions interleaved across modes.

  `jspec.generate` keeps compile time out of its timings, so a mode's
  first call counts; `warmup` first runs each mode once, shorter, on the
  same programs.

  Args:
    bundle: the pair.
    ids: prompt ids.
    chosen: the modes (target and spec_g<G>).
    n: max_new_tokens (EOS off: every generation is n long).
    reps: timed repetitions per mode; figures are medians.
    warmup: run each mode once first, untimed.
    log: progress lines.

  Returns:
    Mode name -> record: new_tokens, token_ids, tokens_per_s,
    decode_tokens_per_s, prefill_s, decode_s, rounds, round_s,
    accepted_histogram, compile_s, reps.
  """
  runs: dict[str, list] = {m.name: [] for m in chosen}
  compile_s = {m.name: 0.0 for m in chosen}
  if warmup:
    for m in chosen:
      gamma_max = jspec.Options(**m.kwargs).gammas()[1]
      r = jspec.generate(bundle, ids, max_new_tokens=_warm_tokens(len(ids), n, gamma_max),
                         temperature=0.0,
                         stop_at_eos=False, **m.kwargs)
      compile_s[m.name] += r.stats["compile_s"]
      log(f"warmed {m.name} (compile {r.stats['compile_s']:.1f}s)")
  for rep in range(reps):
    for m in chosen:
      r = jspec.generate(bundle, ids, max_new_tokens=n, temperature=0.0, stop_at_eos=False,
                         **m.kwargs)
      compile_s[m.name] += r.stats["compile_s"]
      runs[m.name].append(r)
      s = r.stats
      log(f"rep {rep + 1}/{reps} {m.name}: prefill {s['prefill_s']:.2f}s decode "
          f"{s['decode_s']:.2f}s over {s['rounds']} rounds "
          f"({1e3 * s['decode_s'] / max(s['rounds'], 1):.0f} ms/round), compile "
          f"{s['compile_s']:.1f}s, RSS {(memory.rss_bytes() or 0) / GIB:.1f} GiB")
  out = {}
  for m in chosen:
    rs = runs[m.name]
    med = lambda key: float(np.median([r.stats[key] for r in rs]))
    first = rs[0]
    new = len(first.token_ids)
    rounds = first.stats["rounds"]
    decode_s, prefill_s = med("decode_s"), med("prefill_s")
    out[m.name] = {
        "gamma": m.gamma, "kwargs": dict(m.kwargs), "new_tokens": new,
        "token_ids": list(first.token_ids),
        "reps_identical": all(r.token_ids == first.token_ids for r in rs),
        "tokens_per_s": new / (prefill_s + decode_s),
        "decode_tokens_per_s": (new - 1) / decode_s if decode_s > 0 else None,
        "prefill_s": prefill_s, "decode_s": decode_s, "rounds": rounds,
        "round_s": decode_s / rounds if rounds else None,
        "acceptance_rate": first.stats["acceptance_rate"],
        "accepted_histogram": list(first.stats["accepted_histogram"]),
        "compile_s": compile_s[m.name],
        "reps": [{"prefill_s": r.stats["prefill_s"], "decode_s": r.stats["decode_s"],
                  "rounds": r.stats["rounds"]} for r in rs],
    }
  return out


def _suite_derived(hist_doc: dict[str, Any], rec: dict[str, Any], mode: str) -> Optional[dict]:
  """The derived decode speed from the histograms of every prompt of the file, summed."""
  total: list[int] = []
  for entry in hist_doc.get("prompts", {}).values():
    h = entry.get("modes", {}).get(mode, {}).get("accepted_histogram") or []
    total = [a + b for a, b in zip(total + [0] * (len(h) - len(total)),
                                   h + [0] * (len(total) - len(h)))]
  e = derive.tokens_per_round(total) if total else None
  if e is None or not rec.get("round_s"):
    return None
  return {"mean_tokens_per_round": e, "decode_tokens_per_s": e / rec["round_s"],
          "histogram": total}


def _prompt_ids(hist_doc: dict[str, Any], name: str, limit: int) -> tuple[list[int], str]:
  """The real run's ids of a prompt; for a vocabulary too small for them, the ids mod its size."""
  if name not in hist_doc.get("prompts", {}):
    raise ValueError(f"prompt {name!r} is not in the histograms file; it has "
                     f"{sorted(hist_doc.get('prompts', {}))}")
  ids = list(hist_doc["prompts"][name]["prompt_ids"])
  if max(ids) < limit:
    return ids, "histograms file"
  return [i % limit for i in ids], f"histograms file, mod {limit} (a vocabulary of {limit})"


def _shown(path: pathlib.Path) -> str:
  """A path as the results name it: relative to the repository when inside it."""
  root = pathlib.Path(__file__).resolve().parents[2]
  try:
    return str(path.resolve().relative_to(root))
  except ValueError:
    return str(path)


def _fmt_bytes(n: Optional[float]) -> str:
  if n is None:
    return "-"
  return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / 2**20:.1f} MiB"


def table(doc: dict[str, Any]) -> str:
  """The run as markdown: a summary line and one row per gamma.

  Args:
    doc: the results document of `main`.

  Returns:
    Markdown.
  """
  s = doc["summary"]
  lines = [
      f"**{doc['shape']} target, {doc['storage']}** (random weights; draft: "
      f"{doc['draft']['source'].split(' (')[0]}; prompt {doc['prompt']}, "
      f"{doc['settings']['max_new_tokens']} new tokens, {doc['settings']['reps']} rep(s))",
      "",
      "| storage | weight bytes (target + draft) | peak RSS | peak RSS / bytes loaded | "
      "target-only tok/s (decode) | target-only tok/s (incl. prefill) | prefill s |",
      "|---|---|---|---|---|---|---|",
      f"| {doc['storage']} | {_fmt_bytes(s['target_bytes'])} + {_fmt_bytes(s['draft_bytes'])} "
      f"| {_fmt_bytes(s['peak_rss_bytes'])} | {s['peak_rss_over_loaded']:.2f} | "
      f"{s['target_decode_tokens_per_s']:.3f} | {s['target_tokens_per_s']:.3f} | "
      f"{s['target_prefill_s']:.1f} |",
      "",
      f"Speculative rounds (measured: round ms; **derived** from the real 1.5B/0.5B pair's "
      f"histograms in `{doc['derived']['source']}`, prompt `{doc['prompt']}` and summed over "
      f"its prompts):",
      "",
      "| gamma | round ms (measured) | E tokens/round (prompt) | **derived** spec tok/s "
      "(decode) | **derived** x target | E (suite) | **derived** spec tok/s (decode, suite) | "
      "**derived** spec tok/s (incl. prefill) |",
      "|---|---|---|---|---|---|---|---|",
  ]
  for row in s["gammas"]:
    f = lambda v, p=2: "-" if v is None else f"{v:.{p}f}"
    lines.append(f"| {row['gamma']} | {f(row['round_ms'], 0)} | {f(row['E'])} | "
                 f"{f(row['derived_decode_tokens_per_s'], 3)} | {f(row['derived_speedup'])} | "
                 f"{f(row['E_suite'])} | {f(row['derived_suite_decode_tokens_per_s'], 3)} | "
                 f"{f(row['derived_tokens_per_s'], 3)} |")
  return "\n".join(lines)


def _summary(doc: dict[str, Any], records: dict[str, Any], hist_doc: dict[str, Any]) -> dict:
  """The table's figures from the records (derived ones from `derive.apply`'s record["derived"])."""
  tgt = records["target"]
  w = doc["weights"]
  loaded = w["target_param_bytes"] + w["draft_param_bytes"]
  rows = []
  for name, rec in records.items():
    if rec["gamma"] is None:
      continue
    d = rec.get("derived") or {}
    suite = _suite_derived(hist_doc, rec, name)
    dec = d.get("decode_tokens_per_s")
    rows.append({
        "gamma": rec["gamma"], "round_ms": 1e3 * rec["round_s"] if rec["round_s"] else None,
        "E": d.get("mean_tokens_per_round"), "derived_decode_tokens_per_s": dec,
        "derived_speedup": (dec / tgt["decode_tokens_per_s"]
                            if dec and tgt["decode_tokens_per_s"] else None),
        "derived_tokens_per_s": d.get("tokens_per_s"),
        "E_suite": (suite or {}).get("mean_tokens_per_round"),
        "derived_suite_decode_tokens_per_s": (suite or {}).get("decode_tokens_per_s"),
    })
  rows.sort(key=lambda r: r["gamma"])
  peak = doc["memory"]["peak_rss_bytes"]
  return {"target_bytes": w["target_param_bytes"], "draft_bytes": w["draft_param_bytes"],
          "peak_rss_bytes": peak, "peak_rss_over_loaded": peak / loaded,
          "target_decode_tokens_per_s": tgt["decode_tokens_per_s"],
          "target_tokens_per_s": tgt["tokens_per_s"], "target_prefill_s": tgt["prefill_s"],
          "target_round_ms": 1e3 * tgt["round_s"] if tgt["round_s"] else None,
          "gammas": rows,
          "label": "round ms and target-only figures measured on random weights of the real "
                   "shapes; every speculative tok/s is derived (bench.derive) from the real "
                   "1.5B/0.5B pair's accepted-length histograms, not measured"}


def main(argv: Optional[list[str]] = None) -> int:
  """Builds the target, loads the draft, measures, derives, writes the JSON and prints the table.

  Args:
    argv: command-line arguments (None: sys.argv).

  Returns:
    The exit status: 0, 1 when the logits are not finite or a generation
    produced no tokens, 2 when the estimate does not fit.
  """
  ap = argparse.ArgumentParser(prog="python -m bench.tools.large_target",
                               description=__doc__.split("\n")[0])
  ap.add_argument("--shape", choices=sorted(SHAPES), default="7b")
  ap.add_argument("--storage", choices=("bf16", "blocks"), default="blocks")
  ap.add_argument("--draft", choices=("real", "smoke"), default=None,
                  help="real: the 0.5B from jspec's cache; smoke: a tiny random one "
                       "(default: smoke for --shape smoke, else real)")
  ap.add_argument("--max-new-tokens", type=int, default=16)
  ap.add_argument("--gammas", default="1,2,4,8", help="fixed gammas, comma-separated")
  ap.add_argument("--reps", type=int, default=1)
  ap.add_argument("--warmup", action="store_true",
                  help="run each mode once, shorter, before timing (compile time is outside "
                       "jspec's timings either way)")
  ap.add_argument("--histograms", type=pathlib.Path, default=HISTOGRAMS,
                  help="a real run's results JSON with spec_g<G> histograms")
  ap.add_argument("--prompt", default=DEFAULT_PROMPT, help="a prompt of the histograms file")
  ap.add_argument("--max-gib", type=float, default=21.0,
                  help="refuse a shape whose estimated weights + draft + KV cache pass this")
  ap.add_argument("--estimate-only", action="store_true", help="print the estimate and stop")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--out", type=pathlib.Path, default=None)
  args = ap.parse_args(argv)
  gammas = [int(g) for g in args.gammas.split(",") if g.strip()]
  draft_kind = args.draft or ("smoke" if args.shape == "smoke" else "real")
  log = lambda msg: print(f"large_target: {msg}", file=sys.stderr, flush=True)
  cfg = SHAPES[args.shape]
  hist_doc = json.loads(args.histograms.read_text())
  n_prompt = len(hist_doc["prompts"][args.prompt]["prompt_ids"]) if args.prompt in hist_doc.get(
      "prompts", {}) else 64
  slots = api.widths(n_prompt, args.max_new_tokens, max(gammas))[1]

  est = estimate(cfg, args.storage)
  d_cfg = SMOKE_DRAFT if draft_kind == "smoke" else None
  draft_est = (estimate(SMOKE_DRAFT, "f32")["total_bytes"] if d_cfg
               else 600_000_000)  # the 0.5B's int8 panels, scales and float32 norms
  kv = kv_cache_bytes(cfg, slots)
  need = est["total_bytes"] + draft_est + kv
  log(f"{args.shape} {args.storage}: {est['params'] / 1e9:.2f}B matrix weights -> "
      f"{est['total_bytes'] / GIB:.2f} GiB; + draft ~{draft_est / GIB:.2f} GiB + KV cache "
      f"{kv / 2**20:.1f} MiB = {need / GIB:.2f} GiB (limit {args.max_gib} GiB)")
  estimate_doc = {**est, "draft_bytes_estimate": draft_est, "kv_cache_bytes": kv,
                  "needed_bytes": need, "max_gib": args.max_gib,
                  "fits": need <= args.max_gib * GIB}
  if args.estimate_only or not estimate_doc["fits"]:
    if not estimate_doc["fits"]:
      log(f"does not fit: {need / GIB:.2f} GiB > {args.max_gib} GiB; not building it")
    print(json.dumps(estimate_doc, indent=1))
    return 0 if estimate_doc["fits"] or args.estimate_only else 2

  t0 = time.perf_counter()
  draft, tok, draft_info = load_draft(draft_kind, log)
  memory.release_freed()
  draft_s = time.perf_counter() - t0
  limit = bundle_lib.check_pair(cfg, draft.cfg, tok)  # the padded vocabulary, masked
  log(f"draft ready in {draft_s:.0f}s; pair check: vocab_limit {limit} "
      f"(target {cfg.vocab_size} rows, draft {draft.cfg.vocab_size})")

  t0 = time.perf_counter()
  params = build(cfg, args.storage, args.seed, log)
  target = bundle_lib.prepare(cfg, params, "target", consume=True)
  del params
  gc.collect()
  memory.release_freed()
  build_s = time.perf_counter() - t0
  forms = sorted({type(w).__name__ for w in jax.tree.leaves(target.params, is_leaf=weights.is_leaf)
                  if weights.is_leaf(w)})
  log(f"target built and prepared in {build_s:.0f}s: {forms}, "
      f"{memory.param_bytes(target.params) / GIB:.2f} GiB, RSS "
      f"{(memory.rss_bytes() or 0) / GIB:.1f} GiB")
  bundle = jspec.Bundle(target, draft, None if isinstance(tok, _Vocab) else tok,
                        vocab_limit=limit)

  ids, ids_from = _prompt_ids(hist_doc, args.prompt, limit or cfg.vocab_size)
  finite = finite_check(target, ids[-1])
  log(f"one-token forward: {finite}")
  chosen = [m for m in modes_lib.all_modes(gammas, 8, 0.5, 4, 3)
            if m.name == "target" or (m.gamma is not None and m.group == "spec")]
  records = measure(bundle, ids, chosen, args.max_new_tokens, args.reps, args.warmup, log)
  produced = all(r["new_tokens"] == args.max_new_tokens
                 and all(0 <= t < (limit or cfg.vocab_size) for t in r["token_ids"])
                 for r in records.values())

  doc: dict[str, Any] = {
      "schema": "large_target/1", "tool": "bench.tools.large_target",
      "command": [sys.executable, "-m", "bench.tools.large_target"] + list(
          sys.argv[1:] if argv is None else argv),
      "git": machine.git(), "machine": machine.describe(),
      "shape": args.shape, "storage": args.storage, "prompt": args.prompt,
      "settings": {"max_new_tokens": args.max_new_tokens, "gammas": gammas, "reps": args.reps,
                   "warmup": args.warmup, "temperature": 0.0, "stop_at_eos": False,
                   "seed": args.seed, "histograms": _shown(args.histograms)},
      "config": cfg.to_dict(), "draft_config": draft.cfg.to_dict(), "draft": draft_info,
      "vocab_limit": limit, "estimate": estimate_doc,
      "target_forms": forms,
      "storage_forms": ({"Q6_K-like (B=16, no offsets)": list(Q6_MATRICES),
                         "Q4_K-like (B=32, offsets)": "every other matrix, embed/table included"}
                        if args.storage == "blocks" else "bfloat16 kernel panels"),
      "weights": {"target_param_bytes": memory.param_bytes(target.params),
                  "target_forward_bytes": memory.forward_bytes(cfg, target.params),
                  "draft_param_bytes": memory.param_bytes(draft.params),
                  "draft_forward_bytes": memory.forward_bytes(draft.cfg, draft.params),
                  "kv_cache_bytes": kv},
      "timings": {"draft_load_s": draft_s, "target_build_s": build_s},
      "finite_check": finite, "tokens_produced": produced,
      "prompts": {args.prompt: {"prompt_ids": ids, "prompt_ids_from": ids_from,
                                "prompt_tokens": len(ids), "modes": records}},
  }
  derive.apply(doc, hist_doc, _shown(args.histograms))
  doc["memory"] = {"peak_rss_bytes": memory.peak_rss_bytes(), "rss_end_bytes": memory.rss_bytes()}
  doc["summary"] = _summary(doc, records, hist_doc)
  if args.out is not None:
    results.write(doc, args.out)  # a temporary file beside it, then os.replace
    log(f"wrote {args.out}")
  print(table(doc))
  ok = finite["finite"] and produced
  if not ok:
    log(f"FAILED: finite logits {finite['finite']}, tokens produced {produced}")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
