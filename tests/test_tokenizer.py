"""jspec.tokenizer on a tiny Qwen2-style vocab: from GGUF metadata and from tokenizer.json."""

import json

import pytest
import transformers

from jspec import tokenizer as tokenizer_lib

TEXTS = [
    "the thin inn",
    "def f(x):\n    return x  # naïve café π\n\n",
    "日本語 👋🏽\t\r\n  the   end  ",
    "don't STOP 12345",
    "",
]


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory, write_gguf):
  return write_gguf(tmp_path_factory.mktemp("vocab") / "vocab.gguf")  # vocab only, no tensors


def test_gguf_round_trip_and_merges(gguf_path):
  tok = tokenizer_lib.from_gguf(gguf_path)
  assert tok.vocab_size == 263
  for text in TEXTS:
    assert tok.decode(tok.encode(text)) == text
  the = [tok.token_id("Ġt"), tok.token_id("he")]
  assert tok.encode(" the") == the  # both merges applied
  # The split regex keeps a leading space with its word and every digit apart,
  # so the "1 2" merge never applies.
  assert tok.encode("1 the") == [tok.token_id("1")] + the
  assert tok.encode("12") == [tok.token_id("1"), tok.token_id("2")]


def test_gguf_special_tokens(gguf_path):
  tok = tokenizer_lib.from_gguf(gguf_path)
  start, end = tok.token_id("<|im_start|>"), tok.token_id("<|im_end|>")
  ids = tok.encode("<|im_start|>user\nthe<|im_end|>")
  assert ids[0] == start and ids[-1] == end
  assert tok.decode(ids) == "<|im_start|>user\nthe<|im_end|>"
  # A user-defined token (type 4) also stays whole.
  assert tok.encode("x<tool_call>") == [tok.token_id("x"), tok.token_id("<tool_call>")]
  # im_end (the file's eos) first, then endoftext.
  assert tok.eos_token_ids == (end, tok.token_id("<|endoftext|>"))
  assert tok.eos_token == "<|im_end|>" and tok.bos_token == "<|endoftext|>"


def test_gguf_matches_transformers(gguf_path):
  ref = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
  tok = tokenizer_lib.from_gguf(gguf_path)
  for text in TEXTS + ["<|im_start|>system\nthe<|im_end|>\n<tool_call>"]:
    assert tok.encode(text) == ref.encode(text, add_special_tokens=False), text


def test_chat_template(gguf_path):
  tok = tokenizer_lib.from_gguf(gguf_path)
  messages = [{"role": "user", "content": "hi"}]
  assert tok.apply_chat_template(messages) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
  assert tok.apply_chat_template(messages, add_generation_prompt=False).endswith("<|im_end|>\n")
  failing = tokenizer_lib.Tokenizer(tok.backend, chat_template="{{ raise_exception('no') }}")
  with pytest.raises(tokenizer_lib.TokenizerError, match="no"):
    failing.apply_chat_template(messages)
  with pytest.raises(tokenizer_lib.TokenizerError, match="no chat template"):
    tokenizer_lib.Tokenizer(tok.backend).apply_chat_template(messages)


def test_hf_dir_matches_gguf(gguf_path, tmp_path):
  gguf_tok = tokenizer_lib.from_gguf(gguf_path)
  gguf_tok.backend.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({
      "chat_template": gguf_tok.chat_template, "eos_token": "<|im_end|>",
      "bos_token": None}))
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [261, 259]}))
  tok = tokenizer_lib.load(tmp_path)
  for text in TEXTS:
    assert tok.encode(text) == gguf_tok.encode(text)
    assert tok.decode(tok.encode(text)) == text
  assert tok.eos_token_ids == (261, 259)
  assert tok.chat_template == gguf_tok.chat_template


def test_other_tokenizer_refused(tmp_path, write_gguf):
  path = write_gguf(tmp_path / "llama.gguf", vocab=False,
                    meta={"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "llama-bpe"})
  with pytest.raises(tokenizer_lib.TokenizerError, match="llama-bpe"):
    tokenizer_lib.load(path)
  with pytest.raises(tokenizer_lib.TokenizerError, match="no tokenizer.json"):
    tokenizer_lib.load(tmp_path)
