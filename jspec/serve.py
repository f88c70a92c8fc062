"""`jspec serve`: an OpenAI-compatible HTTP server over one loaded model pair.

    jspec serve --port 8000
    curl localhost:8000/v1/completions -d '{"model": "qwen2.5-coder", "prompt": "def f(x):",
                                            "max_tokens": 32, "temperature": 0}'

Endpoints: POST /v1/completions and /v1/chat/completions (streaming with
server-sent events, or not), GET /v1/models and GET /health. The models are
loaded once; requests go to `jspec.batching.Scheduler`, whose one thread
runs concurrent requests as one batch. A request's speculative counts
(acceptance rate, tokens per round, rounds) come as extra fields of its
`usage` and, when not streaming, as `x-jspec-*` headers.

Mapping of OpenAI's fields: temperature (default 1, OpenAI's; 0 is
greedy), top_p, max_tokens (chat: or max_completion_tokens; default the
smaller of 128 and what the context leaves), seed (a seeded sampled request
runs alone, so its seed reproduces `jspec.generate`), stop (up to 4
strings, cut on the host), n and best_of (1 only), stream and
stream_options.include_usage. Extensions, as vLLM spells them: top_k and
ignore_eos. Fields OpenAI has and jspec cannot honour (logprobs, echo,
suffix, penalties, logit_bias, tools, a response_format other than text)
are a 400 unless they ask for nothing; unknown fields are ignored. Bad
requests get 400 with OpenAI's error body; a full queue gets 429.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import pathlib
import threading
import time
import uuid
from typing import Any, AsyncIterator, Optional

import uvicorn
from starlette import applications
from starlette import exceptions as starlette_exceptions
from starlette import requests as starlette_requests
from starlette import responses
from starlette import routing

from jspec import api
from jspec import batching
from jspec import bundle as bundle_lib
from jspec import options as options_lib

logger = logging.getLogger("jspec.serve")

DEFAULT_MAX_TOKENS = options_lib.Options().max_new_tokens
MAX_STOP = 4  # OpenAI's limit on stop sequences
DISCONNECT_POLL_S = 0.5  # how often a waiting request checks that its client is still there
GRACEFUL_SHUTDOWN_S = 30  # Ctrl-C lets running requests finish this long (twice: at once)
WARMUP_PROMPT_TOKENS = 100  # --warmup compiles the buffer of a prompt this long (`api.widths`)
# Fields OpenAI defines that jspec cannot honour, and the values that ask for nothing.
UNSUPPORTED = {
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False),
    "suffix": (None, ""), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "logit_bias": (None, {}), "tools": (None, []), "functions": (None, []),
    "tool_choice": (None, "none"), "function_call": (None, "none"),
}


class BadRequest(Exception):
  """A request the server refuses, with OpenAI's error fields.

  Attributes:
    message: one line for the client.
    param: the offending field, or None.
    code: OpenAI's machine-readable code, or None.
    status: the HTTP status.
  """

  def __init__(self, message: str, param: Optional[str] = None, code: Optional[str] = None,
               status: int = 400):
    super().__init__(message)
    self.message, self.param, self.code, self.status = message, param, code, status


def error_response(status: int, message: str, kind: str, param: Optional[str] = None,
                   code: Optional[str] = None,
                   headers: Optional[dict] = None) -> responses.Response:
  """An OpenAI-style error: `{"error": {"message", "type", "param", "code"}}`.

  Args:
    status: the HTTP status.
    message: one line for the client.
    kind: OpenAI's error type (e.g. "invalid_request_error").
    param: the offending field.
    code: a machine-readable code.
    headers: extra response headers.

  Returns:
    The JSON response.
  """
  body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
  return responses.JSONResponse(body, status_code=status, headers=headers)


@dataclasses.dataclass
class Parsed:
  """A checked request, ready for the scheduler.

  Attributes:
    ids: prompt token ids.
    options: the generation options.
    seeded: the client gave a seed.
    stop: stop strings.
    stream: answer with server-sent events.
    include_usage: streaming: end with a usage chunk.
  """

  ids: list[int]
  options: options_lib.Options
  seeded: bool
  stop: tuple[str, ...]
  stream: bool
  include_usage: bool


def _number(body: dict, name: str, default: Any) -> Any:
  """A finite number field of a request.

  Args:
    body: the request's JSON object.
    name: the field.
    default: the value when the field is missing or null.

  Returns:
    The value.

  Raises:
    BadRequest: not a finite number.
  """
  value = body.get(name)
  if value is None:
    return default
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
    raise BadRequest(f"{name}={value!r}: expected a number", name)
  return value


def _integer(body: dict, name: str, default: Any) -> Any:
  """An integer field of a request (true and false are not integers here).

  Args:
    body: the request's JSON object.
    name: the field.
    default: the value when the field is missing or null.

  Returns:
    The value.

  Raises:
    BadRequest: not an integer.
  """
  value = body.get(name)
  if value is None:
    return default
  if isinstance(value, bool) or not isinstance(value, int):
    raise BadRequest(f"{name}={value!r}: expected an integer", name)
  return value


def _flag(body: dict, name: str) -> bool:
  """A boolean field of a request; missing or null is False.

  Raises:
    BadRequest: not true or false.
  """
  value = body.get(name)
  if value is None:
    return False
  if not isinstance(value, bool):
    raise BadRequest(f"{name}={value!r}: expected true or false", name)
  return value


# Options' field names in its messages, as the client knows them.
_PARAMS = {"max_new_tokens": "max_tokens", "stop_at_eos": "ignore_eos"}


class Server:
  """The HTTP application over a loaded pair and its scheduler.

  Attributes:
    bundle: the pair.
    model_name: the id clients name in "model".
    scheduler: the `batching.Scheduler`.
    app: the Starlette application (ASGI).
  """

  def __init__(self, bundle: bundle_lib.Bundle, model_name: str, *, max_batch: int = 16,
               max_queue: int = 64, batch_window_s: float = 0.005, rounds_per_dispatch: int = 4,
               base: Optional[options_lib.Options] = None,
               speculate_max_batch: int = batching.SPECULATE_MAX_BATCH):
    """Builds the application; the scheduler starts with it (its lifespan).

    Args:
      bundle: the loaded pair; it needs a tokenizer.
      model_name: the served model's id.
      max_batch: most requests per batch.
      max_queue: most requests waiting; more get 429.
      batch_window_s: how long a batch waits for one more request to join.
      rounds_per_dispatch: decode rounds per device call.
      base: the options requests start from (method, policy, gamma ...;
        None: `jspec.Options()`).
      speculate_max_batch: larger batches decode with the target alone
        (`batching.Scheduler`).

    Raises:
      ValueError: a bundle without a tokenizer, or a bad setting.
    """
    if bundle.tokenizer is None:
      raise ValueError("the server needs a tokenizer: load the model with one (--tokenizer)")
    self.bundle = bundle
    self.model_name = model_name
    self.base = base or options_lib.Options()
    self.base.spec(bundle.target.arch, bundle.draft.arch if bundle.draft else None)
    self.created = int(time.time())
    self.scheduler = batching.Scheduler(bundle, max_batch=max_batch, max_queue=max_queue,
                                        window_s=batch_window_s,
                                        rounds_per_dispatch=rounds_per_dispatch,
                                        speculate_max_batch=speculate_max_batch)
    self.app = applications.Starlette(
        routes=[routing.Route("/v1/completions", self.completions, methods=["POST"]),
                routing.Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                routing.Route("/v1/models", self.models, methods=["GET"]),
                routing.Route("/health", self.health, methods=["GET"])],
        exception_handlers={starlette_exceptions.HTTPException: self._http_error,
                            Exception: self._server_error},
        lifespan=self._lifespan)

  @contextlib.asynccontextmanager
  async def _lifespan(self, app):  # pylint: disable=unused-argument
    """Runs the scheduler while the application runs; stopping ends the running batch."""
    self.scheduler.start()
    try:
      yield
    finally:
      # In a thread: the running batch finishes its dispatch first.
      await asyncio.get_running_loop().run_in_executor(None, self.scheduler.stop)

  async def _http_error(self, request, exc):  # pylint: disable=unused-argument
    """Starlette's own errors (404, 405) as OpenAI error bodies."""
    return error_response(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                          "invalid_request_error")

  async def _server_error(self, request, exc):  # pylint: disable=unused-argument
    """A bug in a handler: logged with its traceback, a 500 with one line for the client."""
    logger.exception("request failed", exc_info=exc)
    return error_response(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")

  # Endpoints.

  async def health(self, request):  # pylint: disable=unused-argument
    """GET /health: liveness and the scheduler's counts."""
    sched = self.scheduler
    return responses.JSONResponse({"status": "ok", "model": self.model_name,
                                   "pending": sched.pending(), "running": sched.running,
                                   "max_queue": sched.max_queue, "max_batch": sched.max_batch,
                                   "counts": dict(sched.counts)})

  async def models(self, request):  # pylint: disable=unused-argument
    """GET /v1/models: the one served model."""
    return responses.JSONResponse({"object": "list", "data": [
        {"id": self.model_name, "object": "model", "created": self.created,
         "owned_by": "jspec"}]})

  async def completions(self, request):
    """POST /v1/completions."""
    return await self._serve(request, chat=False)

  async def chat_completions(self, request):
    """POST /v1/chat/completions."""
    return await self._serve(request, chat=True)

  # Parsing.

  def parse(self, body: Any, chat: bool) -> Parsed:
    """Checks a request body and turns it into token ids and `jspec.Options`.

    Args:
      body: the decoded JSON.
      chat: a chat completion (messages) rather than a completion (prompt).

    Returns:
      The `Parsed` request.

    Raises:
      BadRequest: anything the server cannot serve as asked.
    """
    if not isinstance(body, dict):
      raise BadRequest(f"the body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if not isinstance(model, str) or not model:
      raise BadRequest("model is required: a string naming the served model", "model")
    if model != self.model_name:
      raise BadRequest(f"unknown model {model!r}; this server serves {self.model_name!r}",
                       "model", "model_not_found")
    for name, harmless in UNSUPPORTED.items():
      if body.get(name) not in harmless:
        raise BadRequest(f"{name} is not supported by this server", name)
    if chat and body.get("response_format") not in (None, {"type": "text"}):
      raise BadRequest("response_format: only {'type': 'text'} is supported", "response_format")
    for name in ("n", "best_of"):
      if _integer(body, name, 1) != 1:
        raise BadRequest(f"{name}={body[name]}: only 1 is supported (send several requests)",
                         name)
    ids = self._chat_ids(body) if chat else self._prompt_ids(body)
    context = self.bundle.target.cfg.max_position_embeddings
    limit_name = "max_tokens"
    if chat and body.get("max_completion_tokens") is not None:
      limit_name = "max_completion_tokens"
    max_tokens = _integer(body, limit_name, None)
    if max_tokens is None:
      max_tokens = min(DEFAULT_MAX_TOKENS, context - len(ids))
      if max_tokens < 1:
        raise BadRequest(f"the prompt of {len(ids)} tokens fills the model's context of "
                         f"{context} tokens", "messages" if chat else "prompt",
                         "context_length_exceeded")
    elif max_tokens >= 1 and len(ids) + max_tokens > context:
      # The prompt is at fault when it fills the context alone, else the length asked for.
      at_fault = ("messages" if chat else "prompt") if len(ids) >= context else limit_name
      raise BadRequest(f"the prompt of {len(ids)} tokens + {limit_name}={max_tokens} exceeds "
                       f"the model's context of {context} tokens", at_fault,
                       "context_length_exceeded")
    seed = _integer(body, "seed", None)
    kwargs = dict(max_new_tokens=max_tokens, temperature=_number(body, "temperature", 1.0),
                  top_p=_number(body, "top_p", 1.0), top_k=_integer(body, "top_k", 0),
                  stop_at_eos=not _flag(body, "ignore_eos"),
                  seed=self.base.seed if seed is None else seed)
    try:
      opts = options_lib.make(self.base, **kwargs)
    except ValueError as err:
      message = str(err)
      name = message.split("=", 1)[0]
      param = _PARAMS.get(name, name)
      if name == "max_new_tokens":
        param = limit_name
      raise BadRequest(message.replace(f"{name}=", f"{param}=", 1), param) from None
    stream = _flag(body, "stream")
    usage = body.get("stream_options")
    if usage is not None and (not isinstance(usage, dict) or not stream):
      raise BadRequest("stream_options: expected an object, and only with stream=true",
                       "stream_options")
    include_usage = bool(usage and _flag(usage, "include_usage"))
    return Parsed(ids, opts, seed is not None, _stops(body.get("stop")), stream, include_usage)

  def _prompt_ids(self, body: dict) -> list[int]:
    """A completion's prompt (a string, token ids, or a list of one of them) as token ids.

    Raises:
      BadRequest: a missing, empty or malformed prompt, or several prompts.
    """
    prompt = body.get("prompt")
    if prompt is None:
      raise BadRequest("prompt is required", "prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
      if len(prompt) != 1:
        raise BadRequest(f"prompt: only one prompt per request is supported, got {len(prompt)} "
                         "(send one request each)", "prompt")
      prompt = prompt[0]
    if isinstance(prompt, list) and any(isinstance(t, bool) or not isinstance(t, int)
                                        for t in prompt):
      raise BadRequest("prompt: expected a string, a list of token ids, or a list of one of "
                       "them", "prompt")
    return self._encode(prompt, "prompt")

  def _chat_ids(self, body: dict) -> list[int]:
    """A chat's messages through the tokenizer's chat template, as token ids.

    Raises:
      BadRequest: missing or malformed messages, non-text content, or no template.
    """
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
      raise BadRequest("messages is required: a non-empty list of messages", "messages")
    plain = []
    for i, message in enumerate(messages):
      if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise BadRequest(f"messages[{i}]: expected an object with a role and content",
                         "messages")
      content = message.get("content")
      if isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text"
                   and isinstance(p.get("text"), str) for p in content):
          raise BadRequest(f"messages[{i}].content: only text parts are supported", "messages")
        content = "".join(p["text"] for p in content)
      if not isinstance(content, str):
        raise BadRequest(f"messages[{i}].content: expected a string or a list of text parts",
                         "messages")
      plain.append({"role": message["role"], "content": content})
    try:
      text = self.bundle.tokenizer.apply_chat_template(plain, add_generation_prompt=True)
    except ValueError as err:  # TokenizerError: no template, or the template refused
      raise BadRequest(f"messages: {err}", "messages") from None
    return self._encode(text, "messages")

  def _encode(self, prompt: Any, param: str) -> list[int]:
    """`api.encode`, its errors as a 400 naming `param`."""
    try:
      return api.encode(self.bundle, prompt)
    except ValueError as err:
      raise BadRequest(f"{param}: {err}", param) from None

  # Serving.

  async def _serve(self, request: starlette_requests.Request, chat: bool) -> responses.Response:
    """Checks a request, queues it and answers: a stream of events, or the whole response.

    Args:
      request: the HTTP request.
      chat: a chat completion rather than a completion.

    Returns:
      The response: 400 for a bad request, 429 when the queue is full, 503
      while shutting down.
    """
    raw = await request.body()
    try:
      body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
      return error_response(400, f"malformed JSON body: {err}", "invalid_request_error")
    try:
      parsed = self.parse(body, chat)
    except BadRequest as err:
      return error_response(err.status, err.message, "invalid_request_error", err.param,
                            err.code)
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    job = batching.Job(parsed.ids, parsed.options,
                       lambda event: loop.call_soon_threadsafe(events.put_nowait, event),
                       seeded=parsed.seeded, stop=parsed.stop)
    try:
      self.scheduler.submit(job)
    except batching.QueueFull as err:
      return error_response(429, str(err), "rate_limit_error", code="queue_full",
                            headers={"retry-after": "1"})
    except batching.ShuttingDown as err:
      return error_response(503, str(err), "server_error", code="shutting_down")
    ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    reply = _Reply(ident, int(time.time()), self.model_name, chat)
    received = _receive(request, job, events)
    if parsed.stream:
      return responses.StreamingResponse(
          _stream(reply, received, parsed.include_usage), media_type="text/event-stream",
          headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
    return await _whole(reply, received)


async def _whole(reply: "_Reply", received: AsyncIterator[Any]) -> responses.Response:
  """The non-streaming answer: every piece's text, then the response with stats headers.

  Args:
    reply: builds the response object.
    received: the job's events (`_receive`).

  Returns:
    The JSON response; the scheduler's status on failure; 499 when the
    client went away first.
  """
  text = []
  async for event in received:
    if isinstance(event, batching.Piece):
      text.append(event.text)
    elif isinstance(event, batching.Failed):
      return error_response(event.status, event.message, "server_error")
    elif isinstance(event, batching.Finished):
      headers = {f"x-jspec-{k.replace('_', '-')}": f"{v:.6g}" for k, v in event.stats.items()
                 if k in ("acceptance_rate", "tokens_per_round", "rounds", "batch_size")
                 and v is not None}
      return responses.JSONResponse(reply.whole("".join(text), event), headers=headers)
  return responses.Response(status_code=499)  # the client went away


@dataclasses.dataclass
class _Reply:
  """Builds one request's response objects (whole, or as stream chunks)."""

  ident: str
  created: int
  model: str
  chat: bool

  def _head(self, kind: str) -> dict:
    """The fields every response object of this request starts with."""
    return {"id": self.ident, "object": kind, "created": self.created, "model": self.model}

  def whole(self, text: str, done: batching.Finished) -> dict:
    """The non-streaming response."""
    if self.chat:
      choice = {"index": 0, "message": {"role": "assistant", "content": text},
                "logprobs": None, "finish_reason": done.reason}
    else:
      choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": done.reason}
    return {**self._head("chat.completion" if self.chat else "text_completion"),
            "choices": [choice], "usage": usage(done.stats)}

  def chunk(self, text: Optional[str], reason: Optional[str] = None, first: bool = False) -> dict:
    """One streamed chunk: new text, or (text None) the end with its finish reason."""
    if self.chat:
      delta = {} if text is None else {"content": text}
      if first:
        delta = {"role": "assistant", "content": ""}
      choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
      return {**self._head("chat.completion.chunk"), "choices": [choice]}
    choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
    return {**self._head("text_completion"), "choices": [choice]}

  def usage_chunk(self, stats: dict) -> dict:
    """The last chunk of a stream with stream_options.include_usage."""
    return {**self._head("chat.completion.chunk" if self.chat else "text_completion"),
            "choices": [], "usage": usage(stats)}


def usage(stats: dict) -> dict:
  """OpenAI's usage object, with jspec's speculative counts as extra fields.

  Args:
    stats: a `batching.Finished`'s stats.

  Returns:
    prompt_tokens, completion_tokens, total_tokens, then acceptance_rate,
    tokens_per_round, rounds, drafted_tokens, accepted_tokens, batch_size.
  """
  out = {"prompt_tokens": stats["prompt_tokens"], "completion_tokens": stats["completion_tokens"],
         "total_tokens": stats["prompt_tokens"] + stats["completion_tokens"]}
  for name in ("acceptance_rate", "tokens_per_round", "rounds", "drafted_tokens",
               "accepted_tokens", "batch_size"):
    out[name] = stats[name]
  return out


def _stops(stop: Any) -> tuple[str, ...]:
  """The stop strings of a request (a string or a list of up to `MAX_STOP`)."""
  if stop is None:
    return ()
  stops = [stop] if isinstance(stop, str) else stop
  if (not isinstance(stops, list) or len(stops) > MAX_STOP
      or not all(isinstance(s, str) and s for s in stops)):
    raise BadRequest(f"stop: expected a non-empty string or a list of at most {MAX_STOP} of "
                     "them", "stop")
  return tuple(stops)


async def _receive(request: starlette_requests.Request, job: batching.Job,
                   events: asyncio.Queue) -> AsyncIterator[Any]:
  """Yields a job's events until its last; marks it abandoned if the client leaves first.

  The client is checked every `DISCONNECT_POLL_S` while nothing arrives, and
  a closed stream closes this generator too (cancellation or `aclose`).
  """
  getter = None
  finished = False
  try:
    while True:
      if getter is None:
        getter = asyncio.ensure_future(events.get())
      ready, _ = await asyncio.wait({getter}, timeout=DISCONNECT_POLL_S)
      if not ready:
        if await request.is_disconnected():
          return
        continue
      event, getter = getter.result(), None
      finished = not isinstance(event, batching.Piece)
      yield event
      if finished:
        return
  finally:
    if getter is not None:
      getter.cancel()
    if not finished:
      job.abandoned = True


def _sse(data: Any) -> str:
  """One server-sent event carrying `data` as JSON."""
  return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _stream(reply: _Reply, received: AsyncIterator[Any],
                  include_usage: bool) -> AsyncIterator[str]:
  """The server-sent events of a streamed response, ending with `data: [DONE]`."""
  try:
    if reply.chat:
      yield _sse(reply.chunk(None, first=True))
    async for event in received:
      if isinstance(event, batching.Piece):
        if event.text:
          yield _sse(reply.chunk(event.text))
      elif isinstance(event, batching.Failed):
        yield _sse({"error": {"message": event.message, "type": "server_error", "param": None,
                              "code": None}})
        return
      else:
        yield _sse(reply.chunk(None, event.reason))
        if include_usage:
          yield _sse(reply.usage_chunk(event.stats))
        yield "data: [DONE]\n\n"
        return
  finally:
    await received.aclose()


def model_name(model: str, target: Optional[str]) -> str:
  """The id a server answers to: the known name, else the target path's last part.

  Args:
    model: the known model or pair loaded (used without a target).
    target: `--target`, or None.

  Returns:
    The id.
  """
  if target is not None:
    return pathlib.Path(target).expanduser().resolve().name
  return model


def run(server: Server, host: str = "127.0.0.1", port: int = 8000,
        log_level: str = "info") -> None:
  """Serves until Ctrl-C (or SIGTERM): uvicorn, which lets running requests finish first.

  Args:
    server: the application.
    host: the address to listen on.
    port: the port (0: any free one; the log says which).
    log_level: uvicorn's log level.
  """
  config = uvicorn.Config(server.app, host=host, port=port, log_level=log_level,
                          timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, access_log=False)
  uvicorn.Server(config).run()


class Background:
  """A server in a thread of this process, for tests and benchmarks that talk to it over HTTP.

  Attributes:
    server: the `Server`.
    url: its base address (http://host:port, the port as bound).
  """

  def __init__(self, server: Server, host: str = "127.0.0.1", port: int = 0,
               start_timeout_s: float = 30.0):
    """Starts uvicorn in a daemon thread and waits until it listens.

    Args:
      server: the application.
      host: the address to listen on.
      port: the port (0: any free one).
      start_timeout_s: how long to wait for it to listen.

    Raises:
      RuntimeError: it did not start in time.
    """
    self.server = server
    config = uvicorn.Config(server.app, host=host, port=port, log_level="warning",
                            timeout_graceful_shutdown=5, access_log=False)
    self._uvicorn = uvicorn.Server(config)
    self._thread = threading.Thread(target=self._uvicorn.run, name="jspec-serve", daemon=True)
    self._thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not self._uvicorn.started:
      if not self._thread.is_alive() or time.monotonic() > deadline:
        self.stop()
        raise RuntimeError(f"the server did not start on {host}:{port}")
      time.sleep(0.02)
    bound = self._uvicorn.servers[0].sockets[0].getsockname()
    self.url = f"http://{host}:{bound[1]}"

  def stop(self, timeout_s: float = 30.0) -> bool:
    """Shuts the server down as Ctrl-C would, and waits.

    Args:
      timeout_s: how long to wait for its thread.

    Returns:
      Whether it has stopped.
    """
    self._uvicorn.should_exit = True
    self._thread.join(timeout_s)
    return not self._thread.is_alive()


def check_args(args: Any) -> None:
  """Checks `jspec serve`'s settings before anything loads.

  Args:
    args: the parsed command line.

  Raises:
    ValueError: a setting out of range, named by its flag.
  """
  if not 0 <= args.port <= 65535:
    raise ValueError(f"--port {args.port}: expected 0 to 65535")
  if not 1 <= args.max_batch <= options_lib.MAX_BATCH:
    raise ValueError(f"--max-batch {args.max_batch}: expected 1 to {options_lib.MAX_BATCH}")
  if args.max_queue < 1:
    raise ValueError(f"--max-queue {args.max_queue}: expected at least 1")
  if not 0 <= args.speculate_max_batch <= options_lib.MAX_BATCH:
    raise ValueError(f"--speculate-max-batch {args.speculate_max_batch}: expected 0 to "
                     f"{options_lib.MAX_BATCH}")
  if not 0 <= args.batch_window_ms <= 10000:
    raise ValueError(f"--batch-window-ms {args.batch_window_ms:g}: expected 0 to 10000")


def main(bundle: bundle_lib.Bundle, name: str, args: Any) -> int:
  """`jspec serve` after loading: warms up if asked, then serves until stopped.

  Args:
    bundle: the loaded pair.
    name: the served model's id.
    args: the parsed command line (host, port, max_queue, max_batch,
      batch_window_ms, warmup).

  Returns:
    0 once stopped.

  Raises:
    ValueError: a setting out of range (`check_args`).
  """
  check_args(args)
  server = Server(bundle, name, max_batch=args.max_batch, max_queue=args.max_queue,
                  speculate_max_batch=args.speculate_max_batch,
                  batch_window_s=args.batch_window_ms / 1000)
  if args.warmup:
    sizes = [1 << k for k in range(server.scheduler.max_batch.bit_length())]
    # Options' default max_new_tokens is the scheduler's floor: these
    # programs serve every request of up to that many tokens whose prompt and
    # new tokens fit the same buffer width.
    seconds = server.scheduler.warmup(
        sizes, WARMUP_PROMPT_TOKENS,
        [dataclasses.replace(server.base, temperature=t) for t in (0.0, 1.0)])
    logger.warning("warmed up batch sizes %s (greedy and sampled, the buffer of a %d-token "
                   "prompt) in %.1f s", sizes, WARMUP_PROMPT_TOKENS, seconds)
  run(server, args.host, args.port)
  return 0
