"""A model split by accelerate's device_map: the engine keeps each layer's memory where the layer
computes, and the results are the unsplit model's, bit for bit.

No GPU here, so the split is the one a CPU allows: some modules offloaded to disk, whose weights
wait on the meta device and are brought to the CPU for each forward by accelerate's hooks (the
same hooks, with another execution device, run a GPU/CPU split).
"""

from __future__ import annotations

import torch

from emllm import models
from emllm.config import load_profile_file
from emllm.engine.stream import Engine
from .helpers import answers_of, ingest_store, load_tiny, store_arrays, words


SPLIT = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
         "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}  # lm_head is tied to the embedding


def _split(folder, tmp_path):
    src = models.ModelSource(str(folder), folder, None)
    return models.load(src, device_map=SPLIT, offload_folder=tmp_path / "offload")


def test_split_model_equals_the_whole_one(tiny, tmp_path):
    folder, prof, _, _ = tiny
    split, _ = _split(folder, tmp_path)
    assert split.model.layers[1].self_attn.q_proj.weight.device.type == "meta"  # really offloaded
    whole, tok = load_tiny(folder)
    profile = load_profile_file(prof)
    ids = torch.tensor(tok(words(7, 300))["input_ids"])
    assert ids.numel() > 8 * profile.chunk_size  # events reach the memory and are retrieved
    a, b = Engine(whole, profile), Engine(split, profile)
    assert all(w.local_k.device.type == "cpu" for w in b.windows)  # not meta, where the weights wait
    assert torch.equal(b.feed(ids), a.feed(ids))
    assert a.n_events > 5 and a.n_events == b.n_events
    for _ in range(6):  # decode: one token at a time, each with retrieval
        assert torch.equal(b.step(b.last_logits.argmax()[None]), a.step(a.last_logits.argmax()[None]))


def test_store_written_by_a_split_model_is_the_same_store(tiny, tmp_path):
    folder, prof, _, _ = tiny
    docs = [("doc", words(8, 400))]
    ingest_store(tmp_path / "whole", folder, prof, docs)
    split, tok = _split(folder, tmp_path)
    ingest_store(tmp_path / "split", folder, prof, docs, model=split)
    assert store_arrays(tmp_path / "split") == store_arrays(tmp_path / "whole")
    # and the split model asks it as the whole one does
    whole, _ = load_tiny(folder)
    answers = answers_of(tmp_path / "split", [whole, split], tok, 6)
    assert answers[0] == answers[1] and answers[0]
