"""One-off measurements behind the design choices, each run as `python -m bench.tools.<name>`.

  layer_loop       a Python loop over the layers against `lax.scan` over stacked weights
  forward_cost     one forward of the real target and draft at T new tokens, per storage
  kernel_ab        two builds of jspec's CPU kernel, call by call on the real matrices
  roofline         a target-only step against the memory roof, and where the rest goes
  head_candidates  how many tokens the greedy head recomputes on the real target
  lookup_bound     the most prompt lookup could gain, replayed from a run's target tokens
  compile_time     the speculative program's compile time, cold and from the cache

docs/decisions.md cites their figures section by section.
"""
