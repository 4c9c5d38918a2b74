"""The library's functions outside a store, called as a program calls them."""

from __future__ import annotations

import pytest

import emllm

from .helpers import words


def test_segment_takes_a_model_by_name_and_one_method_as_a_string(tiny):
    # A model's name failed ("'str' object has no attribute 'tokenizer'"), and "SM" was read as
    # the methods "S" and "M".
    folder, prof, _, _ = tiny
    text = words(11, 300)
    loaded = emllm.load(str(folder), profile=str(prof))
    want = emllm.segment(text, loaded, ["SM"])
    assert emllm.segment(text, loaded, "SM") == want
    with pytest.raises(emllm.UsageError, match="'XX': choose one of"):
        emllm.segment(text, "no-such-model-is-loaded-before-the-check", "XX")
    got = emllm.segment(text, str(folder), "F")  # by name: the profile guessed for the folder
    assert got["F"]["tokens"] == want["SM"]["tokens"] and got["F"]["events"]


def test_a_bad_dtype_is_an_error_the_user_can_fix():
    with pytest.raises(emllm.EmllmError, match="unknown dtype 'float8': use one of auto, float32, bfloat16"):
        emllm.load("smollm2", dtype="float8")  # (refused before any weights are read)


def test_opening_a_bare_name_points_to_the_homes_store_of_that_name(tiny, tmp_path, monkeypatch):
    from .helpers import ingest_store

    folder, prof, _, _ = tiny
    monkeypatch.setenv("EMLLM_HOME", str(tmp_path / "home"))
    ingest_store(emllm.store_path("book"), folder, prof, [("doc", words(11, 200))])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(emllm.StoreError, match=r"no store at book here; the store 'book' under the emllm home is "
                                               r"emllm.open\(emllm.store_path\('book'\)\)"):
        emllm.open("book")
    with pytest.raises(emllm.StoreError, match="^no store at other$"):
        emllm.open("other")
    with emllm.open(emllm.store_path("book")) as mem:
        assert mem.info.rows.tokens + mem.info.pending > 0


def test_an_answers_log_probabilities_are_the_plain_models(tiny, tmp_path):
    """Where the whole stream fits in the window emllm is the plain model (spec §1): each answer
    token's log probability and its likeliest alternatives, `Answer.logprobs`, are the log softmax
    of the plain model's logits over the stream, the question and the answer before it."""
    import torch

    from emllm.app.ask import Session
    from emllm.store import Store

    from .helpers import TOL, ingest_store, load_tiny, vanilla_logits

    folder, _, _, _ = tiny
    prof = tmp_path / "wide.yaml"
    prof.write_text("chunk_size: 16\nn_init: 4\nn_local: 256\nn_mem: 32\nmin_block: 2\nmax_block: 8\n")
    ingest_store(tmp_path / "s", folder, prof, [("doc", words(3, 40))])
    mem = emllm.open(tmp_path / "s")
    sampled = dict(temperature=1.0, seed=5)  # (the raw distribution's log probabilities all the same)
    answer = mem.answer("what is the key?", 8, reread=False, top_logprobs=4, **sampled)
    answer.text
    lp = answer.logprobs
    assert len(lp) == answer.tokens and all(len(x.top) == 4 for x in lp)
    model, tok = load_tiny(folder)
    with Store.open(tmp_path / "s") as st:
        stream = st.tokens.read().tolist() + st.job.read(st.manifest["job"]["done"], st.manifest["job"]["tokens"]).tolist()
        question = Session(st, model, tok).question_ids("what is the key?")
    ids = torch.tensor(stream + question + [x.token for x in lp])
    assert ids.numel() <= 4 + 256  # (all in the window: the plain model's case)
    want = torch.log_softmax(vanilla_logits(model, ids)[len(stream) + len(question) - 1: -1].double(), -1)  # [answer, V]
    got = torch.tensor([x.logprob for x in lp], dtype=torch.float64)
    assert (got - want.gather(1, ids[-len(lp):, None])[:, 0]).abs().max() <= TOL
    for x, row in zip(lp, want):
        best = row.topk(4)
        assert [t for t, _ in x.top] == best.indices.tolist()  # (random weights: no ties at float32)
        assert max(abs(v - w) for (_, v), w in zip(x.top, best.values.tolist())) <= TOL
    assert mem.answer("what is the key?", 8, reread=False).logprobs is None  # (not asked)
    # a stop string: the tokens of the text it leaves (those whose text starts before it)
    tokens = [x.token for x in lp]
    full = tok.decode(tokens, skip_special_tokens=True)
    stop = full[len(full) // 2:][:3]
    at = full.find(stop)
    kept = sum(len(tok.decode(tokens[:i], skip_special_tokens=True)) < at for i in range(len(tokens)))
    cut = mem.answer("what is the key?", 8, reread=False, top_logprobs=0, stop=[stop], **sampled)
    assert cut.text == full[:at].strip() and 0 < kept < len(tokens), (full, stop)
    assert [x.token for x in cut.logprobs] == tokens[:kept] and all(x.top == () for x in cut.logprobs)
    with pytest.raises(emllm.UsageError, match="top_logprobs"):
        mem.answer("what is the key?", 8, top_logprobs=21)
    greedy = mem.answer("what is the key?", 8, reread=False, top_logprobs=2)
    greedy.text
    mem.close()
    # `emllm ask --json --logprobs N`: the library's, with each token's text
    import json

    from .helpers import run_in_process

    r = run_in_process("ask", "what is the key?", "--store", str(tmp_path / "s"), "-n", "8", "--no-reread", "--json",
                       "--logprobs", "2", home=tmp_path / "home")
    assert r.returncode == 0, r.stderr
    assert [(x["id"], x["token"], x["logprob"], [(y["id"], y["logprob"]) for y in x["top"]])
            for x in json.loads(r.stdout)["logprobs"]] == \
        [(e.token, tok.decode([e.token]), e.logprob, list(e.top)) for e in greedy.logprobs]
    r = run_in_process("ask", "what is the key?", "--store", str(tmp_path / "s"), "--logprobs", "2", home=tmp_path / "home")
    assert r.returncode == 1 and "--logprobs goes with --json" in r.stderr


def test_a_stores_perplexity_is_the_plain_models_where_the_text_fits_the_window(tiny, tmp_path):
    """`emllm show`'s perplexity: exp of the mean surprise of each document's tokens as read, which
    where the whole stream fits the window is the plain model's exp of mean -log p over them."""
    import math

    import torch

    from emllm.store import Store

    from .helpers import ingest_store, load_tiny, vanilla_logits

    folder, _, _, _ = tiny
    prof = tmp_path / "wide.yaml"
    prof.write_text("chunk_size: 16\nn_init: 4\nn_local: 256\nn_mem: 32\nmin_block: 2\nmax_block: 8\n")
    ingest_store(tmp_path / "s", folder, prof, [("one", words(3, 40)), ("two", words(4, 30))])
    s = emllm.store_summary(tmp_path / "s")
    model, _ = load_tiny(folder)
    with Store.open(tmp_path / "s") as st:
        ids = st.tokens.read()
        docs = st.info.documents
    assert ids.numel() <= 4 + 256 and [d["name"] for d in s["documents"]] == ["one", "two"]
    nll = torch.full((ids.numel(),), float("nan"), dtype=torch.float64)
    nll[1:] = -torch.log_softmax(vanilla_logits(model, ids)[:-1].double(), -1).gather(1, ids[1:, None].long())[:, 0]
    spans = [nll[d.start: d.start + d.tokens] for d in docs]
    for d, span in zip(s["documents"], spans):
        assert d["perplexity"] == pytest.approx(math.exp(float(span.mean())), rel=1e-4)
    assert s["perplexity"] == pytest.approx(math.exp(float(torch.cat(spans).mean())), rel=1e-4) and s["perplexity_exact"]
    (tmp_path / "short.yaml").write_text(prof.read_text() + "surprise_head: shortlist\n")  # (said to be estimated)
    ingest_store(tmp_path / "t", folder, tmp_path / "short.yaml", [("one", words(3, 40))])
    assert emllm.store_summary(tmp_path / "t")["perplexity_exact"] is False


def test_a_completion_continues_the_stream_as_the_plain_model_does(tiny, tmp_path):
    """`Memory.complete`: the prompt continues the store's stream as it is (no question's
    framing), and where the whole stream fits the window the completion is the plain model's
    greedy continuation of stream + prompt; with echo the prompt's tokens' log probabilities are
    the plain model's log softmax over the same tokens (the first predicted by the stream's end)."""
    import torch

    from emllm.app.stream import encode_framing
    from emllm.store import Store

    from .helpers import TOL, ingest_store, load_tiny, vanilla_logits

    folder, _, _, _ = tiny
    prof = tmp_path / "wide.yaml"
    prof.write_text("chunk_size: 16\nn_init: 4\nn_local: 256\nn_mem: 32\nmin_block: 2\nmax_block: 8\n")
    ingest_store(tmp_path / "s", folder, prof, [("doc", words(3, 40))])
    model, tok = load_tiny(folder)
    with Store.open(tmp_path / "s") as st:
        stream = st.tokens.read().tolist() + st.job.read(st.manifest["job"]["done"], st.manifest["job"]["tokens"]).tolist()
    prompt = words(4, 21)  # (longer than a chunk: the prompt's logits come from two chunks)
    pids = encode_framing(tok, prompt)
    assert len(pids) > 16
    mem = emllm.open(tmp_path / "s", writable=True)
    done = mem.complete(prompt, 6, top_logprobs=3, echo=True)
    text = done.text
    gen = [x.token for x in done.logprobs]
    assert len(gen) == done.tokens == 6 and done.finish_reason == "length" and done.prompt_tokens == len(pids)
    ids = torch.tensor(stream + pids)
    want_gen = []
    for _ in range(6):  # the plain model's greedy continuation
        want_gen.append(int(vanilla_logits(model, torch.cat([ids, torch.tensor(want_gen, dtype=torch.long)]))[-1].argmax()))
    assert gen == want_gen
    assert text == tok.decode(gen, skip_special_tokens=True)  # (as generated: not stripped)
    # echo: the prompt's tokens, each under the logits before it
    full = torch.tensor(stream + pids + gen)
    assert full.numel() <= 4 + 256  # (all in the window: the plain model's case)
    lp = torch.log_softmax(vanilla_logits(model, full).double(), -1)  # [n, V]
    rows = lp[len(stream) - 1: len(stream) + len(pids) - 1]  # those predicting the prompt's tokens
    echo = done.prompt_logprobs
    assert [x.token for x in echo] == pids
    got = torch.tensor([x.logprob for x in echo], dtype=torch.float64)
    assert (got - rows.gather(1, torch.tensor(pids)[:, None])[:, 0]).abs().max() <= TOL
    assert all([t for t, _ in x.top] == row.topk(3).indices.tolist() for x, row in zip(echo, rows))
    # the answer's own log probabilities under the same rows as an answer's
    assert max(abs(x.logprob - float(lp[len(stream) + len(pids) - 1 + i, t])) for i, (x, t) in enumerate(zip(done.logprobs, gen))) <= TOL
    # token ids for text, the same; nothing generated, the prompt still scored
    assert mem.complete(pids, 6).text == text
    scored = mem.complete(pids, 0, echo=True)
    assert scored.text == "" and scored.tokens == 0 and [round(x.logprob, 6) for x in scored.prompt_logprobs] == \
        [round(x.logprob, 6) for x in echo]
    assert scored.logprobs is None and mem.complete(pids, 2).prompt_logprobs is None  # (not asked)
    for bad, why in (("", "the prompt is empty"), ([], "non-empty list"), ([0, 10**6], "outside the model's vocabulary"),
                     ([1, "a"], "non-empty list of token ids")):
        with pytest.raises(emllm.UsageError, match=why):
            mem.complete(bad)
    with pytest.raises(emllm.UsageError, match="max_new_tokens"):
        mem.complete("x", -1)
    # `emllm ask --raw`: the library's completion, printed as it is (its leading space kept)
    import json

    from .helpers import run_in_process

    mem.close()
    r = run_in_process("ask", "--raw", prompt, "--store", str(tmp_path / "s"), "-n", "6", "--json", "--logprobs", "0",
                       home=tmp_path / "home")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["answer"] == text and [x["id"] for x in doc["logprobs"]] == gen and "reread" not in doc
    r = run_in_process("ask", "--raw", prompt, "--store", str(tmp_path / "s"), "-n", "6", home=tmp_path / "home")
    assert r.returncode == 0 and r.stdout == text + "\n"
    for flag in (["--reread"], ["--show-retrieval"], ["--kv-cache-mb", "8"]):
        r = run_in_process("ask", "--raw", prompt, "--store", str(tmp_path / "s"), *flag, home=tmp_path / "home")
        assert r.returncode == 1 and f"{flag[0]} does not go with --raw" in r.stderr
    mem = emllm.open(tmp_path / "s", writable=True)
    # remembered: the prompt and the completion as they are, appended to the stream
    mem.remember(_read(mem.complete(prompt, 6)))
    with Store.open(tmp_path / "s") as st:
        after = st.tokens.read().tolist() + st.job.read(st.manifest["job"]["done"], st.manifest["job"]["tokens"]).tolist()
    assert after == stream + pids + gen
    mem.close()


def _read(answer):
    answer.text
    return answer


def test_a_completion_of_an_empty_store_is_the_plain_models_of_its_prompt(tiny, tmp_path):
    """An empty store (a conversation's, published with nothing read): a completion reads its
    prompt alone, without the chat turn's opening an answer would add; nothing predicts its first
    token (logprob None), the rest as the plain model scores the prompt."""
    import torch

    from emllm.app.stream import encode_framing

    from .helpers import TOL, load_tiny, vanilla_logits

    folder, prof, _, _ = tiny
    model, tok = load_tiny(folder)
    mem = emllm.create(tmp_path / "e", str(folder), profile=str(prof), publish=True)
    prompt = words(5, 12)
    done = mem.complete(prompt, 3, top_logprobs=1, echo=True)
    done.text
    pids = encode_framing(tok, prompt)
    echo = done.prompt_logprobs
    assert [x.token for x in echo] == pids and echo[0].logprob is None and echo[0].top == ()
    full = torch.tensor(pids + [x.token for x in done.logprobs])
    lp = torch.log_softmax(vanilla_logits(model, full).double(), -1)
    assert max(abs(x.logprob - float(lp[i, t])) for i, (x, t) in enumerate(zip(echo[1:], pids[1:]))) <= TOL
    assert [x.token for x in done.logprobs] == [int(lp[len(pids) - 1 + i].argmax()) for i in range(3)]
    mem.close()


def test_a_cancelled_answer_stops_at_the_next_chunk_or_token(tiny, tmp_path, monkeypatch):
    """`Answer.cancel()` (a server's client gone): a long prompt stops being read at the next
    chunk, a generation at the next token, iterating raises `emllm.Cancelled`; the memory's next
    answer is as if nothing had been asked."""
    from emllm.engine.stream import Engine

    from .helpers import ingest_store

    folder, prof, _, _ = tiny
    ingest_store(tmp_path / "s", folder, prof, [("doc", words(3, 60))])
    steps = {"n": 0}
    step = Engine.step

    def counted(self, *a, **k):
        steps["n"] += 1
        return step(self, *a, **k)

    monkeypatch.setattr(Engine, "step", counted)
    with emllm.open(tmp_path / "s") as mem:
        want = mem.complete(words(4, 30), 6).text
        long = mem.complete([5 + i % 50 for i in range(800)], 4)  # (100 chunks of the tiny profile's 8)
        steps["n"] = 0
        long.cancel()
        with pytest.raises(emllm.Cancelled):
            long.text
        assert steps["n"] == 1  # (the first chunk: the check comes after each)
        answer = mem.answer("what is the key?", 40, reread=False)
        pieces = iter(answer)
        next(pieces)
        answer.cancel()
        with pytest.raises(emllm.Cancelled):
            next(pieces)
        assert mem.complete(words(4, 30), 6).text == want


def _sentencepiece_tokenizer():
    """A Llama-2-style tokenizer (SentencePiece's: words open with "▁", and the decoder strips the
    text's first space), built here: decoded alone, "▁Paris" reads "Paris"."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "▁", "▁The", "▁capital", "▁is", "▁Paris"]
    vocab = {p: i for i, p in enumerate(pieces)}
    merges = []
    for word in ("▁The", "▁capital", "▁is", "▁Paris"):  # (each word's letters merged left to right)
        for ch in word[1:]:
            vocab.setdefault(ch, len(vocab))
        for k in range(2, len(word) + 1):
            vocab.setdefault(word[:k], len(vocab))
            merges.append((word[:k - 1], word[k - 1]))
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_a_completion_keeps_the_space_its_first_word_opens_with(tiny, tmp_path):
    """With a SentencePiece tokenizer (Llama 2's, Mistral's) a completion's tokens decoded alone
    lose the space before their first word ("The capital is" + "Paris"): its text, and its
    tokens' in /v1/completions' logprobs, are read after the prompt's last tokens."""
    import shutil

    from emllm.app.stream import decode_after, token_texts

    tok = _sentencepiece_tokenizer()
    paris = tok.convert_tokens_to_ids("▁Paris")
    assert tok.decode([paris]) == "Paris" and tok("The capital is")["input_ids"][-1] == tok.convert_tokens_to_ids("▁is")
    is_ = tok.convert_tokens_to_ids("▁is")
    assert decode_after(tok, [is_], [paris, paris]) == " Paris Paris" and decode_after(tok, [], [paris]) == "Paris"
    assert token_texts(tok, [paris, paris], is_) == [" Paris", " Paris"] and token_texts(tok, [is_, paris]) == ["is", " Paris"]
    assert token_texts(tok, [paris, paris], [is_, None]) == [" Paris", "Paris"] and token_texts(tok, []) == []
    folder, _, _, _ = tiny
    spm = tmp_path / "spm-model"
    shutil.copytree(folder, spm)
    for f in spm.glob("*token*"):
        f.unlink()
    tok.save_pretrained(spm)
    mem = emllm.create(tmp_path / "s", str(spm), profile=str(tiny[1]), chat=False)
    mem.ingest(("doc", "The capital is Paris. " * 20))
    done = mem.complete("The capital is", 2, logit_bias={paris: 100}, top_logprobs=0)
    assert done.text == " Paris Paris"
    mem.close()


def test_chat_logprobs_tokens_read_after_the_token_before():
    """The chat endpoint's logprobs, whole or from a streamed chunk's first entry on: each token's
    text (and its alternatives') read after the token before it, so that with a SentencePiece
    tokenizer they join to the answer's text ("Paris Paris", not "ParisParis")."""
    from emllm.engine.sampling import TokenLogprob
    from emllm.serve.api import _logprobs

    tok = _sentencepiece_tokenizer()
    is_, paris = tok.convert_tokens_to_ids("▁is"), tok.convert_tokens_to_ids("▁Paris")
    entries = [TokenLogprob(paris, -0.5, ((paris, -0.5), (is_, -2.0))), TokenLogprob(paris, -0.25, ((paris, -0.25),))]
    whole = _logprobs(tok, entries)
    assert [e["token"] for e in whole] == ["Paris", " Paris"] and "".join(e["token"] for e in whole) == "Paris Paris"
    assert [a["token"] for a in whole[1]["top_logprobs"]] == [" Paris"] and whole[0]["top_logprobs"][1]["token"] == "is"
    assert whole[1]["bytes"] == list(b" Paris") and [e["logprob"] for e in whole] == [-0.5, -0.25]
    assert _logprobs(tok, entries, 1) == whole[1:] and _logprobs(tok, entries, 2) == []


def test_a_prompt_is_scored_exactly_under_a_shortlist_surprise_head(tiny, tmp_path):
    """A profile whose surprise comes from a shortlist (Gemma's) computes a few rows of a chunk's
    logits: a completion's echo computes them all, so the prompt's log probabilities are the
    plain model's as with a full head."""
    import torch

    from emllm.app.stream import encode_framing
    from emllm.store import Store

    from .helpers import TOL, ingest_store, load_tiny, vanilla_logits

    folder, _, _, _ = tiny
    prof = tmp_path / "short.yaml"
    prof.write_text("chunk_size: 32\nn_init: 4\nn_local: 256\nn_mem: 64\nmin_block: 2\nmax_block: 8\n"
                    "surprise_head: shortlist\n")
    ingest_store(tmp_path / "s", folder, prof, [("doc", words(3, 40))])
    model, tok = load_tiny(folder)
    with Store.open(tmp_path / "s") as st:
        stream = st.tokens.read().tolist() + st.job.read(st.manifest["job"]["done"], st.manifest["job"]["tokens"]).tolist()
    pids = encode_framing(tok, words(4, 40))
    assert len(pids) > 32  # (a whole chunk, past 2 x the shortlist's probes)
    with emllm.open(tmp_path / "s") as mem:
        assert mem.info.profile.surprise_head == "shortlist"
        done = mem.complete(pids, 0, top_logprobs=0, echo=True)
        done.text
    lp = torch.log_softmax(vanilla_logits(model, torch.tensor(stream + pids)).double(), -1)
    want = lp[len(stream) - 1: -1].gather(1, torch.tensor(pids)[:, None])[:, 0]
    assert (torch.tensor([x.logprob for x in done.prompt_logprobs], dtype=torch.float64) - want).abs().max() <= TOL
