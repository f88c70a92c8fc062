"""Shared tiny-model fixtures: random HF Qwen2 models, a byte-level vocab, GGUF writing.

Sizes are small primes (or odd products) where the architecture allows, so a
swapped axis shows up as a shape error instead of passing by coincidence.
"""

import atexit
import os
import shutil
import tempfile

import numpy as np
import pytest

# Tests never touch the user's jspec cache (assembled models, converted
# params, compiled programs): everything goes to a throwaway directory,
# removed when the process that made it exits (pytest-xdist's workers inherit
# the variable, so only the controller makes and removes it).
if "JSPEC_CACHE" not in os.environ:
  os.environ["JSPEC_CACHE"] = tempfile.mkdtemp(prefix="jspec-test-cache-")
  atexit.register(shutil.rmtree, os.environ["JSPEC_CACHE"], ignore_errors=True)

# Most of the suite's time is XLA compiling the tiny models' programs, and
# most of that is LLVM optimising and emitting every fusion. The tests check
# results, not speed, so they compile with LLVM's cheapest optimisations and
# with XLA CPU's older (faster to compile) fusion emitter: the same optimised
# HLO, only each fusion's machine code differs, and less compile time.
# Not LLVM's O0: on an AVX-512 (Zen 5) host it miscompiled a tiny int8
# forward (test_layout's loop test, logits 0.21 off whether jspec's int8
# kernel or XLA's int8 dot ran), where O1 and the shipped O2 agree; O1
# took the engine, lossless and layout tests 222 s against O0's 175.
# JSPEC_TEST_XLA_OPT=1 tests the shipped compiler settings instead. Set
# before any test imports jax; the pytest-xdist workers and the CLI
# subprocesses inherit it.
if os.environ.get("JSPEC_TEST_XLA_OPT") != "1":
  os.environ["XLA_FLAGS"] = " ".join([
      os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=1",
      "--xla_cpu_use_fusion_emitters=false"]).strip()

# 256 single-byte tokens + 3 merges + 3 control + 1 user-defined token = 263
# ids (a prime). "1 2" is a merge the Qwen2 split regex never lets apply (it
# isolates digits).
TINY_MERGES = ("Ġ t", "h e", "1 2")
TINY_CONTROL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TINY_USER = ("<tool_call>",)
TINY_VOCAB_SIZE = 263


def _byte_alphabet():
  """GPT-2's bytes -> printable characters table (as in tokenizers' ByteLevel)."""
  printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
               + list(range(ord("®"), ord("ÿ") + 1)))
  chars, extra = {}, 0
  for b in range(256):
    if b in printable:
      chars[b] = chr(b)
    else:
      chars[b] = chr(256 + extra)
      extra += 1
  return chars


@pytest.fixture(autouse=True, scope="module")
def _release_programs():
  """Frees each test file's compiled programs when the file is done.

  Every compiled program stays in `jspec.programs.PROGRAMS` until released, and
  a decode program holds its executable's memory. Kept over the whole
  suite, XLA crashed (a segfault, then twice an abort) while writing one
  more program to the persistent cache, in three full runs in a row; with
  programs released per file the suite passes (peak RSS 5.6 GiB).
  """
  yield
  from jspec import programs  # after the cache directory above is set
  programs.release()


@pytest.fixture(scope="session")
def tiny_vocab():
  """(tokens, merges, token_types) of a 263-id Qwen2-style byte-level BPE vocab."""
  alphabet = _byte_alphabet()
  tokens = [alphabet[b] for b in range(256)]
  tokens += ["".join(m.split(" ")) for m in TINY_MERGES]
  tokens += list(TINY_CONTROL) + list(TINY_USER)
  types = [1] * (256 + len(TINY_MERGES)) + [3] * len(TINY_CONTROL) + [4] * len(TINY_USER)
  assert len(tokens) == TINY_VOCAB_SIZE
  return tokens, list(TINY_MERGES), types


@pytest.fixture(scope="session")
def make_hf_model():
  """Factory: (seed, std, **Qwen2Config overrides) -> random fp32 Qwen2ForCausalLM in eval mode.

  Weights are N(0, std) with std 0.1 by default (larger than HF's 0.02 init so
  that logits spread and a wrong weight shows), norm weights 1 + N(0, std).
  """
  import torch
  import transformers

  def make(seed=0, std=0.1, **overrides):
    kwargs = dict(vocab_size=TINY_VOCAB_SIZE, hidden_size=58, head_dim=14, intermediate_size=37,
                  num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                  rope_theta=12345.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  max_position_embeddings=512, eos_token_id=TINY_VOCAB_SIZE - 1)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kwargs)).eval()
    with torch.no_grad():
      for name, p in model.named_parameters():
        p.normal_(0.0, std)
        if "norm" in name:
          p.add_(1.0)
    return model

  return make


_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def hf_to_gguf_name(name):
  """HF tensor name -> llama.cpp name (written independently of convert.keys)."""
  top = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
         "model.norm.weight": "output_norm.weight"}
  if name in top:
    return top[name]
  _, _, layer, *module, leaf = name.split(".")
  return f"blk.{layer}.{_GGUF_NAMES['.'.join(module)]}.{leaf}"


@pytest.fixture(scope="session")
def write_gguf(tiny_vocab):
  """Factory writing a qwen2 GGUF file like llama.cpp's converter does.

  Args of the factory:
    path: output file.
    model: an HF Qwen2ForCausalLM (None: a vocab-only file).
    quant: GGUF tensor name suffix (e.g. "attn_q.weight") -> GGMLQuantizationType.
    extra: {gguf name: array} written as they are (for bad-input tests).
    drop: GGUF names to leave out.
    meta: metadata overrides {key: value} (strings, ints or floats).
  """
  import gguf
  from gguf import quants

  def write(path, model=None, quant=None, extra=None, drop=(), meta=None, vocab=True):
    writer = gguf.GGUFWriter(str(path), "qwen2")
    if model is not None:
      c = model.config
      writer.add_block_count(c.num_hidden_layers)
      writer.add_context_length(c.max_position_embeddings)
      writer.add_embedding_length(c.hidden_size)
      writer.add_feed_forward_length(c.intermediate_size)
      writer.add_head_count(c.num_attention_heads)
      writer.add_head_count_kv(c.num_key_value_heads)
      writer.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
      writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    for key, value in (meta or {}).items():
      if isinstance(value, str):
        writer.add_string(key, value)
      elif isinstance(value, float):
        writer.add_float32(key, value)
      else:
        writer.add_uint32(key, value)
    if vocab:
      tokens, merges, types = tiny_vocab
      writer.add_tokenizer_model("gpt2")
      writer.add_tokenizer_pre("qwen2")
      writer.add_token_list(tokens)
      writer.add_token_merges(merges)
      writer.add_token_types(types)
      writer.add_eos_token_id(tokens.index("<|im_end|>"))
      writer.add_bos_token_id(tokens.index("<|endoftext|>"))
      writer.add_add_bos_token(False)
      writer.add_chat_template(
          "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    quant = quant or {}
    if model is not None:
      for hf_name, tensor in model.state_dict().items():
        name = hf_to_gguf_name(hf_name)
        if name in drop:
          continue
        data = tensor.detach().float().numpy()
        kind = next((q for suffix, q in quant.items() if name.endswith(suffix)), None)
        if kind is None:
          writer.add_tensor(name, data)
        else:
          writer.add_tensor(name, quants.quantize(data, kind), raw_dtype=kind)
    for name, data in (extra or {}).items():
      writer.add_tensor(name, np.asarray(data, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

  return write
