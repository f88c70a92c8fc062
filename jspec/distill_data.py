"""Training prompts for draft distillation that are never evaluation prompts.

Two sources, both on every machine and both deterministic:
  code  function and method signatures with their docstrings, taken from the
        Python standard library's own sources (`sysconfig.get_paths()["stdlib"]`),
        the shape of HumanEval's prompts without being any of them;
  chat  instructions written for this file (`CHAT`), sent through the chat template.

The bench's prompts (`bench/prompts.py`: the stored suite and HumanEval) are
for evaluation only. `disjoint` drops any training prompt that equals,
contains or is contained in one of them, and a distilled draft records the
hash of every prompt it was trained on (`prompt_hash`), so that the bench can
refuse to report it on those prompts (`check_held_out`).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import json
import pathlib
import struct
import sysconfig
import textwrap
from typing import Iterable, Iterator, Mapping, Optional, Sequence

KINDS = ("code", "chat")
# Stdlib directories that hold tests, demos or vendored trees, not library code.
_SKIP_DIRS = frozenset({"test", "tests", "idlelib", "lib2to3", "turtledemo", "ensurepip",
                        "__pycache__", "site-packages", "dist-packages"})
_MIN_DOC, _MAX_DOC = 40, 800  # docstring characters: enough to say something, short as a prompt
_MAX_PROMPT_CHARS = 1600
_MIN_OVERLAP = 32  # shorter texts are too generic to count as one prompt containing another
# The draft file's metadata key holding the distillation record (`jspec.distill`).
METADATA_KEY = "jspec_distill"


@dataclasses.dataclass(frozen=True)
class Prompt:
  """One training prompt.

  Attributes:
    kind: "code" (continued as it stands) or "chat" (a user message for the chat template).
    text: the prompt, or the user message of a chat prompt.
    source: where it came from ("stdlib:json/decoder.py:JSONDecoder.decode", "chat:17", ...).
  """

  kind: str
  text: str
  source: str = ""

  @property
  def chat(self) -> bool:
    """Whether the prompt goes through the chat template."""
    return self.kind == "chat"


def normalize(text: str) -> str:
  """Text with every run of whitespace as one space, ends stripped: what hashes and overlaps compare."""
  return " ".join(text.split())


def prompt_hash(text: str) -> str:
  """The sha256 (hex) of a prompt's normalized text: what a distilled draft records per prompt."""
  return hashlib.sha256(normalize(text).encode("utf-8")).hexdigest()


def _stdlib_root() -> pathlib.Path:
  """This interpreter's standard library directory."""
  return pathlib.Path(sysconfig.get_paths()["stdlib"])


def _function_prompt(lines: list[str], node: ast.AST, owner: Optional[ast.ClassDef]) -> Optional[str]:
  """A function's signature and docstring as a prompt (its class header above a method)."""
  body = node.body
  doc = body[0] if body and isinstance(body[0], ast.Expr) else None
  if doc is None or not isinstance(getattr(doc, "value", None), ast.Constant):
    return None
  text = ast.get_docstring(node)
  if not isinstance(text, str) or not _MIN_DOC <= len(text) <= _MAX_DOC:
    return None
  start = node.lineno - 1  # the def line (decorators left out)
  segment = "\n".join(lines[start:doc.end_lineno])
  try:
    segment = textwrap.dedent(segment)
  except TypeError:
    return None
  if owner is not None:
    segment = f"class {owner.name}:\n" + textwrap.indent(segment, "    ")
  if "\t" in segment or len(segment) > _MAX_PROMPT_CHARS:
    return None
  return segment + "\n"


def stdlib_sources(root: Optional[pathlib.Path] = None) -> Iterator[tuple[pathlib.PurePath, str]]:
  """The standard library's Python sources, tests and tool directories left out, in path order.

  Args:
    root: the library's directory (None: this interpreter's).

  Yields:
    (path relative to the root, the file's text); unreadable files are skipped.
  """
  base = pathlib.Path(root or _stdlib_root())
  for path in sorted(base.rglob("*.py")):
    rel = path.relative_to(base)
    if any(part in _SKIP_DIRS for part in rel.parts) or path.name.startswith("test_"):
      continue
    try:
      yield rel, path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
      continue


@functools.lru_cache(maxsize=4)
def _all_code_prompts(root: str) -> tuple[Prompt, ...]:
  """Every usable function of the stdlib under `root`, in path and line order."""
  out = []
  for rel, source in stdlib_sources(pathlib.Path(root)):
    try:
      tree = ast.parse(source)
    except (SyntaxError, ValueError):
      continue
    lines = source.splitlines()
    for top in tree.body:
      if isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef)):
        pairs = [(top, None)]
      elif isinstance(top, ast.ClassDef):
        pairs = [(n, top) for n in top.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
      else:
        continue
      for node, owner in pairs:
        text = _function_prompt(lines, node, owner)
        if text is not None:
          name = f"{owner.name}.{node.name}" if owner else node.name
          out.append(Prompt("code", text, f"stdlib:{rel.as_posix()}:{name}"))
  return tuple(out)


def code_prompts(limit: Optional[int] = None, root: Optional[pathlib.Path] = None) -> list[Prompt]:
  """Signature + docstring prompts from the standard library, in a fixed pseudo-random order.

  The order is by each prompt's hash, so any prefix is spread over the
  whole library rather than its first modules alphabetically.

  Args:
    limit: keep the first `limit` (None: all).
    root: the library's directory (None: this interpreter's).

  Returns:
    Prompts of kind "code", duplicates removed.
  """
  found = _all_code_prompts(str(root or _stdlib_root()))
  unique = {prompt_hash(p.text): p for p in found}
  ordered = [unique[h] for h in sorted(unique)]
  return ordered[:limit] if limit is not None else ordered


def chat_prompts(limit: Optional[int] = None) -> list[Prompt]:
  """The built-in chat instructions (`CHAT`), in a fixed pseudo-random order.

  Args:
    limit: keep the first `limit` (None: all).

  Returns:
    Prompts of kind "chat".
  """
  prompts = [Prompt("chat", text, f"chat:{i}") for i, text in enumerate(CHAT)]
  prompts.sort(key=lambda p: prompt_hash(p.text))
  return prompts[:limit] if limit is not None else prompts


def eval_texts() -> dict[str, str]:
  """Every evaluation prompt the bench knows: the stored suite and HumanEval (when installed).

  Returns:
    {name: text}; empty when the bench package is not importable.
  """
  try:
    from bench import prompts as bench_prompts  # pylint: disable=import-outside-toplevel
  except ImportError:
    return {}
  out = {p.name: p.text for p in bench_prompts.SUITE}
  try:
    out.update({p.name: p.text for p in bench_prompts.humaneval()})
  except FileNotFoundError:
    pass
  return out


def disjoint(prompts: Iterable[Prompt], held_out: Mapping[str, str]) -> list[Prompt]:
  """The prompts that neither equal, contain nor lie inside any held-out prompt.

  Args:
    prompts: training candidates.
    held_out: {name: text} of evaluation prompts (`eval_texts`).

  Returns:
    The candidates kept, in order.
  """
  held = [normalize(t) for t in held_out.values()]
  held_set = set(held)
  kept = []
  for p in prompts:
    text = normalize(p.text)
    if text in held_set:
      continue
    if len(text) >= _MIN_OVERLAP and any(
        (len(h) >= _MIN_OVERLAP and (h in text or text in h)) for h in held):
      continue
    kept.append(p)
  return kept


def training_prompts(n_code: int = 768, n_chat: int = 256,
                     held_out: Optional[Mapping[str, str]] = None) -> list[Prompt]:
  """The default training set: stdlib code prompts and the built-in chat instructions, held-out safe.

  Code and chat prompts alternate, so that any prefix of the list (a run
  cut short) holds both kinds in proportion.

  Args:
    n_code: code prompts wanted (fewer if the library has fewer).
    n_chat: chat prompts wanted (at most len(CHAT)).
    held_out: evaluation prompts to stay clear of (None: `eval_texts()`).

  Returns:
    The prompts.
  """
  held_out = eval_texts() if held_out is None else held_out
  code = disjoint(code_prompts(), held_out)[:n_code]
  chat = disjoint(chat_prompts(), held_out)[:n_chat]
  out, i, j = [], 0, 0
  while i < len(code) or j < len(chat):
    # Interleave in proportion: take code while it is behind its share.
    if j >= len(chat) or (i < len(code) and i * max(len(chat), 1) <= j * max(len(code), 1)):
      out.append(code[i])
      i += 1
    else:
      out.append(chat[j])
      j += 1
  return out


def read_record(path) -> Optional[dict]:
  """The distillation record in a draft file's metadata (`METADATA_KEY`), or None if it has none.

  Args:
    path: a safetensors file.

  Returns:
    The record (a dict with "prompt_hashes", the recipe and the costs), or
    None for a file that is not a distilled draft.

  Raises:
    ValueError: the file cannot be read, or its record is not valid JSON.
  """
  path = pathlib.Path(path)
  try:
    with open(path, "rb") as f:
      (size,) = struct.unpack("<Q", f.read(8))
      if size > 200_000_000:
        raise ValueError(f"{path}: safetensors header of {size} bytes; not a draft file")
      header = json.loads(f.read(size))
  except (OSError, struct.error, json.JSONDecodeError) as e:
    raise ValueError(f"{path}: cannot read its safetensors header ({e})") from None
  meta = header.get("__metadata__") if isinstance(header, dict) else None
  if not isinstance(meta, dict) or METADATA_KEY not in meta:
    return None
  try:
    record = json.loads(meta[METADATA_KEY])
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}: its {METADATA_KEY} metadata is not JSON ({e})") from None
  if not isinstance(record, dict) or not isinstance(record.get("prompt_hashes"), list):
    raise ValueError(f"{path}: its {METADATA_KEY} metadata has no prompt_hashes list")
  return record


def trained_on(record: Optional[dict], prompts: Mapping[str, str]) -> list[str]:
  """The names of the prompts a distilled draft was trained on.

  Args:
    record: `read_record` of the draft (None: not distilled, so none).
    prompts: {name: text} about to be evaluated.

  Returns:
    Names, in the order given.
  """
  if record is None:
    return []
  hashes = set(record["prompt_hashes"])
  return [name for name, text in prompts.items() if prompt_hash(text) in hashes]


def check_held_out(draft_path, prompts: Mapping[str, str]) -> None:
  """Refuses to evaluate a distilled draft on prompts it was trained on.

  Args:
    draft_path: the draft file (any checkpoint; only a jspec safetensors
      file written by `jspec.distill` carries a record).
    prompts: {name: text} of the prompts to evaluate (chat prompts as their user message).

  Raises:
    ValueError: one line naming the prompts the draft was trained on.
  """
  path = pathlib.Path(draft_path)
  if not path.is_file():
    return  # an HF directory or a known model name: not a distilled draft
  try:
    record = read_record(path)
  except ValueError:
    return  # not a safetensors file (a GGUF): it carries no record
  seen = trained_on(record, prompts)
  if seen:
    shown = ", ".join(seen[:5]) + (f" and {len(seen) - 5} more" if len(seen) > 5 else "")
    raise ValueError(f"draft {path} was distilled on {len(seen)} of the prompts to evaluate "
                     f"({shown}); evaluate it on held-out prompts only")


def prompts_from_texts(texts: Sequence[str], chat: bool = False) -> list[Prompt]:
  """User-given training prompts as `Prompt`s.

  Args:
    texts: prompt texts.
    chat: send them through the chat template.

  Returns:
    Prompts named "user:<index>".
  """
  kind = "chat" if chat else "code"
  return [Prompt(kind, t, f"user:{i}") for i, t in enumerate(texts)]


# Chat-style instructions written for this file. None is one of the bench's
# prompts (a test checks every one against `bench/prompts.py`).
CHAT: tuple[str, ...] = (
    # Explanations: computing.
    "Explain what a hash table is and why lookups are usually fast.",
    "What is the difference between a stack and a queue? Give one real use of each.",
    "Explain recursion to someone who has only written loops.",
    "Why do databases use indexes, and what do they cost?",
    "Explain what a race condition is, with a small example.",
    "What does a compiler do that an interpreter does not?",
    "Describe how DNS turns a domain name into an IP address.",
    "Explain public-key cryptography in plain language.",
    "What is the difference between TCP and UDP, and when would you pick each?",
    "Explain big-O notation using a phone book as the example.",
    "What is garbage collection, and what problems does it solve?",
    "Explain what an API is to a small-business owner.",
    "Why is floating-point arithmetic sometimes inexact? Give an example.",
    "Describe what happens when you type a web address into a browser and press Enter.",
    "Explain the idea of caching and when a cache can make things worse.",
    "What is a deadlock, and what are two ways to avoid one?",
    "Explain version control and why teams use it.",
    "What is the difference between authentication and authorization?",
    "Explain how a binary search works and when it cannot be used.",
    "What is a virtual machine, and how is it different from a container?",
    "Explain what unit tests are for and what they cannot catch.",
    "Describe the difference between SQL and NoSQL databases.",
    "Explain what latency and throughput mean, with an analogy.",
    "What is a memory leak in a garbage-collected language?",
    "Explain what a regular expression is and give three practical uses.",
    # Explanations: science, nature, everyday life.
    "Why is the sky blue during the day and red at sunset?",
    "Explain how vaccines train the immune system.",
    "How do airplanes stay in the air? Keep it simple.",
    "Why do we have seasons on Earth?",
    "Explain photosynthesis to a ten-year-old.",
    "What causes ocean tides?",
    "How does a refrigerator keep food cold?",
    "Why does ice float on water?",
    "Explain what inflation is and why a little of it is considered normal.",
    "How do noise-cancelling headphones work?",
    "What is the greenhouse effect?",
    "Explain how a credit score is calculated in general terms.",
    "Why do onions make people cry?",
    "How does GPS know where you are?",
    "Explain the difference between weather and climate.",
    "What happens in the body during a fever?",
    "Why do some metals rust and others do not?",
    "Explain compound interest with a worked example.",
    "How do bees make honey?",
    "Why does bread go stale?",
    "Explain how an electric motor turns electricity into motion.",
    "What is the difference between a virus and a bacterium?",
    "Why do cats purr?",
    "How do solar panels produce electricity?",
    "Explain what a black hole is in a few sentences.",
    # Writing tasks.
    "Write a polite note to a neighbour asking them to keep their dog off my lawn.",
    "Write a thank-you message to a colleague who helped me finish a report on time.",
    "Draft a short announcement that the office kitchen will be cleaned every Thursday.",
    "Write a cover letter opening paragraph for a junior data analyst position.",
    "Write a two-sentence product description for a reusable water bottle.",
    "Draft a message to a landlord reporting a leaking kitchen tap.",
    "Write a short speech to welcome new volunteers at a food bank.",
    "Write a LinkedIn post announcing that I finished a course in statistics.",
    "Draft an apology to a customer whose order arrived two weeks late.",
    "Write a reminder for a book club that the next meeting is on the 14th.",
    "Write a short bio for a freelance illustrator's website.",
    "Draft a message declining a job offer politely.",
    "Write a short newsletter intro for a community garden in spring.",
    "Write instructions for a house sitter on feeding two cats and watering plants.",
    "Draft a request to my manager for two days of leave next month.",
    "Write a review of a small Italian restaurant with good pasta and slow service.",
    "Write a welcome message for new members of an online chess club.",
    "Draft a short complaint to an internet provider about frequent outages.",
    "Write a toast for my sister's wedding, warm and under one minute long.",
    "Write a notice asking residents to sort recycling into paper and plastic.",
    "Write a short message congratulating a friend on their new job.",
    "Draft a follow-up note after a job interview for a nursing position.",
    "Write an out-of-office reply for a two-week holiday.",
    "Write a short description of a weekend hiking trip for a travel blog.",
    "Draft an invitation to a retirement party for a long-serving teacher.",
    "Write a brief summary of the benefits of walking every day.",
    "Write a message to parents about a school trip to a science museum.",
    "Write a short FAQ entry explaining how to reset a forgotten password.",
    "Draft a polite reminder to a client about an unpaid invoice.",
    "Write a short pitch for a mobile app that tracks houseplant watering.",
    "Write release notes for a bug-fix version of a note-taking app.",
    "Draft a message to a teammate handing over an unfinished task before a holiday.",
    "Write a short paragraph about why public libraries matter.",
    "Write a job advertisement for a part-time barista.",
    "Write a friendly message inviting coworkers to a Friday lunch.",
    # Programming help in prose.
    "How do I read a CSV file in Python and compute the average of one column?",
    "Show how to reverse a linked list in Python and explain each step.",
    "How can I remove duplicates from a list while keeping the order in Python?",
    "Write a Python function that checks whether a string is a valid IPv4 address.",
    "How do I make an HTTP GET request in JavaScript with fetch and handle errors?",
    "Explain Python list comprehensions with three examples.",
    "How do I count word frequencies in a text file using Python?",
    "Write a bash one-liner that finds the ten largest files in a directory.",
    "How do I convert a string to a date in Python?",
    "Explain the difference between == and is in Python.",
    "Write a SQL query that finds customers who have never placed an order.",
    "How do I sort a list of dictionaries by a key in Python?",
    "Explain what a Python decorator is and write a simple timing decorator.",
    "How do I write a unit test for a function that reads a file?",
    "Write a JavaScript function that deep-clones a plain object.",
    "Explain async and await in JavaScript with an example.",
    "How can I merge two dictionaries in Python?",
    "Write a Python generator that yields the Fibonacci numbers.",
    "What is the difference between a shallow copy and a deep copy?",
    "How do I handle exceptions properly in Python? Show good and bad examples.",
    "Write a function that flattens a nested list of arbitrary depth.",
    "Explain Git branching and merging for a beginner.",
    "How do I undo the last Git commit but keep my changes?",
    "Write a Python class that represents a simple to-do list.",
    "Explain what a closure is in JavaScript.",
    "How do I parse JSON in Python and access nested fields safely?",
    "Write a regular expression that matches email addresses, and explain its limits.",
    "How do I profile a slow Python function?",
    "Explain the SOLID principles briefly with one example each.",
    "Write a Python script that renames all .txt files in a folder to .md.",
    "Explain the difference between processes in Docker and on a normal host.",
    "How do I write a recursive function to compute factorials, and what are its limits?",
    "Explain what dependency injection is, with a short example.",
    "How can I make a Python script accept command-line arguments?",
    "Write a function that returns the n most common elements of a list.",
    "Explain how to paginate results in a REST API.",
    "Write a Python function to validate that parentheses in a string are balanced.",
    "What are Python's virtual environments for, and how do I create one?",
    "Explain what a foreign key is in a relational database.",
    "How do I debounce user input in a search box? Explain the idea.",
    # Advice and how-to.
    "Give me five tips for staying focused while working from home.",
    "How do I prepare for a technical job interview in two weeks?",
    "What are good habits for keeping a budget?",
    "How can I get better at public speaking?",
    "Suggest a simple weekly meal plan for someone who cooks twice a week.",
    "How do I start running if I have never exercised regularly?",
    "What should I check before buying a used car?",
    "How can I learn a new language in my spare time?",
    "Give advice for writing clear documentation.",
    "How do I give constructive feedback to a colleague?",
    "What are some ways to improve sleep quality?",
    "How should I organise files on my computer?",
    "Suggest ways to reduce food waste at home.",
    "How do I negotiate a higher salary politely?",
    "What are the first steps to take after losing a wallet?",
    "How can a small team run effective meetings?",
    "Give tips for taking better photos with a phone.",
    "How do I keep houseplants alive in a dark apartment?",
    "What should I pack for a three-day camping trip?",
    "How can I make my code reviews more useful?",
    "Suggest a study schedule for an exam in one month.",
    "How can I stop procrastinating on large projects?",
    "What are good ways to back up personal photos?",
    "How do I choose a good password and remember it?",
    "How should a beginner start learning to draw?",
    "Give me a checklist for moving to a new apartment.",
    "How do I write a good README for an open-source project?",
    "What are some ways to make a long flight more comfortable?",
    "How can I teach a child to ride a bicycle?",
    "How do I plan a small birthday party on a budget?",
    # Creative.
    "Write a short poem about the first snow of the year.",
    "Write a limerick about a forgetful robot.",
    "Tell a short bedtime story about a lighthouse keeper and a seagull.",
    "Write a haiku about morning coffee.",
    "Write a four-line rhyme about autumn leaves.",
    "Invent a name and a short backstory for a friendly dragon.",
    "Write the opening paragraph of a mystery novel set on a train.",
    "Write a short fable with a moral about patience.",
    "Describe a busy market in a city you invent, in one paragraph.",
    "Write a short dialogue between a cat and a houseplant.",
    "Write a poem about a city at night.",
    "Write a short story in exactly five sentences about a lost key.",
    "Write song lyrics for a chorus about summer holidays.",
    "Invent three names for a bakery and explain each.",
    "Write a funny short story about a programmer and a rubber duck.",
    "Describe the taste of a lemon to someone who has never had one.",
    "Write a letter from a tree to the people who planted it.",
    "Write a riddle whose answer is a clock.",
    "Write a short science-fiction scene on a ship orbiting Jupiter.",
    "Write a motivational message for someone starting their first job.",
    # Analysis and comparison.
    "Compare electric cars and petrol cars for a daily commute.",
    "What are the pros and cons of working in a startup versus a large company?",
    "Compare renting and buying a home for a young couple.",
    "What are the advantages and disadvantages of remote work?",
    "Compare Python and JavaScript for a first programming language.",
    "What are the trade-offs between microservices and a monolith?",
    "Compare e-books and paper books.",
    "What are the pros and cons of open-plan offices?",
    "Compare trains and planes for a 500 km trip.",
    "Summarize the main causes of the French Revolution in a paragraph.",
    "What were the main effects of the printing press on Europe?",
    "Summarize the plot of Romeo and Juliet in five sentences.",
    "Compare relational databases with spreadsheets for small businesses.",
    "What are the risks and benefits of social media for teenagers?",
    "Explain the trade-off between speed and accuracy in software estimates.",
    "Compare static typing and dynamic typing.",
    "What are the pros and cons of a four-day work week?",
    "Compare cloud hosting with running your own server.",
    "What makes a good team leader? List the most important qualities.",
    "Compare learning from books and learning from videos.",
    # Reasoning and numbers.
    "A shop sells pens at 3 for 2 euros. How much do 12 pens cost? Show the steps.",
    "If a train travels 180 km in 2 hours, how long will 300 km take at the same speed?",
    "What is 15 percent of 240? Explain how to work it out mentally.",
    "I have 3 shirts and 4 pairs of trousers. How many outfits can I make?",
    "A recipe for 4 people needs 300 g of flour. How much for 6 people?",
    "Is 221 a prime number? Explain.",
    "How many seconds are there in a week? Show the calculation.",
    "If I save 50 euros a month, how long until I have 1,200 euros?",
    "Explain how to estimate the number of piano tuners in a large city.",
    "A rectangle has a perimeter of 30 cm and a width of 5 cm. What is its area?",
    "What is the probability of rolling two sixes with two dice?",
    "Convert 72 degrees Fahrenheit to Celsius and explain the formula.",
    "Split a 90-euro restaurant bill among 4 people with a 10 percent tip.",
    "Explain why the sum of the angles of a triangle is 180 degrees.",
    "If the price of an item rises by 20 percent and then falls by 20 percent, is it back to the original price?",
    "What is the average of 12, 15, 20 and 33?",
    "How many days are there between March 3 and April 17 of the same year?",
    "A tank fills in 6 hours with one pump and 3 hours with another. How long with both?",
    "Explain the Monty Hall problem and its answer.",
    "What is the next number in the sequence 2, 6, 12, 20, 30? Explain.",
    # Rewriting and transforming text.
    "Rewrite this sentence to sound more formal: 'We can't make it to the thing tomorrow.'",
    "Make this sentence shorter: 'At this point in time we are not in a position to offer a refund.'",
    "Translate 'Where is the train station?' into French, Spanish and German.",
    "Turn these notes into a paragraph: sales up 10%, new office opened, two hires.",
    "Rewrite 'The report was written by the intern' in the active voice.",
    "Summarize in one sentence: the city will close the bridge for repairs from May to July.",
    "Correct the grammar: 'Me and him goes to the store yesterday.'",
    "Give three synonyms for 'important' and a sentence using each.",
    "Turn this list into a friendly sentence: milk, eggs, bread, apples.",
    "Rewrite this tweet to be more positive: 'Another Monday, another pile of emails.'",
    "Explain the difference between 'affect' and 'effect' with examples.",
    "Write a one-paragraph summary of what a resume should include.",
    "Convert this recipe step into numbered instructions: boil water, add pasta, cook 9 minutes, drain.",
    "Simplify this for a child: 'Precipitation is expected in the afternoon.'",
    "Make this email subject line clearer: 'stuff about next week'.",
    # Planning and organising.
    "Plan a one-day sightseeing itinerary for a visitor to Rome.",
    "Create a packing list for a business trip of three days.",
    "Outline a 30-minute workshop introducing spreadsheets to beginners.",
    "Plan a weekly cleaning schedule for a shared flat of three people.",
    "Outline the sections of a project proposal for a new company website.",
    "Make a checklist for launching a small online shop.",
    "Plan a reading list of five classic novels for a summer.",
    "Outline a lesson plan about the water cycle for primary school.",
    "Create a simple agenda for a one-hour team retrospective.",
    "Plan a morning routine that takes at most 45 minutes.",
    "Outline the steps to organise a charity bake sale.",
    "Create a timeline for writing a thesis over six months.",
    "Plan the first week of onboarding for a new software engineer.",
    "Make a list of questions to ask when viewing a rental apartment.",
    "Outline a beginner's four-week strength training plan.",
    # Questions about language, history and culture.
    "Why does English spelling not always match pronunciation?",
    "What is the origin of the word 'robot'?",
    "Who was Ada Lovelace and why is she remembered?",
    "Explain the main idea of Stoic philosophy.",
    "What was the Silk Road and why was it important?",
    "Why did the Roman Empire split into east and west?",
    "Explain what a haiku is and how it is structured.",
    "What is the difference between a democracy and a republic?",
    "Why is the Mona Lisa so famous?",
    "Explain the rules of chess for the knight and the bishop.",
    "What is the history of the bicycle in a few sentences?",
    "Explain what the Olympic Games were in ancient Greece.",
    "Why do different countries drive on different sides of the road?",
    "What is jazz, and where did it begin?",
    "Explain what the Renaissance was.",
)
