"""jspec benchmarks: jspec's decoding modes against HF transformers, in one run.

    python -m bench                       # the fixed suite, every mode, the real pair
    python -m bench --suite humaneval --limit 20
    python -m bench --smoke               # tiny random models, seconds
    python -m bench --random-weights --dtype bfloat16 --device gpu --histograms cpu.json

Modules, one idea each:
  prompts   the fixed suite and the HumanEval prompts
  modes     which jspec settings and peers a run measures
  shapes    model configs: the real pair's shapes, tiny smoke shapes
  memory    memory bandwidth, peak RSS, weight bytes read per forward
  engine    one jspec mode on one prompt: warm-up, repetitions, medians
  peers     HF transformers `generate` (target alone, assisted) in a child process
  results   the JSON document: atomic writes, resume, ratios, gate, derived figures
  report    the tables printed to stdout
  plots     PNGs beside the JSON
  runner    the whole run
"""
