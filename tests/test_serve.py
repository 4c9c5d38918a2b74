"""The OpenAI-compatible server, started on 127.0.0.1 by the test, reached by the real `openai`
client: streaming and not, errors, remembered exchanges seen by the next request, the key."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import time
import urllib.request

import openai
import pytest

import emllm

from emllm.errors import UsageError
from emllm.store import Store

from .helpers import EMLLM, cli_env, ingest_store, load_tiny, store_files, words


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stream(path) -> list[int]:
    with Store.open(path) as st:
        job = st.manifest["job"]
        return st.tokens.read().tolist() + st.job.read(job["done"], job["tokens"]).tolist()


@contextlib.contextmanager
def _serve(home, folder, prof, *extra: str, env: dict | None = None):
    """`emllm serve` on a free port of 127.0.0.1 over the stores under `home` (`-m folder`, or no
    model named where folder is None): its URL, the server stopped when the block ends (a failing
    assertion included)."""
    port = _port()
    env = {**os.environ, **cli_env(home), **(env or {})}
    named = ["-m", str(folder), "--profile", str(prof)] if folder is not None else []
    proc = subprocess.Popen([EMLLM, "serve", "--port", str(port), *named, "--max-tokens", "64", *extra], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_until_up(proc, url)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _wait_until_up(proc: subprocess.Popen, url: str) -> None:
    """Until the server at `url` answers /health (its stderr raised if it exits first)."""
    for _ in range(600):
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if json.loads(r.read())["status"] == "ok":
                    return
        except OSError:
            if proc.poll() is not None:
                raise AssertionError(proc.stderr.read())
            time.sleep(0.1)


@pytest.fixture
def server(tiny, tmp_path):
    folder, prof, _, _ = tiny
    ingest_store(tmp_path / "stores" / "book", folder, prof, [("doc", words(6, 300))])
    with _serve(tmp_path, folder, prof) as url:
        yield url, tmp_path


def test_serve_reread_sets_the_default_a_request_can_override(tiny, tmp_path):
    """`emllm serve --reread`: a request that does not say is answered re-read (its passages in
    the response), one with "reread": false by emllm's own reading."""
    from emllm.app.ask import Session

    folder, prof, _, _ = tiny
    ingest_store(tmp_path / "stores" / "book", folder, prof, [("doc", "The pass key is 71432. " + words(6, 300))])
    model, tok = load_tiny(folder)
    with Store.open(tmp_path / "stores" / "book") as st:
        rs = Session(st, model, tok, reread=True)
        reread = "".join(rs.answer_text("what is the pass key?", 5)).strip()
        own = "".join(Session(st, model, tok).answer_text("what is the pass key?", 5)).strip()
    with _serve(tmp_path, folder, prof, "--reread") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        ask = lambda **kw: client.chat.completions.create(  # noqa: E731
            model="book", messages=[{"role": "user", "content": "what is the pass key?"}], max_tokens=5, temperature=0, **kw)
        r = ask()
        assert r.choices[0].message.content == reread
        assert r.model_extra["emllm"]["reread"]["passages"] == [list(p) for p in rs.passages]
        r = ask(extra_body={"reread": False})
        assert r.choices[0].message.content == own and r.model_extra.get("emllm") is None


@pytest.mark.slow
def test_chat_completions_through_the_openai_client(server, tiny):
    url, home = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == ["book"]
    assert client.models.retrieve("book").id == "book"
    with pytest.raises(openai.NotFoundError, match="no store 'nope'"):
        client.models.retrieve("nope")
    before = store_files(home / "stores" / "book")
    r = client.chat.completions.create(model="book", messages=[{"role": "user", "content": "who hid the key?"}],
                                       max_tokens=5, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens <= 5 and r.choices[0].finish_reason in ("stop", "length")
    again = client.chat.completions.create(model="book", messages=[{"role": "user", "content": "who hid the key?"}],
                                           max_tokens=5, temperature=0)
    assert again.choices[0].message.content == r.choices[0].message.content  # greedy: the same
    model, tok = load_tiny(tiny[0])  # and what `ask` answers (the server restores a kept snapshot per request)
    with Store.open(home / "stores" / "book") as st:
        from emllm.app.ask import Session

        assert "".join(Session(st, model, tok).answer_text("who hid the key?", 5)).strip() == r.choices[0].message.content
        other = "".join(Session(st, model, tok).answer_text("and the door?", 5)).strip()
        rs = Session(st, model, tok, reread=True)
        reread = "".join(rs.answer_text("and the door?", 5)).strip()
        assert rs.passages and sum(e - s for s, e in rs.passages) < st.tokens.rows  # passages, not the whole stream
    assert client.chat.completions.create(model="book", messages=[{"role": "user", "content": "and the door?"}],
                                          max_tokens=5, temperature=0).choices[0].message.content == other
    rr = client.chat.completions.create(model="book", messages=[{"role": "user", "content": "and the door?"}], max_tokens=5,
                                        temperature=0, extra_body={"reread": True})
    assert rr.choices[0].message.content == reread and rr.model_extra["emllm"]["reread"]["passages"] == [list(p) for p in rs.passages]
    assert client.chat.completions.create(model="book", messages=[{"role": "user", "content": "and the door?"}],
                                          max_tokens=5, temperature=0).model_extra.get("emllm") is None  # not kept
    chunks = list(client.chat.completions.create(model="book", messages=[{"role": "user", "content": "who hid the key?"}],
                                                 max_tokens=5, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks).strip() == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    with_usage = list(client.chat.completions.create(model="book", messages=[{"role": "user", "content": "who hid the key?"}],
                                                     max_tokens=5, temperature=0, stream=True,
                                                     stream_options={"include_usage": True}))
    assert with_usage[-1].choices == [] and with_usage[-1].usage.model_dump(include={"prompt_tokens", "completion_tokens"}) == \
        r.usage.model_dump(include={"prompt_tokens", "completion_tokens"})  # (the stream ended without it)
    assert all(c.usage is None for c in with_usage[:-1]) and all(c.usage is None for c in chunks)
    sampled = [client.chat.completions.create(model="book", messages=[{"role": "user", "content": "who hid the key?"}],
                                              max_tokens=5, temperature=1.0, seed=4,
                                              extra_body={"top_k": 20, "repetition_penalty": 1.2}).choices[0].message.content
               for _ in range(2)]
    assert sampled[0] == sampled[1]  # a seed: the same answer
    penalised = client.chat.completions.create(model="book", messages=[{"role": "user", "content": "who hid the key?"}],
                                               max_tokens=5, temperature=0, frequency_penalty=2, presence_penalty=2)
    with Store.open(home / "stores" / "book") as st:  # as the library answers with them
        from emllm.app.ask import Session
        from emllm.engine.sampling import Sampling

        want = Session(st, model, tok).answer_text("who hid the key?", 5, Sampling(frequency_penalty=2, presence_penalty=2))
        assert penalised.choices[0].message.content == "".join(want).strip()
    with pytest.raises(openai.BadRequestError, match="frequency_penalty"):
        client.chat.completions.create(model="book", messages=[{"role": "user", "content": "x"}], frequency_penalty=2.5)
    with pytest.raises(openai.BadRequestError, match="repetition_penalty"):
        client.chat.completions.create(model="book", messages=[{"role": "user", "content": "x"}],
                                       extra_body={"repetition_penalty": -1})
    for seed in (-1, 2**64, 2**70, 10**40):  # what the sampler cannot take: a 4xx, not a 500
        with pytest.raises(openai.BadRequestError, match="seed"):
            client.chat.completions.create(model="book", messages=[{"role": "user", "content": "x"}], seed=seed)
    assert store_files(home / "stores" / "book") == before  # not remembered: unchanged
    # errors: OpenAI-style bodies, 4xx
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert "no store 'nope'" in e.value.body["message"]
    for bad in ("../book", "/etc"):
        with pytest.raises(openai.BadRequestError, match="not a store name"):
            client.chat.completions.create(model=bad, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model="book", messages=[{"role": "user", "content": "x"}], max_tokens=100000)
    with pytest.raises(openai.BadRequestError, match="one choice a request"):
        client.chat.completions.create(model="book", messages=[{"role": "user", "content": "x"}], n=2)
    for field, value in (("tools", [{"type": "function", "function": {"name": "f"}}]),
                         ("response_format", {"type": "json_object"})):  # refused, not ignored
        with pytest.raises(openai.BadRequestError, match=f"{field.split('_')[-1]}: emllm does not support it"):
            client.chat.completions.create(model="book", messages=[{"role": "user", "content": "x"}], **{field: value})
    assert client.chat.completions.create(model="book", messages=[{"role": "user", "content": "who hid the key?"}],
                                          max_tokens=5, temperature=0, logprobs=False, response_format={"type": "text"},
                                          ).choices[0].message.content == r.choices[0].message.content
    # log probabilities: the library's, in OpenAI's form, streamed or not
    lp = client.chat.completions.create(model="book", messages=[{"role": "user", "content": "who hid the key?"}],
                                        max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    assert lp.choices[0].message.content == r.choices[0].message.content
    with emllm.open(home / "stores" / "book") as mem:
        ref = mem.answer("who hid the key?", 5, reread=False, top_logprobs=3)
        assert ref.text == r.choices[0].message.content
    got = lp.choices[0].logprobs.content
    assert [(x.token, x.logprob) for x in got] == [(tok.decode([e.token]), e.logprob) for e in ref.logprobs]
    assert [[(y.token, y.logprob) for y in x.top_logprobs] for x in got] == \
        [[(tok.decode([t]), v) for t, v in e.top] for e in ref.logprobs]
    assert all(x.bytes == list(x.token.encode()) for x in got)
    streamed = list(client.chat.completions.create(model="book", messages=[{"role": "user", "content": "who hid the key?"}],
                                                   max_tokens=5, temperature=0, logprobs=True, top_logprobs=3, stream=True))
    assert [x.model_dump() for c in streamed if c.choices[0].logprobs for x in c.choices[0].logprobs.content] == \
        [x.model_dump() for x in got]
    assert r.choices[0].logprobs is None  # (not asked)
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
        client.chat.completions.create(model="book", messages=[{"role": "user", "content": "x"}], top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model="book", messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=21)
    with pytest.raises(openai.BadRequestError, match="part of type 'image_url'"):
        client.chat.completions.create(model="book", messages=[{"role": "user", "content": [
            {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}])
    with pytest.raises(openai.BadRequestError, match="last message"):
        client.chat.completions.create(model="book", messages=[{"role": "assistant", "content": "x"}])
    req = urllib.request.Request(url + "/v1/chat/completions", data=b"{not json", headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as h:
        urllib.request.urlopen(req)
    assert h.value.code == 400 and json.loads(h.value.read())["error"]["message"].startswith(
        "the request body is not valid JSON: ")
    # `curl -d '{...}'` (the --help's example) labels its JSON a form: read as JSON all the same
    body = json.dumps({"model": "book", "messages": [{"role": "user", "content": "who hid the key?"}],
                       "max_tokens": 5, "temperature": 0}).encode()
    for headers in ({}, {"Content-Type": "text/plain"}):  # (urllib's default: application/x-www-form-urlencoded)
        with urllib.request.urlopen(urllib.request.Request(url + "/v1/chat/completions", data=body, headers=headers)) as resp:
            assert json.loads(resp.read())["choices"][0]["message"]["content"] == r.choices[0].message.content
    nulls = json.dumps({"model": "book", "messages": [{"role": "user", "content": "who hid the key?"}], "max_tokens": 5,
                        "temperature": 0, **dict.fromkeys(("stream", "stream_options", "n", "logprobs", "top_logprobs",
                                                            "remember", "reread", "stop", "seed", "tools"))}).encode()
    with urllib.request.urlopen(urllib.request.Request(url + "/v1/chat/completions", data=nulls)) as resp:  # null: unset
        assert json.loads(resp.read())["choices"][0]["message"]["content"] == r.choices[0].message.content
    with pytest.raises(urllib.error.HTTPError) as h:
        urllib.request.urlopen(urllib.request.Request(url + "/v1/chat/completions", data=b"[1]"))
    assert h.value.code == 400 and json.loads(h.value.read())["error"]["message"] == "the request body: Input should be an object"
    with pytest.raises(openai.NotFoundError, match=r"no such endpoint: POST /v1/embeddings \(emllm serves"):
        client.embeddings.create(model="book", input="x")  # (not served: OpenAI's error body all the same)
    req = urllib.request.Request(url + "/v1/models", data=b"{}", headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as h:
        urllib.request.urlopen(req)
    assert h.value.code == 405 and json.loads(h.value.read())["error"]["message"].startswith("/v1/models does not take POST")
    # A body over the limit is refused from its Content-Length, before it is read: the answer comes
    # while the client could still be sending (whether the server then waits for the rest or
    # closes is the HTTP stack's choice; a client writing 2 MiB into a closed socket gets EPIPE).
    import http.client
    from urllib.parse import urlsplit

    conn = http.client.HTTPConnection(urlsplit(url).hostname, urlsplit(url).port, timeout=30)
    conn.putrequest("POST", "/v1/chat/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(2 << 20))
    conn.endheaders()
    conn.send(b"x" * 1024)
    resp = conn.getresponse()
    assert resp.status == 413 and "larger than" in json.loads(resp.read())["error"]["message"]
    conn.close()
    # and one sent in chunks, with no length to check first, as it is read
    conn = http.client.HTTPConnection(urlsplit(url).hostname, urlsplit(url).port, timeout=30)
    conn.request("POST", "/v1/chat/completions", body=iter([b"{" + b" " * (1 << 16)] * 40), encode_chunked=True,
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 413 and json.loads(resp.read())["error"]["message"] == (
        "the request body is larger than 1048576 bytes")
    conn.close()
    assert store_files(home / "stores" / "book") == before


def test_completions_through_the_openai_client(server, tiny):
    """POST /v1/completions: the prompt continues the store's stream as it is, the completion
    the library's (`Memory.complete`), streamed or not; logprobs in the completions API's form,
    echo with the prompt scored; one prompt a request, as text or token ids; remember appends."""
    url, home = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    _, tok = load_tiny(tiny[0])
    path = home / "stores" / "book"
    before = store_files(path)
    with emllm.open(path) as mem:
        ref = mem.complete(" and then the key", 6, top_logprobs=2, echo=True)
        text = ref.text
        prompt_ids = [x.token for x in ref.prompt_logprobs]
        echo, gen = list(ref.prompt_logprobs), list(ref.logprobs)
    r = client.completions.create(model="book", prompt=" and then the key", max_tokens=6, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text == text and r.choices[0].logprobs is None
    assert r.choices[0].finish_reason == "length" and (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt_ids), 6)
    assert client.completions.create(model="book", prompt=prompt_ids, max_tokens=6, temperature=0).choices[0].text == text
    assert client.completions.create(model="book", prompt=[prompt_ids], max_tokens=6, temperature=0).choices[0].text == text
    streamed = list(client.completions.create(model="book", prompt=" and then the key", max_tokens=6, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in streamed[:-1]) == text and streamed[-2].choices[0].finish_reason == "length"
    assert streamed[-1].choices == [] and streamed[-1].usage.completion_tokens == 6
    # logprobs: tokens, their log probabilities, the alternatives (the chosen token's among them), offsets
    lp = client.completions.create(model="book", prompt=" and then the key", max_tokens=6, temperature=0, logprobs=2,
                                   echo=True).choices[0]
    assert lp.text == " and then the key" + text
    names = [tok.decode([x.token]) for x in echo + gen]
    assert lp.logprobs.tokens == names
    assert lp.logprobs.token_logprobs == [x.logprob for x in echo + gen]
    assert lp.logprobs.top_logprobs == [{**{tok.decode([t]): v for t, v in x.top}, tok.decode([x.token]): x.logprob}
                                        for x in echo + gen]
    assert lp.logprobs.text_offset == [sum(map(len, names[:i])) for i in range(len(names))]
    assert "".join(names) == lp.text  # (this tokenizer's pieces join to the text)
    chunks = list(client.completions.create(model="book", prompt=" and then the key", max_tokens=6, temperature=0,
                                            logprobs=2, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == lp.text
    assert [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == names
    assert [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.text_offset] == lp.logprobs.text_offset
    scored = client.completions.create(model="book", prompt=prompt_ids, max_tokens=0, logprobs=0, echo=True).choices[0]
    assert scored.text == " and then the key" and scored.logprobs.token_logprobs == [x.logprob for x in echo]
    assert client.completions.create(model="book", prompt="x", max_tokens=1, echo=True).choices[0].text.startswith("x")
    # logit_bias: +100 forces a token, -100 bans the greedy one (both endpoints)
    forced = client.completions.create(model="book", prompt=" and then the key", max_tokens=3, temperature=0, logprobs=0,
                                       logit_bias={str(prompt_ids[0]): 100}).choices[0]
    assert forced.logprobs.tokens == [tok.decode([prompt_ids[0]])] * 3
    banned = client.completions.create(model="book", prompt=" and then the key", max_tokens=1, temperature=0, logprobs=0,
                                       logit_bias={str(gen[0].token): -100}).choices[0]
    assert banned.logprobs.tokens != [tok.decode([gen[0].token])]
    chat = client.chat.completions.create(model="book", messages=[{"role": "user", "content": "who?"}], max_tokens=2,
                                          temperature=0, logprobs=True, logit_bias={str(prompt_ids[0]): 100})
    assert [x.token for x in chat.choices[0].logprobs.content] == [tok.decode([prompt_ids[0]])] * 2
    for bias, why in (({"x": 1}, "'x' is not a token id"), ({"9" * 5000: 1}, "is not a token id"),
                      ({"5": 101}, "a bias must lie in"), ({str(10**7): 1}, "outside the model's vocabulary")):
        with pytest.raises(openai.BadRequestError, match=why):
            client.completions.create(model="book", prompt="x", logit_bias=bias)
    for kw, why in ((dict(prompt=["a", "b"]), "2 prompts: emllm completes one prompt a request"),
                    (dict(prompt=""), "the prompt is empty"), (dict(prompt=[10**7]), "outside the model's vocabulary"),
                    (dict(prompt=[True, 5]), "prompt: text, or token ids"), (dict(prompt=[1.0]), "prompt: text, or token ids"),
                    (dict(prompt="x", n=2), "one choice"), (dict(prompt="x", best_of=2), "best_of"),
                    (dict(prompt="x", suffix="y"), "suffix: emllm does not insert"),
                    (dict(prompt="x", max_tokens=10**5), "max_tokens"), (dict(prompt="x", logprobs=21), "logprobs"),
                    (dict(prompt="x", extra_body={"reread": True}), "reread")):
        with pytest.raises(openai.BadRequestError, match=why):
            client.completions.create(model="book", **kw)
    assert store_files(path) == before  # not remembered: unchanged
    old = _stream(path)
    kept = client.completions.create(model="book", prompt=" and then the key", max_tokens=6, temperature=0,
                                     extra_body={"remember": True}).choices[0].text
    assert kept == text and _stream(path) == old + prompt_ids + [x.token for x in gen]


@pytest.mark.slow
def test_a_remembered_exchange_is_seen_by_the_next_request(server, tiny):
    url, home = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    n = len(_stream(home / "stores" / "book"))
    client.chat.completions.create(model="book", messages=[{"role": "user", "content": "my name is Ada"}], max_tokens=4,
                                   extra_body={"remember": True})
    _, tok = load_tiny(tiny[0])
    stream = _stream(home / "stores" / "book")
    assert len(stream) > n and "my name is Ada" in tok.decode(stream[n:])
    # the next request reads the store as it is now: a store held open is reopened after the commit
    r = client.chat.completions.create(model="book", messages=[{"role": "user", "content": "what is my name?"}],
                                       max_tokens=4, extra_body={"remember": True})
    assert r.choices[0].message.role == "assistant"
    assert "what is my name?" in tok.decode(_stream(home / "stores" / "book")[len(stream):])


def test_binding_beyond_loopback_needs_a_key_and_the_key_is_checked(tiny, tmp_path):
    folder, prof, _, _ = tiny
    from .helpers import run

    r = run("serve", "--host", "0.0.0.0", "-m", str(folder), home=tmp_path)
    assert r.returncode == 1 and "give --api-key" in r.stderr
    ingest_store(tmp_path / "stores" / "book", folder, prof, [("doc", words(6, 100))])
    port = _port()
    env = {**os.environ, **cli_env(tmp_path, EMLLM_API_KEY="s3cret")}
    proc = subprocess.Popen([EMLLM, "serve", "--port", str(port), "-m", str(folder), "--profile", str(prof)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _wait_until_up(proc, f"http://127.0.0.1:{port}")
        bad = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="s3cret", max_retries=0)
        assert [m.id for m in good.models.list()] == ["book"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_requests_earlier_turns_are_laid_out_as_the_chat_template_lays_them_out(tiny, tmp_path):
    """A request's messages (user, assistant, user) on an empty store continue the stream exactly
    as `apply_chat_template` writes the conversation, each user message opening its turn with no
    separator, as a remembered conversation lays them out (unit: `messages_ids`, no server)."""
    from emllm.app.ask import Session
    from emllm.app.stream import create_store
    from emllm.config import load_profile_file
    from emllm.app.conversation import messages_ids

    folder, prof, _, _ = tiny
    model, tok = load_tiny(folder)
    with create_store(tmp_path / "empty", "tiny", model, tok, load_profile_file(prof)) as st:
        st.publish_empty()
    turns = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "Hi. Who are you?"},
             {"role": "user", "content": "my name is Ada"}]
    with Store.open(tmp_path / "empty") as st:
        s = Session(st, model, tok)
        ids, question = messages_ids(s, turns)
        requested = tok.decode(s.lead + ids + s.question_ids(question))
    assert requested == tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    # text parts read as the text; what emllm cannot read is refused, not left out of the question
    with Store.open(tmp_path / "empty") as st:
        parts = [{"type": "text", "text": "my name "}, {"type": "text", "text": "is Ada"}]
        assert messages_ids(Session(st, model, tok), turns[:2] + [{"role": "user", "content": parts}]) == (ids, question)
        for bad, why in (([{"type": "image_url", "image_url": {"url": "http://x"}}], "part of type 'image_url'"),
                         (parts + [{"type": "input_audio"}], "part of type 'input_audio'"),
                         ([{"type": "text"}], "part of type 'text'"), ([], "question, is empty"),
                         (None, "question, is empty"), ("  ", "question, is empty")):
            with pytest.raises(UsageError, match=why):
                messages_ids(Session(st, model, tok), [{"role": "user", "content": bad}])
        for role in ("tool", "function", "bogus"):
            with pytest.raises(UsageError, match=f"role '{role}'"):
                messages_ids(Session(st, model, tok), [{"role": role, "content": "42"}, turns[0]])


def _health(url: str) -> dict:
    with urllib.request.urlopen(url + "/health", timeout=5) as r:
        return json.loads(r.read())


def test_a_store_of_another_model_is_answered_by_loading_that_model(tiny, tmp_path):
    """Each store is answered by its own model: a request for a store of a model not loaded loads
    it (one model loaded: the other is unloaded), answers as that model answers, and the store is
    left as it was; a store whose model cannot be found is a 400 that names it, and unloads nothing."""
    import shutil

    from emllm.app.ask import Session

    folder, prof, other, other_tok = tiny
    ingest_store(tmp_path / "stores" / "book", folder, prof, [("doc", words(6, 100))])
    ingest_store(tmp_path / "stores" / "theirs", other, prof, [("doc", "The pass key is 71432. " + words(7, 100))])
    gone = tmp_path / "gone-model"  # (neither loaded model's weights and tokenizer)
    shutil.copytree(other_tok, gone)
    ingest_store(tmp_path / "stores" / "orphan", gone, prof, [("doc", words(8, 40))])
    shutil.rmtree(gone)
    before = store_files(tmp_path / "stores" / "theirs")
    model, tok = load_tiny(other)
    with Store.open(tmp_path / "stores" / "theirs") as st:
        expected = "".join(Session(st, model, tok).answer_text("what is the pass key?", 8)).strip()
    with _serve(tmp_path, folder, prof) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        assert _health(url)["models"] == [str(folder)]
        ask = lambda store: client.chat.completions.create(  # noqa: E731
            model=store, messages=[{"role": "user", "content": "what is the pass key?"}], max_tokens=8, temperature=0)
        assert ask("theirs").choices[0].message.content == expected
        assert _health(url)["models"] == [str(other)]
        with pytest.raises(openai.BadRequestError) as e:
            ask("orphan")
        assert str(gone) in e.value.body["message"], e.value.body
        assert _health(url)["models"] == [str(other)]
        assert ask("book").choices[0].finish_reason in ("stop", "length")
        assert _health(url)["models"] == [str(folder)]
    assert store_files(tmp_path / "stores" / "theirs") == before


def test_with_no_model_named_the_newest_stores_model_is_loaded_at_start(tiny, tmp_path, monkeypatch):
    """`emllm serve` with no model named (no -m, no EMLLM_MODEL) loads the model of the store
    written last, not the default model, and answers it without loading again; where that store's
    model cannot be found it says so in a line and the default model is loaded instead (checked in
    process, without loading it)."""
    import shutil

    from emllm import ModelPool
    from emllm_cli.serve import _warm_newest_store

    folder, prof, other, other_tok = tiny
    ingest_store(tmp_path / "stores" / "book", folder, prof, [("doc", words(6, 100))])
    ingest_store(tmp_path / "stores" / "theirs", other, prof, [("doc", "The pass key is 71432. " + words(7, 100))])
    with _serve(tmp_path, None, None, env={"EMLLM_MODEL": ""}) as url:  # (the tests' default unset)
        assert _health(url)["models"] == [str(other)]
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(model="theirs", messages=[{"role": "user", "content": "what is the pass key?"}],
                                           max_tokens=4, temperature=0)
        assert r.choices[0].finish_reason in ("stop", "length") and _health(url)["models"] == [str(other)]
    gone = tmp_path / "gone-model"
    shutil.copytree(other_tok, gone)
    ingest_store(tmp_path / "stores" / "orphan", gone, prof, [("doc", words(8, 40))])
    shutil.rmtree(gone)
    for k, v in cli_env(tmp_path, EMLLM_MODEL="").items():
        monkeypatch.setenv(k, v)
    said: list[str] = []
    pool = ModelPool(1, said.append)
    assert not _warm_newest_store(pool, said.append) and pool.models == []
    assert len(said) == 1 and said[0].startswith("store orphan: ") and str(gone) in said[0] and said[0].endswith(
        "; loading qwen2.5-coder-0.5b"), said


def test_a_stream_its_client_leaves_lets_the_next_request_be_answered(server):
    """A client that leaves a stream after its first chunk: the answer stops and the store's turn
    is let go, so the next request is answered (it waited for the garbage collector before)."""
    import http.client
    from urllib.parse import urlsplit

    url, home = server
    where = urlsplit(url)
    before = store_files(home / "stores" / "book")
    body = {"model": "book", "stream": True, "max_tokens": 64, "messages": [{"role": "user", "content": "tell me all"}]}
    for _ in range(3):
        conn = http.client.HTTPConnection(where.hostname, where.port, timeout=60)
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data: ")
        conn.close()  # (gone after the first chunk)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    r = client.chat.completions.create(model="book", messages=[{"role": "user", "content": "who hid the key?"}], max_tokens=3)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert store_files(home / "stores" / "book") == before


class _SlowAnswer:
    """An answer of many pieces, each a moment apart, counting those made (`Memory.reply`'s stand-in)."""

    made = 0

    def __init__(self, *_a, **_k) -> None:
        self.finish_reason, self.tokens, self.prompt_tokens, self.reread, self.passages = "length", 0, 1, False, []
        self.logprobs = None

    def cancel(self) -> None:  # (the server's, when the response ends: the answer stops at its next piece)
        pass

    def __iter__(self):
        for _ in range(2000):
            time.sleep(0.01)
            type(self).made += 1
            self.tokens += 1
            yield " word"


@contextlib.contextmanager
def _in_process(tiny, tmp_path, monkeypatch, slow: bool = True):
    """A server in this process over a store "book" whose answers are `_SlowAnswer`s (slow: else
    the library's): its URL."""
    import threading

    import uvicorn

    import emllm
    from emllm.serve.api import Server, create_app

    folder, prof, _, _ = tiny
    ingest_store(tmp_path / "stores" / "book", folder, prof, [("doc", words(6, 60))])
    pool = emllm.ModelPool(1)
    port = _port()
    srv = uvicorn.Server(uvicorn.Config(create_app(Server(tmp_path / "stores", pool, max_tokens=4096)), host="127.0.0.1",
                                        port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        while not srv.started:
            time.sleep(0.05)
        pool.memory(tmp_path / "stores" / "book")  # (its model loaded before the stand-in answers)
        if slow:
            monkeypatch.setattr(emllm.Memory, "reply", _SlowAnswer)
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(30)


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_stops_when_its_client_leaves(tiny, tmp_path, monkeypatch, stream):
    """A client that gives up on an answer, streamed or not: the answer stops at the next piece
    and the store's turn goes to the next request (an answer of 2,000 pieces, counted, stands in
    for a long generation; the server runs in this process)."""
    with _in_process(tiny, tmp_path, monkeypatch) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        ask = lambda **k: client.chat.completions.create(  # noqa: E731
            model="book", messages=[{"role": "user", "content": "tell me all"}], max_tokens=4000, **k)
        if stream:
            with ask(stream=True) as chunks:
                next(iter(chunks))  # (the first chunk, then gone)
        else:
            with pytest.raises(openai.APITimeoutError):
                ask(timeout=0.5)
        _SlowAnswer.made = 0
        monkeypatch.setattr(_SlowAnswer, "__iter__", lambda self: iter([" done"]))
        assert ask().choices[0].message.content == "done"  # (answered once the other answer let the turn go)
        assert _SlowAnswer.made < 1000, _SlowAnswer.made  # the abandoned answer stopped: 2,000 pieces were asked of it


@pytest.mark.parametrize("stream", [False, True])
def test_a_long_prompt_stops_being_read_when_its_client_leaves(tiny, tmp_path, monkeypatch, stream):
    """A client that gives up while its long prompt is still read (before any token: a stream
    has not even had its headers): the reading stops at the next chunk and the store's turn goes
    to the next request. Each chunk's step made a moment longer and counted; 500 chunks asked."""
    from emllm.engine.stream import Engine

    steps = {"n": 0}
    step = Engine.step

    def counted(self, *a, **k):
        steps["n"] += 1
        time.sleep(0.01)
        return step(self, *a, **k)

    with _in_process(tiny, tmp_path, monkeypatch, slow=False) as url:
        monkeypatch.setattr(Engine, "step", counted)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        prompt = [5 + i % 50 for i in range(4000)]  # (500 chunks of the tiny profile's 8)
        with pytest.raises(openai.APITimeoutError):
            client.completions.create(model="book", prompt=prompt, max_tokens=1, stream=stream, timeout=0.5)
        while steps["n"] == 0:  # (the answer held the turn)
            time.sleep(0.01)
        steps["n"] = 0
        r = client.completions.create(model="book", prompt="x", max_tokens=1)
        assert r.choices[0].finish_reason in ("stop", "length")
        assert steps["n"] < 100, steps["n"]  # the abandoned prompt stopped: it had hundreds of chunks left (the one after it: 2)


@pytest.mark.slow
def test_requests_waiting_their_turn_hold_no_worker_thread(tiny, tmp_path, monkeypatch):
    """More requests waiting for one long answer than the server has worker threads (40): /health
    and /v1/models are still answered, and the waiting ones are answered in turn."""
    import concurrent.futures

    with _in_process(tiny, tmp_path, monkeypatch) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        ask = lambda: client.chat.completions.create(  # noqa: E731
            model="book", messages=[{"role": "user", "content": "x"}], max_tokens=4000).choices[0].message.content
        _SlowAnswer.made = 0
        with concurrent.futures.ThreadPoolExecutor(48) as pool:
            long = pool.submit(ask)  # (2,000 pieces, a moment apart: the others wait their turn)
            while _SlowAnswer.made == 0:
                time.sleep(0.01)
            monkeypatch.setattr(_SlowAnswer, "__iter__", lambda self: iter([" short"]))
            waiting = [pool.submit(ask) for _ in range(45)]
            time.sleep(0.5)
            assert _health(url)["status"] == "ok" and [m.id for m in client.models.list()] == ["book"]
            assert not long.done() and all(not w.done() for w in waiting)
            assert long.result() == ("word " * 2000).strip() and [w.result() for w in waiting] == ["short"] * 45


@pytest.mark.skipif(not os.path.exists("/proc/self/limits"), reason="reads the server's limits from Linux's /proc")
def test_the_server_raises_its_soft_limit_of_open_files_to_the_hard_one(tiny, tmp_path):
    """An open store holds a few files a layer: at a soft limit of 1,024 (256 on macOS) a server
    held few stores. Every `emllm` command lifts it to the hard limit, as Go's runtime does."""
    import resource

    folder, prof, _, _ = tiny
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip("the hard limit leaves nothing to raise")
    port = _port()
    proc = subprocess.Popen([EMLLM, "serve", "--port", str(port), "-m", str(folder), "--profile", str(prof)],
                            env={**os.environ, **cli_env(tmp_path)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)))
    try:
        _wait_until_up(proc, f"http://127.0.0.1:{port}")
        line = next(x for x in open(f"/proc/{proc.pid}/limits") if x.startswith("Max open files"))
        soft = line.split()[3]
        assert soft == (str(hard) if hard != resource.RLIM_INFINITY else "65536"), line
    finally:
        proc.terminate()
        proc.wait(timeout=30)
