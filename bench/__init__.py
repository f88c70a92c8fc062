"""jspec benchmarks: jspec's decoding modes against HF transformers, in one run.

    python -m bench                       # the fixed suite, every mode, the real pair
    python -m bench --suite humaneval --limit 20
    python -m bench --smoke               # tiny random models, seconds
    python -m bench --random-weights --dtype bfloat16 --device gpu --histograms cpu.json

Modules, one idea each:
  prompts   the fixed suite and the HumanEval prompts
  modes     which jspec settings and peers a run measures
  shapes    model configs: the real pair's shapes, tiny smoke shapes
  models    the pair a run measures, prepared as `jspec.load` prepares it
  memory    memory bandwidth, peak RSS, weight bytes read per forward
  engine    one jspec mode on one prompt: warm-up, repetitions, medians
  peers     HF transformers `generate` (target alone, assisted) in a child process
  results   the JSON document: atomic writes, resume, ratios, gate, derived figures
  report    the tables printed to stdout
  plots     PNGs beside the JSON
  runner    the whole run
  finalize  ratios, verdicts and plots of a run cut short
  batch     batch 1 against batch 4 on the real pair (`python -m bench.batch`)
  tools     one-off measurements behind the design choices (`python -m bench.tools.<name>`)
"""
