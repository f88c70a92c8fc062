"""The server's scheduler: one thread owns the device and runs concurrent requests as batches.

Requests wait in a bounded queue. The scheduler thread takes the oldest,
waits while others that can share its compiled programs keep arriving (the
same options but for `max_new_tokens`, which is per row), and runs them as
one batch through `api.request`, `prefill` and a few rounds of `run` per
dispatch, as `api.stream` does. After every dispatch each row's new tokens
go to its own request, text cut at whole characters (and at stop strings);
a row finishes on its own, and the batch ends when every row has. The
batch is padded with finished dummy rows to a power of two, so that a few
program shapes serve every batch size, and its buffers hold at least
`MIN_NEW_TOKENS` new tokens, so that short requests share programs too.
Nothing here knows about HTTP: a request hands in a thread-safe `post`
callable and receives `Piece`, `Finished` and `Failed` events through it.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import random
import threading
import time
from typing import Any, Callable, Optional, Sequence

import jax.numpy as jnp
import numpy as np

from jspec import api
from jspec import bundle as bundle_lib
from jspec import options as options_lib

logger = logging.getLogger("jspec.serve")

DUMMY_TOKEN = 0  # the prompt of a padding row; it is finished after prefill (max_new 1)
COUNTS = ("batches", "rows", "finished", "abandoned", "failed", "rejected")
# Batches get buffers for at least this many new tokens: requests asking for
# up to this many share one program per prompt bucket and batch size.
MIN_NEW_TOKENS = options_lib.Options().max_new_tokens
# Larger batches decode with the target alone (`Scheduler`): on the 2-core CPU
# a batch of 2 decodes faster speculating, and batches of 4 and 8 faster
# target-only (docs/decisions.md, "Serving batches").
SPECULATE_MAX_BATCH = 2
GATHER_WINDOWS = 10  # the oldest waiting request waits at most this many batch windows


class QueueFull(Exception):
  """The bounded queue holds as many waiting requests as it may."""


class ShuttingDown(Exception):
  """The scheduler is stopping and takes no more requests."""


@dataclasses.dataclass
class Piece:
  """New output of a running request.

  Attributes:
    text: the new text (whole characters only; may be "" while a
      character's bytes are incomplete or a stop string may be starting).
    ids: the new token ids.
  """

  text: str
  ids: list[int]


@dataclasses.dataclass
class Finished:
  """A request's last event when it ended normally.

  Attributes:
    reason: "stop" (EOS or a stop string) or "length" (max_new_tokens).
    stats: the request's counts (`row_stats`).
  """

  reason: str
  stats: dict[str, Any]


@dataclasses.dataclass
class Failed:
  """A request's last event when it could not be served.

  Attributes:
    status: the HTTP status that fits (503 while shutting down, else 500).
    message: one line for the client.
  """

  status: int
  message: str


Event = Any  # Piece | Finished | Failed


@dataclasses.dataclass(eq=False)
class Job:
  """One request as the scheduler sees it.

  Attributes:
    ids: the prompt's token ids (checked against the vocabulary and the context).
    options: its checked options; `max_new_tokens` is its own row's.
    post: called from the scheduler thread with each `Event`; must be
      thread-safe and must not block.
    seeded: the client chose the seed: a sampled request then runs alone,
      so that its seed reproduces `jspec.generate` exactly.
    stop: strings that end the output (cut before them).
    abandoned: set by the client's side when it went away; the scheduler
      then drops the row and runs the others on.
    submitted: `time.monotonic()` when it was queued.
  """

  ids: list[int]
  options: options_lib.Options
  post: Callable[[Event], None]
  seeded: bool = False
  stop: tuple[str, ...] = ()
  abandoned: bool = False
  submitted: float = dataclasses.field(default_factory=time.monotonic)

  @property
  def sampled(self) -> bool:
    """Whether the request samples (temperature > 0) rather than decodes greedily."""
    return self.options.temperature > 0

  def key(self) -> Any:
    """What two jobs must share to run in one batch: every option but the row's own length.

    Returns:
      A hashable key; a seeded sampled job's is its own.
    """
    own_seed = self.seeded and self.sampled
    opts = dataclasses.replace(self.options, max_new_tokens=1,
                               seed=self.options.seed if own_seed else 0)
    return (opts, id(self) if own_seed else None)


class TextStream:
  """Turns a row's growing token ids into text pieces: whole characters, cut at stop strings.

  Attributes:
    sent: the text handed out so far.
    stopped: a stop string was found.
  """

  def __init__(self, tokenizer: Any, eos_ids: Sequence[int], stop: Sequence[str] = ()):
    """Starts an empty stream.

    Args:
      tokenizer: decodes ids (None: no text, ids only).
      eos_ids: ids that end a row; a final one is left out of the text.
      stop: stop strings (non-empty).
    """
    self.tokenizer = tokenizer
    self.eos_ids = frozenset(int(i) for i in eos_ids)
    self.stop = tuple(stop)
    self.sent = ""
    self.stopped = False

  def update(self, ids: list[int], done: bool) -> str:
    """The text to hand out now, given every new id of the row so far.

    Args:
      ids: all the row's generated ids.
      done: the row has finished (its last id may be an EOS).

    Returns:
      The new text since the last call; after a stop string is found,
      `stopped` is set and nothing more comes.
    """
    if self.stopped or self.tokenizer is None:
      return ""
    if done and ids and ids[-1] in self.eos_ids:
      ids = ids[:-1]
    text = self.tokenizer.decode(ids)
    if not done and text.endswith("\ufffd"):
      text = text[:-1]  # an incomplete UTF-8 sequence: wait for its last byte
    if self.stop:
      hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
      if hits:
        text = text[:min(hits)]
        self.stopped = True
      elif not done:
        text = text[:len(text) - self._held(text)]
    if not text.startswith(self.sent):
      return ""  # an earlier character changed on decoding more ids: keep what was sent
    piece, self.sent = text[len(self.sent):], text
    return piece

  def _held(self, text: str) -> int:
    """Length of the longest end of `text` that may be the start of a stop string."""
    longest = max(len(s) for s in self.stop)
    for k in range(min(longest - 1, len(text)), 0, -1):
      if any(s.startswith(text[-k:]) for s in self.stop):
        return k
    return 0


def row_stats(rounds: int, drafted: int, accepted: int, n_new: int, n_prompt: int,
              batch_size: int, queue_s: float, total_s: float) -> dict[str, Any]:
  """A finished request's counts, as the server reports them (no NaN: JSON nulls).

  Args:
    rounds: rounds in which the row was active.
    drafted: drafts that counted.
    accepted: drafts accepted.
    n_new: tokens generated (an EOS included).
    n_prompt: prompt tokens.
    batch_size: requests in its batch (padding rows not counted).
    queue_s: seconds from queued to its batch starting.
    total_s: seconds from queued to finished.

  Returns:
    prompt_tokens, completion_tokens, rounds, drafted_tokens,
    accepted_tokens, acceptance_rate, tokens_per_round, batch_size,
    queue_s, total_s.
  """
  return {
      "prompt_tokens": n_prompt,
      "completion_tokens": n_new,
      "rounds": rounds,
      "drafted_tokens": drafted,
      "accepted_tokens": accepted,
      "acceptance_rate": accepted / drafted if drafted else None,
      # The prefill emits the first token; every round emits the rest.
      "tokens_per_round": (n_new - 1) / rounds if rounds else None,
      "batch_size": batch_size,
      "queue_s": queue_s,
      "total_s": total_s,
  }


def padded_size(n: int) -> int:
  """`n` rows rounded up to a power of two: the batch sizes programs are compiled for."""
  return 1 << (n - 1).bit_length()


@dataclasses.dataclass(eq=False)
class _Row:
  """One request's row in a running batch.

  Attributes:
    job: the request.
    text: its text so far.
    start: index of the row's first generated token in the state's tokens.
    sent_ids: generated ids already posted.
    retired: the row is finished, cut or abandoned: nothing more is posted.
  """

  job: Job
  text: TextStream
  start: int
  sent_ids: int = 0
  retired: bool = False


class Scheduler:
  """Runs queued jobs on one thread, in batches of compatible jobs.

  Attributes:
    bundle: the model pair (only this thread runs it once started).
    counts: totals for /health and tests: batches, rows, finished,
      abandoned, failed, rejected.
  """

  def __init__(self, bundle: bundle_lib.Bundle, *, max_batch: int = 16, max_queue: int = 64,
               window_s: float = 0.005, rounds_per_dispatch: int = 4,
               speculate_max_batch: int = SPECULATE_MAX_BATCH):
    """Makes a scheduler; `start` runs it.

    Args:
      bundle: the loaded pair.
      max_batch: most requests in one batch, 1 to `options.MAX_BATCH`.
      max_queue: most requests waiting (not yet in a batch), >= 1.
      window_s: how long a batch waits for one more request to join it
        (after the newest; at most `GATHER_WINDOWS` windows after the oldest).
      rounds_per_dispatch: rounds per device call (>= 1): fewer stream
        sooner, more cost less host time.
      speculate_max_batch: batches of more requests than this decode with
        the target alone (0: always): a verify of B rows is B (G + 1)
        positions, compute rather than memory once B is large, so there
        speculation costs more than it saves. The output is the target's
        either way.

    Raises:
      ValueError: a setting out of range.
    """
    if not 1 <= max_batch <= options_lib.MAX_BATCH:
      raise ValueError(f"max_batch={max_batch}: expected 1 to {options_lib.MAX_BATCH}")
    if max_queue < 1:
      raise ValueError(f"max_queue={max_queue}: expected at least 1")
    if not 0 <= window_s <= 10:
      raise ValueError(f"batch window {window_s} s: expected 0 to 10 s")
    if rounds_per_dispatch < 1:
      raise ValueError(f"rounds_per_dispatch={rounds_per_dispatch}: expected at least 1")
    if not 0 <= speculate_max_batch <= options_lib.MAX_BATCH:
      raise ValueError(f"speculate_max_batch={speculate_max_batch}: expected 0 to "
                       f"{options_lib.MAX_BATCH}")
    self.speculate_max_batch = speculate_max_batch
    self.bundle = bundle
    self.max_batch = max_batch
    self.max_queue = max_queue
    self.window_s = window_s
    self.rounds_per_dispatch = rounds_per_dispatch
    self.context = bundle.target.cfg.max_position_embeddings
    self.eos_ids = tuple(getattr(bundle.tokenizer, "eos_token_ids", ())
                         or bundle.target.cfg.eos_token_ids)
    # Every key from the start: /health copies it from another thread, and
    # a dict that grows while it is copied fails the copy.
    self.counts = collections.Counter({k: 0 for k in COUNTS})
    self.running = 0  # rows of the batch now on the device
    self._pending: collections.deque[Job] = collections.deque()
    self._cond = threading.Condition()
    self._stopping = False
    self._thread: Optional[threading.Thread] = None

  def pending(self) -> int:
    """Requests waiting for a batch."""
    with self._cond:
      return len(self._pending)

  def submit(self, job: Job) -> None:
    """Queues a job (from any thread).

    Args:
      job: the checked request.

    Raises:
      QueueFull: `max_queue` jobs are already waiting.
      ShuttingDown: `stop` was called.
    """
    with self._cond:
      if self._stopping:
        raise ShuttingDown("the server is shutting down")
      if len(self._pending) >= self.max_queue:
        self.counts["rejected"] += 1
        raise QueueFull(f"the server is busy: {len(self._pending)} requests are waiting "
                        f"(the queue holds {self.max_queue}); retry later")
      self._pending.append(job)
      self._cond.notify()

  def start(self) -> None:
    """Starts the scheduler thread (once)."""
    if self._thread is None:
      self._thread = threading.Thread(target=self._loop, name="jspec-scheduler", daemon=True)
      self._thread.start()

  def stop(self, timeout_s: float = 30.0) -> bool:
    """Stops taking jobs, fails the waiting ones, ends the running batch after its dispatch.

    Args:
      timeout_s: how long to wait for the thread (a dispatch that compiles may take a while).

    Returns:
      Whether the thread has ended.
    """
    with self._cond:
      self._stopping = True
      waiting = list(self._pending)
      self._pending.clear()
      self._cond.notify_all()
    for job in waiting:
      _post(job, Failed(503, "the server is shutting down"))
    if self._thread is not None:
      self._thread.join(timeout_s)
      return not self._thread.is_alive()
    return True

  def warmup(self, batch_sizes: Sequence[int], prompt_tokens: int,
             options: Sequence[options_lib.Options]) -> float:
    """Compiles (or loads) the programs of the given shapes before the first request.

    Call it before `start`: it runs on the caller's thread.

    Args:
      batch_sizes: padded batch sizes (powers of two).
      prompt_tokens: a prompt length whose bucket to compile for.
      options: the options to compile for (each its own programs).

    Returns:
      Seconds spent.
    """
    t0 = time.perf_counter()
    for opts in options:
      opts = dataclasses.replace(opts, max_new_tokens=self._buffer_new(prompt_tokens,
                                                                       opts.max_new_tokens))
      for size in batch_sizes:
        api.request(self.bundle, [[DUMMY_TOKEN] * prompt_tokens] * size,
                    self._method_for(size, opts)).compile_seconds()
    return time.perf_counter() - t0

  def _method_for(self, rows: int, opts: options_lib.Options) -> options_lib.Options:
    """The options a batch of `rows` requests runs with: target-only past `speculate_max_batch`."""
    if rows <= self.speculate_max_batch or opts.method == "target":
      return opts
    return dataclasses.replace(opts, method="target", gamma=None, gamma_max=None)

  def _buffer_new(self, longest: int, most_new: int) -> int:
    """The new tokens a batch's buffers hold: its most, at least `MIN_NEW_TOKENS` where it fits.

    Each row still stops at its own max_new; the floor only makes requests
    of different lengths share programs.
    """
    return max(most_new, min(MIN_NEW_TOKENS, self.context - longest))

  def _loop(self) -> None:
    """The scheduler thread: gathers and runs batches until `stop`."""
    while True:
      jobs = self._gather()
      if jobs is None:
        return
      if not jobs:
        continue
      try:
        self._run(jobs)
      except Exception as err:  # pylint: disable=broad-except
        # A bug or a device failure must not take the server down with it:
        # this batch's requests fail, later ones are tried afresh.
        logger.exception("batch of %d requests failed", len(jobs))
        for job in jobs:
          _post(job, Failed(500, f"generation failed: {type(err).__name__}: {err}"))
        self.counts["failed"] += len(jobs)
      finally:
        self.running = 0

  def _gather(self) -> Optional[list[Job]]:
    """The next batch: the oldest job and the compatible ones that fit, after the window.

    Returns:
      The jobs (empty when only abandoned ones were waiting), or None once stopping.
    """
    with self._cond:
      while not self._pending and not self._stopping:
        self._cond.wait(0.5)
      if self._stopping:
        return None
      first = self._pending[0]
      key = first.key()
      latest = first.submitted + GATHER_WINDOWS * self.window_s
      while not self._stopping:
        now = time.monotonic()
        same = [j for j in self._pending if j.key() == key and not j.abandoned]
        # Clients that start together arrive over a few milliseconds: the
        # batch waits while they keep coming, a window after the newest, but
        # no longer than GATHER_WINDOWS windows after the oldest.
        deadline = min(latest, max(j.submitted for j in same or [first]) + self.window_s)
        if len(same) >= self.max_batch or now >= deadline:
          break
        self._cond.wait(deadline - now)
      if self._stopping:
        return None
      jobs, longest, most_new = [], 0, 0
      for job in list(self._pending):
        if job.abandoned:
          self._pending.remove(job)
          self.counts["abandoned"] += 1
        elif len(jobs) < self.max_batch and job.key() == key:
          # Rows share one buffer width: the longest prompt and the most new
          # tokens of the batch must fit the context together.
          fit_long = max(longest, len(job.ids))
          fit_new = max(most_new, job.options.max_new_tokens)
          if fit_long + fit_new <= self.context:
            jobs.append(job)
            self._pending.remove(job)
            longest, most_new = fit_long, fit_new
      return jobs

  def _run(self, jobs: list[Job]) -> None:
    """Runs one batch to its end, handing each row's output to its job as it appears.

    Args:
      jobs: the batch's requests (1 to `max_batch`), in row order.
    """
    started = time.monotonic()
    self.counts["batches"] += 1
    self.counts["rows"] += len(jobs)
    self.running = len(jobs)
    req, args, eos = self._start(jobs)
    size = len(req.prompts)  # padded rows included
    rows = [_Row(j, TextStream(self.bundle.tokenizer, eos, j.stop), len(j.ids)) for j in jobs]
    state = req.prefill(*args)
    limit = 0
    while True:
      self._hand_out(rows, state, eos, started)
      live = [r for r in rows if not r.retired]
      self.running = len(live)
      if not live:
        return
      if self._stopping:
        for row in live:
          _post(row.job, Failed(503, "the server is shutting down"))
        self.counts["failed"] += len(live)
        return
      # Rows dropped early (abandoned, or cut at a stop string) are marked
      # finished on the device: they no longer widen verifies or keep drafting.
      done = np.array(state.done)  # [size] bool
      retired = np.array([r.retired for r in rows] + [True] * (size - len(rows)))
      if np.any(retired & ~done):
        state = state.replace(done=jnp.asarray(done | retired))
      limit += self.rounds_per_dispatch
      state = req.run(args[0], args[1], state, jnp.int32(limit))

  def _start(self, jobs: list[Job]) -> tuple[api.Request, list[Any], tuple[int, ...]]:
    """A batch's programs and prefill arguments: padded to a power of two, each row its own length.

    Args:
      jobs: the batch's requests, in row order.

    Returns:
      (the `api.Request` of the padded batch, prefill's arguments with each
      row's own max_new_tokens, the ids that end a row).
    """
    size = padded_size(len(jobs))
    first = jobs[0]
    seed = first.options.seed if first.seeded else random.getrandbits(32)
    opts = dataclasses.replace(first.options, seed=seed, max_new_tokens=self._buffer_new(
        max(len(j.ids) for j in jobs), max(j.options.max_new_tokens for j in jobs)))
    opts = self._method_for(len(jobs), opts)
    req = api.request(self.bundle, [j.ids for j in jobs] + [[DUMMY_TOKEN]] * (size - len(jobs)),
                      opts)
    args = list(req.args)
    # Each row stops at its own length; padding rows are finished after prefill.
    args[4] = jnp.asarray([j.options.max_new_tokens for j in jobs] + [1] * (size - len(jobs)),
                          jnp.int32)  # [size]
    eos = self.eos_ids if opts.stop_at_eos else ()
    return req, args, eos

  def _hand_out(self, rows: list[_Row], state: Any, eos: Sequence[int], started: float) -> None:
    """Posts each live row's new output after a dispatch, and finishes the rows that are done.

    Args:
      rows: the batch's rows (padding rows not included), in row order.
      state: the decode state after the dispatch (`decode.State`).
      eos: the ids that end a row.
      started: `time.monotonic()` when the batch started.
    """
    seq_len, done = np.array(state.seq_len), np.array(state.done)  # [size] each
    tokens = np.array(state.tokens)  # [size, width]
    counts = None
    for r, row in enumerate(rows):
      if row.retired:
        continue
      if row.job.abandoned:
        row.retired = True
        self.counts["abandoned"] += 1
        continue
      ids = tokens[r, row.start:seq_len[r]].tolist()
      piece = row.text.update(ids, bool(done[r]))
      new_ids = ids[row.sent_ids:]
      if piece or new_ids:
        _post(row.job, Piece(piece, new_ids))
        row.sent_ids = len(ids)
      if done[r] or row.text.stopped:
        if counts is None:
          counts = (np.array(state.row_rounds), np.array(state.drafted),
                    np.array(state.accepted))  # [size] each
        eos_end = bool(ids) and ids[-1] in eos
        reason = "stop" if row.text.stopped or eos_end else "length"
        stats = row_stats(int(counts[0][r]), int(counts[1][r]), int(counts[2][r]), len(ids),
                          len(row.job.ids), len(rows), started - row.job.submitted,
                          time.monotonic() - row.job.submitted)
        _post(row.job, Finished(reason, stats))
        row.retired = True
        self.counts["finished"] += 1


def _post(job: Job, event: Event) -> None:
  """Hands an event to a job; a job whose receiver is gone counts as abandoned."""
  try:
    job.post(event)
  except Exception:  # pylint: disable=broad-except
    # e.g. the server's event loop has closed: nobody reads this job any more.
    job.abandoned = True
