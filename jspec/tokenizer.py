"""The Qwen2 tokenizer, from an HF directory (tokenizer.json) or a GGUF file's vocabulary.

Qwen2 tokenizes with byte-level BPE: text is split by a regex into words,
each word's UTF-8 bytes are spelled in GPT-2's 256-character byte alphabet,
and merges join them. A GGUF file carries the pieces (`tokenizer.ggml.tokens`,
`.merges`, `.token_type`) but not the pipeline; `from_gguf` rebuilds it as
llama.cpp and transformers do for `tokenizer.ggml.pre == "qwen2"`: the Qwen2
split regex, no normalizer, no BOS, and the control tokens (`<|im_start|>`,
`<|endoftext|>`, ...) added as special tokens so they encode as single ids.

(The tokenizer.json that HF ships also NFC-normalizes text first. GGUF files
do not record that and llama.cpp does not do it, so the two agree on any text
already in NFC, which is nearly all text; a GGUF tokenizer keeps
decode(encode(s)) == s for any s.)
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, Iterable, Mapping, Optional, Sequence

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

# transformers' Qwen2 PRETOKENIZE_REGEX (= llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# llama.cpp token types (gguf.TokenType).
_CONTROL = 3
_USER_DEFINED = 4

# Tokens that end a Qwen2 generation. A GGUF file records one eos id
# (<|im_end|> for the instruct models); HF's generation_config.json lists
# <|endoftext|> as well, which a base-style completion ends with.
_END_TOKENS = ("<|im_end|>", "<|endoftext|>")


class TokenizerError(ValueError):
  """A tokenizer cannot be built from what the checkpoint holds."""


class Tokenizer:
  """Text <-> token ids for one model, plus its chat template.

  Attributes:
    backend: the `tokenizers.Tokenizer` doing the work.
    eos_token_ids: ids that end a generation (first: the checkpoint's own eos).
    chat_template: the Jinja chat template, or None.
    bos_token, eos_token: their strings (for templates), or None.
  """

  def __init__(self, backend: tokenizers.Tokenizer, eos_token_ids: Sequence[int] = (),
               chat_template: Optional[str] = None, bos_token: Optional[str] = None,
               eos_token: Optional[str] = None):
    self.backend = backend
    self.eos_token_ids = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
    self.chat_template = chat_template
    self.bos_token = bos_token
    self.eos_token = eos_token

  @property
  def vocab_size(self) -> int:
    """Number of ids the tokenizer knows, added tokens included."""
    return self.backend.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str) -> list[int]:
    """Tokenizes text; special tokens written in it (e.g. "<|im_start|>") become their ids.

    Args:
      text: any string.

    Returns:
      Token ids (nothing added: Qwen2 uses no BOS).
    """
    return self.backend.encode(text, add_special_tokens=False).ids

  def decode(self, ids: Iterable[int]) -> str:
    """Turns ids back into text, special tokens included.

    Args:
      ids: token ids.

    Returns:
      The text (incomplete UTF-8 at the end shows as U+FFFD).
    """
    return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)

  def token_id(self, token: str) -> Optional[int]:
    """The id of one token string, or None.

    Args:
      token: e.g. "<|im_end|>".

    Returns:
      Its id, or None if it is not in the vocabulary.
    """
    return self.backend.token_to_id(token)

  def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                          add_generation_prompt: bool = True, **kwargs) -> str:
    """Renders a conversation with the model's chat template (needs jinja2).

    Args:
      messages: [{"role": "system" | "user" | "assistant", "content": str}, ...].
      add_generation_prompt: end with the header of an assistant turn.
      **kwargs: extra template variables (e.g. tools=[...]).

    Returns:
      The prompt text, to be passed to `encode`.
    """
    if self.chat_template is None:
      raise TokenizerError("this tokenizer has no chat template")
    template = _compile(self.chat_template)
    return template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                           bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                           **kwargs)


def _compile(source: str):
  """Compiles a chat template the way transformers does (sandboxed Jinja)."""
  try:
    import jinja2  # pylint: disable=import-outside-toplevel
    from jinja2 import sandbox  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise TokenizerError("apply_chat_template needs jinja2 (pip install jinja2)") from e

  def raise_exception(message):
    raise TokenizerError(f"chat template: {message}")

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                              extensions=["jinja2.ext.loopcontrols"])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  try:
    return env.from_string(source)
  except jinja2.TemplateError as e:
    raise TokenizerError(f"chat template does not compile: {e}") from None


def from_vocab(tokens: Sequence[str], merges: Sequence[str],
               token_types: Optional[Sequence[int]] = None) -> tokenizers.Tokenizer:
  """Builds the Qwen2 byte-level BPE pipeline from GGUF-style vocabulary pieces.

  Args:
    tokens: token strings by id, in the byte-level alphabet (as GGUF stores them).
    merges: "left right" merge rules, best first.
    token_types: llama.cpp token type per id; CONTROL (3) tokens become special
      added tokens, USER_DEFINED (4) plain added tokens.

  Returns:
    The `tokenizers.Tokenizer`.
  """
  vocab = {token: i for i, token in enumerate(tokens)}
  pairs = []
  for merge in merges:
    parts = merge.split(" ")
    if len(parts) != 2:
      raise TokenizerError(f"merge rule {merge!r} is not two tokens separated by one space")
    pairs.append((parts[0], parts[1]))
  backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False,
                                            byte_fallback=False))
  backend.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(tokenizers.Regex(QWEN2_SPLIT), behavior="isolated"),
      # The regex already split words; ByteLevel only respells their bytes.
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
  ])
  backend.decoder = decoders.ByteLevel()
  types = list(token_types or ())
  control = [tokenizers.AddedToken(t, special=True, normalized=False)
             for t, kind in zip(tokens, types) if kind == _CONTROL]
  user = [tokenizers.AddedToken(t, special=False, normalized=False)
          for t, kind in zip(tokens, types) if kind == _USER_DEFINED]
  if control:
    backend.add_special_tokens(control)
  if user:
    backend.add_tokens(user)
  return backend


def _end_ids(backend: tokenizers.Tokenizer, first: Iterable[Optional[int]]) -> list[int]:
  ids = [int(i) for i in first if i is not None]
  ids += [i for i in (backend.token_to_id(t) for t in _END_TOKENS) if i is not None]
  return ids


def from_gguf(path) -> Tokenizer:
  """Builds the tokenizer from a GGUF file's embedded vocabulary.

  Args:
    path: a .gguf file whose tokenizer is gpt2-style BPE with pre-tokenizer "qwen2".

  Returns:
    The tokenizer, with the file's chat template and eos id.

  Raises:
    TokenizerError: no vocabulary, another tokenizer type, or an unreadable file.
  """
  import gguf  # pylint: disable=import-outside-toplevel

  path = pathlib.Path(path)
  try:
    fields = gguf.GGUFReader(path).fields
  except Exception as e:  # the reader fails with whatever numpy or struct raised
    raise TokenizerError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None

  def get(key, default=None):
    return fields[key].contents() if key in fields else default

  kind, pre = get("tokenizer.ggml.model"), get("tokenizer.ggml.pre")
  if kind != "gpt2" or pre != "qwen2":
    raise TokenizerError(f"{path}: tokenizer.ggml.model={kind!r}, tokenizer.ggml.pre={pre!r}; "
                         "expected the Qwen2 byte-level BPE ('gpt2', 'qwen2')")
  tokens, merges = get("tokenizer.ggml.tokens"), get("tokenizer.ggml.merges")
  if not tokens or merges is None:
    raise TokenizerError(f"{path}: no tokenizer.ggml.tokens / tokenizer.ggml.merges")
  if get("tokenizer.ggml.add_bos_token", False):
    raise TokenizerError(f"{path}: tokenizer.ggml.add_bos_token is set; Qwen2 adds no BOS")
  backend = from_vocab(tokens, merges, get("tokenizer.ggml.token_type"))
  eos_id, bos_id = get("tokenizer.ggml.eos_token_id"), get("tokenizer.ggml.bos_token_id")
  name = lambda i: tokens[i] if i is not None and 0 <= i < len(tokens) else None
  return Tokenizer(backend, _end_ids(backend, [eos_id, get("tokenizer.ggml.eot_token_id")]),
                   chat_template=get("tokenizer.chat_template"), bos_token=name(bos_id),
                   eos_token=name(eos_id))


def _read_json(path: pathlib.Path) -> dict:
  if not path.is_file():
    return {}
  try:
    return json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise TokenizerError(f"{path}: not valid JSON ({e})") from None


def _token_text(value: Any) -> Optional[str]:
  """tokenizer_config.json writes special tokens as strings or AddedToken dicts."""
  if isinstance(value, dict):
    return value.get("content")
  return value if isinstance(value, str) else None


def from_hf_dir(path) -> Tokenizer:
  """Loads the tokenizer of an HF checkpoint directory.

  Args:
    path: a directory with tokenizer.json (and usually tokenizer_config.json,
      generation_config.json, chat_template.jinja).

  Returns:
    The tokenizer.

  Raises:
    TokenizerError: no tokenizer.json.
  """
  root = pathlib.Path(path)
  if not (root / "tokenizer.json").is_file():
    raise TokenizerError(f"{root}: no tokenizer.json")
  backend = tokenizers.Tokenizer.from_file(str(root / "tokenizer.json"))
  tok_cfg = _read_json(root / "tokenizer_config.json")
  template = tok_cfg.get("chat_template")
  if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
    named = {t.get("name"): t.get("template") for t in template}
    template = named.get("default")
  if template is None and (root / "chat_template.jinja").is_file():
    template = (root / "chat_template.jinja").read_text()
  eos_token = _token_text(tok_cfg.get("eos_token"))
  first = []
  for cfg_name in ("generation_config.json", "config.json"):
    value = _read_json(root / cfg_name).get("eos_token_id")
    first += value if isinstance(value, list) else [value]
  first.append(backend.token_to_id(eos_token) if eos_token else None)
  return Tokenizer(backend, _end_ids(backend, first), chat_template=template,
                   bos_token=_token_text(tok_cfg.get("bos_token")), eos_token=eos_token)


def load(path) -> Tokenizer:
  """Loads a tokenizer from an HF checkpoint directory or a GGUF file.

  Args:
    path: directory with tokenizer.json, or a .gguf file.

  Returns:
    The tokenizer.
  """
  path = pathlib.Path(path)
  if path.is_dir():
    return from_hf_dir(path)
  if path.is_file():
    return from_gguf(path)
  raise TokenizerError(f"{path}: no such file or directory")
