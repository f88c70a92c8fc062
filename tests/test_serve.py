"""jspec serve against the official `openai` client, on 127.0.0.1 with a tiny real pair.

The server runs in this process (uvicorn in a thread, port 0) over the tiny
HF + GGUF pair of test_load; one test starts `jspec serve` as a child and
stops it with SIGINT. Expected outputs come from `jspec.generate` on the
same bundle. Every client has a timeout and `max_retries=0`, every wait
and loop here is bounded, and all traffic stays on loopback.
"""

import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

import jspec
import jspec.cli
import test_load
from jspec import batching
from jspec import serve

MODEL = "tiny-pair"
TIMEOUT_S = 60.0  # per HTTP request; generous for a compile on a loaded 2-core machine
# Prompts of 17 to 32 tokens (one byte each in the tiny vocabulary), so that
# completions and chats share one prompt bucket and so their programs.
PROMPT = "def f(x):\n    return x + 1\n"
CHAT = [{"role": "user", "content": "hi"}]
LONG = 160  # max_tokens of the long generations (one max_new bucket)


class Running(serve.Background):
  """A server on 127.0.0.1 in a background thread, and clients of it."""

  def __init__(self, bundle, **kwargs):
    super().__init__(serve.Server(bundle, MODEL, **kwargs))

  def client(self, timeout=TIMEOUT_S):
    return openai.OpenAI(base_url=self.url + "/v1", api_key="x", timeout=timeout, max_retries=0)


@pytest.fixture(scope="module")
def pair(tmp_path_factory, make_hf_model, write_gguf, tiny_vocab):
  return test_load.write_pair(tmp_path_factory.mktemp("serve"), make_hf_model, write_gguf,
                              tiny_vocab)


@pytest.fixture(scope="module")
def bundle(pair):
  return jspec.load(*pair, progress=False)


@pytest.fixture(scope="module")
def running(bundle):
  # One round per dispatch: many dispatches per generation, so a disconnect
  # lands mid-stream; a 100 ms window gathers the concurrent clients.
  run = Running(bundle, max_batch=16, max_queue=64, batch_window_s=0.1, rounds_per_dispatch=1)
  yield run
  assert run.stop()


@pytest.fixture(scope="module")
def client(running):
  return running.client()


def _want(bundle, texts, lengths, **options):
  """What the server must answer: `jspec.generate`'s ids cut to each request's length, and text.

  One batched `generate` of at least the server's buffer floor
  (`batching.MIN_NEW_TOKENS`) new tokens: a shorter greedy generation is
  its prefix, and the server's batch of the same size runs the same program,
  so the two compile once between them.

  Returns:
    [(text without a final EOS, ids)] per prompt.
  """
  results = jspec.generate(bundle, list(texts), **options,
                           max_new_tokens=max(batching.MIN_NEW_TOKENS, *lengths))
  out = []
  for result, n in zip(results, lengths):
    ids = result.token_ids[:n]
    shown = ids[:-1] if ids and ids[-1] in bundle.tokenizer.eos_token_ids else ids
    out.append((bundle.tokenizer.decode(shown), ids))
  return out


def _chat(bundle, messages):
  return bundle.tokenizer.apply_chat_template(messages)


@pytest.fixture(scope="module")
def want_prompt(bundle):
  return _want(bundle, [PROMPT], [12])[0]


def _health(running):
  return httpx.get(running.url + "/health", timeout=10).json()


def test_models_and_health(running, client):
  assert [m.id for m in client.models.list().data] == [MODEL]
  health = _health(running)
  assert health["status"] == "ok" and health["model"] == MODEL


def test_completion_greedy_equals_generate(bundle, client):
  # 100 new tokens: generate's buffers then hold what the server's do (its floor of
  # 128), so the two run one program on the same inputs and count the same.
  result = jspec.generate(bundle, PROMPT, max_new_tokens=100)
  (want, ids), = _want(bundle, [PROMPT], [100])
  assert ids == result.token_ids
  raw = client.completions.with_raw_response.create(model=MODEL, prompt=PROMPT, max_tokens=100,
                                                    temperature=0)
  got = raw.parse()
  assert got.choices[0].text == want and got.object == "text_completion"
  assert got.choices[0].finish_reason == ("length" if len(result.token_ids) == 100 else "stop")
  usage = got.usage
  assert usage.completion_tokens == len(result.token_ids)
  assert usage.prompt_tokens == len(bundle.tokenizer.encode(PROMPT))
  assert usage.model_extra["rounds"] == result.stats["rounds"]
  assert usage.model_extra["acceptance_rate"] == pytest.approx(result.stats["acceptance_rate"])
  assert usage.model_extra["tokens_per_round"] == pytest.approx(
      result.stats["mean_tokens_per_round"])
  assert int(raw.headers["x-jspec-rounds"]) == result.stats["rounds"]
  assert float(raw.headers["x-jspec-acceptance-rate"]) == pytest.approx(
      result.stats["acceptance_rate"], rel=1e-5)


def test_completion_stream(want_prompt, client):
  want, ids = want_prompt
  chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                          temperature=0, stream=True,
                                          stream_options={"include_usage": True}))
  assert "".join(c.choices[0].text for c in chunks if c.choices) == want
  assert len([c for c in chunks if c.choices and c.choices[0].text]) > 1  # it streamed
  assert chunks[-2].choices[0].finish_reason is not None
  assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids)
  assert chunks[-1].usage.model_extra["rounds"] >= 1


def test_chat_stream_and_not(bundle, client):
  (want, ids), = _want(bundle, [_chat(bundle, CHAT)], [12])
  got = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
  assert got.choices[0].message.content == want and got.choices[0].message.role == "assistant"
  assert got.usage.completion_tokens == len(ids)
  chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT,
                                               max_completion_tokens=12, temperature=0,
                                               stream=True))
  assert chunks[0].choices[0].delta.role == "assistant"
  assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
  assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_stop_strings_cut_the_text(want_prompt, client):
  want, _ = want_prompt
  stop = want[4:6]
  cut = want[:want.find(stop)]
  got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                  stop=[stop, "\x00never"])
  assert got.choices[0].text == cut and got.choices[0].finish_reason == "stop"
  chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                          temperature=0, stop=stop, stream=True))
  assert "".join(c.choices[0].text for c in chunks) == cut


@pytest.mark.slow  # compiles programs of its own
def test_seeded_sampling_reproduces_generate(bundle, client):
  (want, _), = _want(bundle, [PROMPT], [100], temperature=0.8, seed=7)
  got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=100, temperature=0.8,
                                  seed=7)
  assert got.choices[0].text == want


def _ask(url, i, mode, max_tokens, start, **extra):
  """One client of the concurrency tests: its own connection, its own request."""
  client = openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=TIMEOUT_S, max_retries=0)
  kwargs = dict(model=MODEL, max_tokens=max_tokens, temperature=0, **extra)
  start.wait(10)
  if mode.startswith("chat"):
    messages = [{"role": "user", "content": f"question {i}"}]
    if mode == "chat":
      return client.chat.completions.create(messages=messages, **kwargs).choices[0].message.content
    stream = client.chat.completions.create(messages=messages, stream=True, **kwargs)
    return "".join(c.choices[0].delta.content or "" for c in stream)
  prompt = f"# task {i}\ndef solve_{i}(x):\n"
  if mode == "text":
    return client.completions.create(prompt=prompt, **kwargs).choices[0].text
  return "".join(c.choices[0].text for c in client.completions.create(prompt=prompt, stream=True,
                                                                       **kwargs))


def test_sixteen_concurrent_clients_get_their_own_answers(bundle, running, monkeypatch):
  # A batch waits up to 10 s for more clients (it starts at once when the
  # 16th arrives): all 16 run as one batch of 16, target-only (past
  # `speculate_max_batch`), whose programs the expected batch of `generate`
  # compiles, so the test compiles one shape.
  monkeypatch.setattr(running.server.scheduler, "window_s", 10.0)
  modes = ["text", "text_stream", "chat", "chat_stream"] * 4
  lengths = [6 + i for i in range(16)]  # rows of one batch end at their own lengths
  texts = [_chat(bundle, [{"role": "user", "content": f"question {i}"}]) if mode[:4] == "chat"
           else f"# task {i}\ndef solve_{i}(x):\n" for i, mode in enumerate(modes)]
  want = [text for text, _ in _want(bundle, texts, lengths, method="target")]
  assert len(set(want)) == 16  # distinct answers: a mix-up cannot pass by coincidence
  before = _health(running)["counts"]
  start = threading.Barrier(16)
  with concurrent.futures.ThreadPoolExecutor(16) as pool:
    futures = [pool.submit(_ask, running.url, i, mode, n, start)
               for i, (mode, n) in enumerate(zip(modes, lengths))]
    got = [f.result(timeout=2 * TIMEOUT_S) for f in futures]
  assert got == want
  counts = _health(running)["counts"]
  assert counts["rows"] - before["rows"] == 16
  assert counts["batches"] - before["batches"] == 1  # all of them ran together
  assert counts["finished"] - before["finished"] == 16


def _drop_after_first_chunk(url, start):
  with httpx.Client(timeout=TIMEOUT_S) as http:
    start.wait(10)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": LONG, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with http.stream("POST", url + "/v1/completions", json=body) as response:
      for line in response.iter_lines():
        if line.startswith("data: {"):
          return json.loads(line[len("data: "):])["choices"][0]["text"]
  return None


@pytest.mark.slow  # compiles programs of its own
def test_a_client_that_disconnects_mid_stream_does_not_disturb_the_others(bundle, running):
  prompts = [f"# task {i}\ndef solve_{i}(x):\n" for i in range(3)]
  # The dropped client's prompt too: a batch of four, as the server's.
  want = [t for t, _ in _want(bundle, prompts + [PROMPT], [LONG] * 4, stop_at_eos=False)][:3]
  before = _health(running)["counts"].get("abandoned", 0)
  start = threading.Barrier(4)
  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    dropped = pool.submit(_drop_after_first_chunk, running.url, start)
    futures = [pool.submit(_ask, running.url, i, "text_stream", LONG, start,
                           extra_body={"ignore_eos": True}) for i in range(3)]
    assert [f.result(timeout=2 * TIMEOUT_S) for f in futures] == want
    assert dropped.result(timeout=TIMEOUT_S)
  assert _health(running)["counts"].get("abandoned", 0) == before + 1


def _error_of(call):
  with pytest.raises(openai.BadRequestError) as err:
    call()
  assert err.value.status_code == 400
  body = err.value.body
  assert body["type"] == "invalid_request_error" and body["message"]
  return body


@pytest.mark.parametrize("kwargs,param,code", [
    (dict(model="gpt-4"), "model", "model_not_found"),
    (dict(temperature=-1), "temperature", None),
    (dict(temperature=0.0001), "temperature", None),
    (dict(top_p=0), "top_p", None),
    (dict(top_p=1.5), "top_p", None),
    (dict(max_tokens=0), "max_tokens", None),
    (dict(n=2), "n", None),
    (dict(seed=-3), "seed", None),
    (dict(logprobs=2), "logprobs", None),
    (dict(stop=["a", "b", "c", "d", "e"]), "stop", None),
    (dict(prompt="x" * 600), "prompt", "context_length_exceeded"),
    (dict(max_tokens=500), "max_tokens", "context_length_exceeded"),
    (dict(prompt=["a", "b"]), "prompt", None),
    (dict(prompt=""), "prompt", None),
    (dict(prompt=[5, 100000]), "prompt", None),
], ids=lambda v: json.dumps(v)[:40] if isinstance(v, dict) else str(v))
def test_bad_completion_requests_get_400(client, kwargs, param, code):
  request = dict(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
  request.update(kwargs)
  body = _error_of(lambda: client.completions.create(**request))
  assert (body["param"], body["code"]) == (param, code), body


def test_bad_chat_requests_and_malformed_json_get_400(running, client):
  assert _error_of(lambda: client.chat.completions.create(
      model=MODEL, messages=[], max_tokens=4))["param"] == "messages"
  assert _error_of(lambda: client.chat.completions.create(
      model=MODEL, messages=[{"role": "user", "content": [{"type": "image_url"}]}],
      max_tokens=4))["param"] == "messages"
  assert _error_of(lambda: client.chat.completions.create(
      model=MODEL, messages=CHAT, max_tokens=4, top_p=-1))["param"] == "top_p"
  for raw in (b"{not json", b"[1, 2]", b"\xff\xfe"):
    response = httpx.post(running.url + "/v1/completions", content=raw, timeout=10,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
  response = httpx.get(running.url + "/v1/nothing", timeout=10)
  assert response.status_code == 404 and "error" in response.json()


def _job(ids):
  return batching.Job(ids, jspec.Options(), post=lambda event: None)


def test_the_queue_is_bounded(bundle):
  sched = batching.Scheduler(bundle, max_queue=2)  # not started: nothing leaves the queue
  events = []
  for _ in range(2):
    sched.submit(batching.Job([1, 2], jspec.Options(), post=events.append))
  with pytest.raises(batching.QueueFull, match="2 requests are waiting"):
    sched.submit(_job([1, 2]))
  assert sched.stop()
  assert [type(e) for e in events] == [batching.Failed] * 2 and events[0].status == 503
  with pytest.raises(batching.ShuttingDown):
    sched.submit(_job([1, 2]))


def test_a_full_queue_answers_429_and_the_waiting_requests_complete(bundle, want_prompt,
                                                                    monkeypatch):
  want, _ = want_prompt
  server = serve.Server(bundle, MODEL, max_batch=1, max_queue=2, batch_window_s=0.0)
  start = server.scheduler.start
  # Held: the scheduler thread starts only when the test says, so requests
  # stay in the queue until then.
  monkeypatch.setattr(server.scheduler, "start", lambda: None)
  run = serve.Background(server)
  client = openai.OpenAI(base_url=run.url + "/v1", api_key="x", timeout=TIMEOUT_S,
                         max_retries=0)
  request = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
  try:
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
      waiting = [pool.submit(lambda: client.completions.create(**request).choices[0].text)
                 for _ in range(2)]
      deadline = time.monotonic() + TIMEOUT_S
      while server.scheduler.pending() < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
      assert server.scheduler.pending() == 2
      for stream in (False, True):
        with pytest.raises(openai.RateLimitError) as err:
          client.with_options(timeout=10).completions.create(**request, stream=stream)
        assert err.value.status_code == 429 and err.value.response.headers["retry-after"]
        body = err.value.body
        assert body["type"] == "rate_limit_error" and body["code"] == "queue_full"
        assert "retry later" in body["message"]
      start()
      assert [f.result(timeout=2 * TIMEOUT_S) for f in waiting] == [want] * 2
    assert server.scheduler.counts["rejected"] == 2
    assert server.scheduler.counts["finished"] == 2
  finally:
    assert run.stop()


def test_batches_past_speculate_max_batch_decode_with_the_target_alone(bundle):
  scheduler = batching.Scheduler(bundle, speculate_max_batch=2)
  opts = jspec.Options(policy="fixed", gamma=3)
  assert scheduler._method_for(1, opts) is opts and scheduler._method_for(2, opts) is opts
  alone = scheduler._method_for(3, opts)
  assert alone.method == "target" and alone.gammas() == (0, 0)
  default = batching.Scheduler(bundle)  # 2: a batch of 2 speculates, of 3 not
  assert default._method_for(2, opts) is opts and default._method_for(3, opts).method == "target"
  assert batching.Scheduler(bundle, speculate_max_batch=0)._method_for(1, opts).method == "target"
  with pytest.raises(ValueError, match="speculate_max_batch=-1"):
    batching.Scheduler(bundle, speculate_max_batch=-1)


def test_shutdown_is_clean(bundle):
  run = Running(bundle, max_batch=2)
  assert run.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=3,
                                         temperature=0).choices[0].text is not None
  scheduler = run.server.scheduler
  assert run.stop()
  assert scheduler._thread is not None and not scheduler._thread.is_alive()
  with pytest.raises(batching.ShuttingDown):
    scheduler.submit(_job([1, 2]))
  with pytest.raises(httpx.ConnectError):
    httpx.get(run.url + "/health", timeout=5)


@pytest.mark.slow  # compiles programs of its own
def test_jspec_serve_stops_cleanly_on_ctrl_c(pair):
  target, draft = pair
  child = subprocess.Popen(
      [sys.executable, "-c", "import sys; from jspec import cli; sys.exit(cli.main())", "serve",
       "--target", str(target), "--draft-model", str(draft), "--port", "0", "--max-batch", "2"],
      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=os.environ.copy())
  try:
    port = None
    lines = []
    deadline = time.monotonic() + 120
    while port is None and time.monotonic() < deadline:
      line = child.stderr.readline()
      if not line:
        break
      lines.append(line)
      found = re.search(r"running on http://127\.0\.0\.1:(\d+)", line)
      port = int(found.group(1)) if found else None
    assert port, "".join(lines)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                           timeout=TIMEOUT_S, max_retries=0)
    name = target.name  # the target directory's name is the model's id
    assert client.completions.create(model=name, prompt=PROMPT, max_tokens=3,
                                     temperature=0).usage.completion_tokens >= 1
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=60)
  finally:
    if child.poll() is None:
      child.kill()
      child.communicate(timeout=10)
  err = "".join(lines) + err
  assert child.returncode == 130, err
  assert "Traceback" not in err and "jspec: interrupted" in err


def test_serve_without_the_web_stack_is_a_one_line_error(monkeypatch, capsys):
  monkeypatch.setitem(sys.modules, "uvicorn", None)  # import uvicorn raises ImportError
  monkeypatch.delitem(sys.modules, "jspec.serve")
  monkeypatch.delattr(jspec, "serve")  # else `from jspec import serve` finds the attribute
  assert jspec.cli.main(["serve", "--port", "0"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "'uvicorn'" in err and ".[serve]" in err


def test_text_stream_waits_for_whole_characters_and_possible_stop_strings(bundle):
  tok = bundle.tokenizer
  ids = tok.encode("xé")  # one id per byte: "é" is two
  assert len(ids) == 3
  text = batching.TextStream(tok, tok.eos_token_ids)
  assert [text.update(ids[:2], False), text.update(ids, False)] == ["x", "é"]
  stop = batching.TextStream(tok, tok.eos_token_ids, stop=("ab", "zzz"))
  steps = [stop.update(tok.encode(s), False) for s in ("xa", "xac", "xacz", "xaczab", "xaczabq")]
  assert steps == ["x", "ac", "", "z", ""] and stop.stopped
  eos = tok.eos_token_ids[0]
  done = batching.TextStream(tok, tok.eos_token_ids)
  assert done.update(tok.encode("hi") + [eos], True) == "hi"  # a final EOS is not text


def test_a_failed_batch_fails_its_requests_and_the_server_goes_on(client, monkeypatch):
  real = batching.api.request
  calls = []

  def failing(*args):
    calls.append(1)
    if len(calls) <= 2:
      raise RuntimeError("device on fire")
    return real(*args)

  monkeypatch.setattr(batching.api, "request", failing)
  with pytest.raises(openai.InternalServerError, match="device on fire"):
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
  with pytest.raises(openai.APIError, match="device on fire"):
    list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                   stream=True))
  got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
  assert got.usage.completion_tokens >= 1 and len(calls) == 3
