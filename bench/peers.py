"""The peers: HF transformers `generate`, the target alone and with `assistant_model=` the draft.

They run in a child process (`python -m bench.peers JOB.json`) after the jspec
phase has released its weights: two fp32 copies of the pair do not fit beside
each other on a 24 GiB machine, and the jspec process's peak RSS stays its own.

Fair terms, the same as jspec's in the same run:
  - the same weights: the HF models are loaded from the same GGUF files
    (`from_pretrained(dir, gguf_file=name)`), or built from the same shapes
    with random values (`--random-weights`, `--smoke`);
  - the same token ids: the prompt ids jspec was given, not a re-tokenization;
  - greedy (do_sample=False), the same max_new_tokens, the same dtype;
  - the same stopping rule: by default EOS is disabled on both sides (jspec
    stop_at_eos=False; here eos_token_id=None on the generation config of
    both models), so every generation is exactly max_new_tokens long; with
    --stop-at-eos both stop at the same EOS ids;
  - one warm-up generate per mode before the timed repetitions;
  - HF's own assisted-generation defaults (num_assistant_tokens and its
    schedule, assistant_confidence_threshold), recorded in the results.
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import sys
import time
from typing import Any, Callable, Iterator, Optional

from bench import memory
from bench import proc


def job(source: dict[str, Any], prompts: list[dict[str, Any]], modes: list[str],
        max_new_tokens: int, reps: int, dtype: str, device: str,
        eos_token_ids: Optional[list[int]]) -> dict[str, Any]:
  """Describes what the child should run.

  Args:
    source: {"kind": "gguf", "target": path, "draft": path}, {"kind": "hf_dir",
      "target": dir, "draft": dir}, or {"kind": "random", "target": jspec
      config dict, "draft": config dict}.
    prompts: [{"name": str, "ids": [int]}] in run order.
    modes: a subset of ("hf_target", "hf_assisted").
    max_new_tokens: tokens per generation.
    reps: timed repetitions per prompt and mode.
    dtype: "float32", "bfloat16" or "float16".
    device: "cpu" or "cuda".
    eos_token_ids: stop at these ids, or None (EOS disabled).

  Returns:
    The job dict (JSON-serialisable).
  """
  return {"source": source, "prompts": prompts, "modes": list(modes),
          "max_new_tokens": max_new_tokens, "reps": reps, "dtype": dtype, "device": device,
          "eos_token_ids": eos_token_ids}


def run(job_dict: dict[str, Any], work_dir: pathlib.Path,
        platform: Optional[str] = None) -> Iterator[dict[str, Any]]:
  """Parent side: runs a job in a child process, yielding its answers as they come.

  Args:
    job_dict: from `job`.
    work_dir: where the job file is written.
    platform: JAX_PLATFORMS of the child (the child imports no JAX; kept for symmetry).

  Yields:
    {"type": "load", ...} once, {"type": "record", "prompt", "mode", "record"}
    per prompt and mode, {"type": "done", ...} at the end.
  """
  work_dir.mkdir(parents=True, exist_ok=True)
  path = work_dir / f"hf_job_{os.getpid()}.json"
  path.write_text(json.dumps(job_dict))
  try:
    yield from proc.stream([sys.executable, "-m", "bench.peers", str(path)], proc.env(platform))
  finally:
    path.unlink(missing_ok=True)


def _hf_config(cfg: dict[str, Any]):
  """A transformers Qwen2Config with the shapes of a jspec config dict."""
  import transformers  # pylint: disable=import-outside-toplevel
  return transformers.Qwen2Config(
      vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
      intermediate_size=cfg["intermediate_size"], num_hidden_layers=cfg["num_layers"],
      num_attention_heads=cfg["num_heads"], num_key_value_heads=cfg["num_kv_heads"],
      head_dim=cfg["head_dim"], rope_theta=cfg["rope_theta"], rms_norm_eps=cfg["rms_norm_eps"],
      tie_word_embeddings=cfg["tie_word_embeddings"],
      max_position_embeddings=cfg["max_position_embeddings"])


def _load(source: dict[str, Any], which: str, dtype, device: str):
  """Loads (or builds) one HF model in eval mode on the device."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  kind = source["kind"]
  if kind == "gguf":
    path = pathlib.Path(source[which])
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=dtype)
  elif kind == "hf_dir":
    model = transformers.AutoModelForCausalLM.from_pretrained(source[which], dtype=dtype)
  elif kind == "random":
    # Cost depends on shapes only: HF's own random init of the same shapes.
    torch.manual_seed(0 if which == "target" else 1)
    model = transformers.Qwen2ForCausalLM(_hf_config(source[which])).to(dtype)
  else:
    raise ValueError(f"unknown HF source kind {kind!r}")
  return model.to(device).eval()


def _sync(device: str) -> None:
  if device == "cuda":
    import torch  # pylint: disable=import-outside-toplevel
    torch.cuda.synchronize()


def _generate(model, ids: list[int], job_dict: dict[str, Any], assistant=None) -> tuple[list[int], float]:
  """One greedy generate; returns (new token ids, seconds)."""
  import torch  # pylint: disable=import-outside-toplevel
  device = job_dict["device"]
  input_ids = torch.tensor([ids], dtype=torch.long, device=device)
  kwargs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                generation_config=model.generation_config)
  if assistant is not None:
    kwargs["assistant_model"] = assistant
  _sync(device)
  t0 = time.perf_counter()
  with torch.no_grad():
    out = model.generate(**kwargs)
  _sync(device)
  seconds = time.perf_counter() - t0
  return out[0, len(ids):].tolist(), seconds


def _configure(model, job_dict: dict[str, Any]) -> None:
  """Greedy, max_new_tokens, and the run's stopping rule on a model's generation config."""
  cfg = model.generation_config
  cfg.do_sample = False
  cfg.temperature, cfg.top_p, cfg.top_k = None, None, None  # unused when greedy; silence warnings
  cfg.max_new_tokens = job_dict["max_new_tokens"]
  cfg.max_length = None
  eos = job_dict["eos_token_ids"]
  cfg.eos_token_id = list(eos) if eos else None
  # Batch of one, no padding; a pad id keeps generate from borrowing the EOS.
  cfg.pad_token_id = 0


def _assistant_settings(assistant) -> dict[str, Any]:
  """The assisted-generation settings in force (unset ones take HF's global defaults)."""
  cfg = assistant.generation_config
  defaults = getattr(cfg, "_get_default_generation_params", dict)()
  out = {}
  for name in ("num_assistant_tokens", "num_assistant_tokens_schedule",
               "assistant_confidence_threshold"):
    value = getattr(cfg, name, None)
    out[name] = defaults.get(name) if value is None else value
  return out


def _median(values):
  return float(statistics.median(values)) if values else float("nan")


def _child(job_path: str, emit: Callable[[dict], None] = proc.emit) -> None:
  """Child side: loads the models, runs every prompt and mode, emits records."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel

  # Assisted generation warns on every call about arguments it passes itself.
  transformers.logging.set_verbosity_error()
  job_dict = json.loads(pathlib.Path(job_path).read_text())
  device = job_dict["device"]
  if device == "cuda" and not torch.cuda.is_available():
    raise RuntimeError("HF peers asked for cuda, but this torch has no CUDA device")
  torch.set_num_threads(os.cpu_count() or 1)
  dtype = getattr(torch, job_dict["dtype"])
  modes = job_dict["modes"]
  t0 = time.perf_counter()
  target = _load(job_dict["source"], "target", dtype, device)
  target_load_s = time.perf_counter() - t0
  _configure(target, job_dict)
  assistant, draft_load_s = None, None
  if "hf_assisted" in modes:
    t0 = time.perf_counter()
    assistant = _load(job_dict["source"], "draft", dtype, device)
    draft_load_s = time.perf_counter() - t0
    _configure(assistant, job_dict)
  emit({"type": "load", "target_load_s": target_load_s, "draft_load_s": draft_load_s,
        "transformers": transformers.__version__, "torch": torch.__version__,
        "threads": torch.get_num_threads(), "device": device, "dtype": job_dict["dtype"],
        "assistant": _assistant_settings(assistant) if assistant is not None else None})

  warm = set()
  for prompt in job_dict["prompts"]:
    for mode in modes:
      helper = assistant if mode == "hf_assisted" else None
      warmup_s = None
      if mode not in warm:  # one warm-up generate per mode
        _, warmup_s = _generate(target, prompt["ids"], job_dict, helper)
        warm.add(mode)
      runs = [_generate(target, prompt["ids"], job_dict, helper)
              for _ in range(job_dict["reps"])]
      ids = runs[0][0]
      seconds = [s for _, s in runs]
      emit({"type": "record", "prompt": prompt["name"], "mode": mode, "record": {
          "engine": "hf",
          "token_ids": ids,
          "reps_identical": all(r[0] == ids for r in runs),
          "new_tokens": len(ids),
          "tokens_per_s": _median([len(r[0]) / s for r, s in zip(runs, seconds)]),
          "seconds": _median(seconds),
          "reps": [{"seconds": s, "tokens_per_s": len(r[0]) / s} for r, s in zip(runs, seconds)],
          "warmup_s": warmup_s,
      }})
  emit({"type": "done",
        "peak_rss_bytes": memory.peak_rss_bytes(),
        "cuda_peak_bytes": int(torch.cuda.max_memory_allocated()) if device == "cuda" else None,
        "assistant_after": _assistant_settings(assistant) if assistant is not None else None})


if __name__ == "__main__":
  _child(sys.argv[1])
