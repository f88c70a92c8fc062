"""Finishes a results file whose run was cut short: ratios, derived figures, plots and the report.

    python -m bench.finalize RESULTS.json [--histograms CPU.json]

The bench writes its JSON after every prompt, but computes what depends on
all of them (ratios, the gate, the summary, derived figures, plots) only at
the end. A run stopped before that (`bench/device_gpu.sh` stops one at the
device call's time limit) keeps its measured records; this computes the rest
from them, marks the file as stopped, and prints the report. A complete file
is left as it is.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Optional

from bench import derive
from bench import plots
from bench import report
from bench import results

STOPPED = "stopped: cut short, finalized from the records it had"


def mode_order(doc: dict) -> list[str]:
  """Every mode in the document, in the order the records first show them."""
  order: list[str] = []
  for entry in doc.get("prompts", {}).values():
    for mode in entry.get("modes", {}):
      if mode not in order:
        order.append(mode)
  return order


def finalize(path: pathlib.Path, histograms: Optional[str] = None) -> dict:
  """Completes a cut-short results file in place.

  Args:
    path: the results JSON.
    histograms: a results JSON of the real pair to derive speculative
      figures from (as `python -m bench --histograms`), or None.

  Returns:
    The document, finalized (or as it was, if its run had completed).

  Raises:
    FileNotFoundError: no such file.
  """
  doc = results.load(path)
  if doc.get("status") == "complete":
    return doc
  order = mode_order(doc)
  if histograms:
    derive.apply(doc, results.load(pathlib.Path(histograms)), histograms)
  results.finalize(doc, order)
  doc["status"] = STOPPED
  doc["plots"] = plots.write_all(doc, path, order)
  results.write(doc, path)
  return doc


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("results", type=pathlib.Path, help="the results JSON of a cut-short run")
  ap.add_argument("--histograms", help="a results JSON of the real pair (derived figures)")
  args = ap.parse_args(argv)
  if not args.results.is_file():
    print(f"{args.results}: no such results file (the run wrote none)", file=sys.stderr)
    return 2
  if args.histograms and not pathlib.Path(args.histograms).is_file():
    print(f"--histograms {args.histograms}: no such file (expected a results JSON of the real "
          "pair)", file=sys.stderr)
    return 2
  try:
    doc = finalize(args.results, args.histograms)
  except json.JSONDecodeError as e:  # a file cut mid-write by something other than the bench
    print(f"{args.results} or --histograms: not a results JSON ({e})", file=sys.stderr)
    return 2
  print(report.render(doc, mode_order(doc)))
  print(f"{args.results}: {doc['status']}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
