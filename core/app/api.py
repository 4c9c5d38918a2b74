"""The library's handle on a memory: a store with its model, to ingest into, ask, and inspect.

    import emllm
    with emllm.create("book-memory") as mem:                     # a new store, the default model
        mem.ingest(("book.txt", text))
    with emllm.open("book-memory") as mem:                       # its model loaded and checked
        print(mem.ask("who hid the key?"))
        mem.retrieval("who hid the key?")["top_events"]           # what the layers retrieved

Paths are folders; `emllm.home.stores_dir()` is where the CLI keeps named stores.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from emllm import models
from emllm.app.ask import Session
from emllm.app.ingest import Progress, add_documents, run_job
from emllm.app.report import retrieval_report, store_summary
from emllm.app.stream import OpenStore, create_store, open_engine, open_store
from emllm.app.textinput import TextSource
from emllm.engine.sampling import Sampling
from emllm.store import Store


class Memory:
    """A store opened with its model. Writable when made by `create` or opened with writable=True."""

    def __init__(self, opened: OpenStore) -> None:
        self._o = opened

    @property
    def store(self) -> Store:
        return self._o.store

    @property
    def model(self) -> Any:
        return self._o.model

    @property
    def tokenizer(self) -> Any:
        return self._o.tok

    def ingest(self, *docs: str | tuple[str, str | TextSource], commit_every: int = 4,
               progress: Callable[[Progress], None] | None = None) -> int:
        """Append documents (text, or (name, text or TextSource)) to the stream and read them;
        committed every few chunks (a crash keeps the last commit). Returns the tokens added."""
        named = [d if isinstance(d, tuple) else (f"text-{i}", d) for i, d in enumerate(docs)]
        engine = open_engine(self.store, self.model)
        n = add_documents(self.store, self.tokenizer, named)
        run_job(self.store, engine, commit_every, progress)
        return n

    def ask(self, question: str, max_new_tokens: int = 256, stop: list[str] | None = None, reread: bool = True,
            **sampling: Any) -> str:
        """An answer from the memory (on a copy of its state: the store is unchanged): greedy, or
        sampled with temperature=, top_p=, top_k=, repetition_penalty=, seed= (unset: the model's
        generation config); it ends before any of the `stop` strings. reread (the default, as
        `emllm ask`): answer by reading again the passages the memory chose (`emllm.app.reread`);
        False: emllm's own answer, the paper's method."""
        session = Session(self.store, self.model, self.tokenizer, reread=reread)
        opts = Sampling.from_model(self.model, **sampling)
        return "".join(session.answer_text(question, max_new_tokens, opts, stop)).strip()

    def retrieval(self, query: str, layer: int | None = None, top: int = 8) -> dict:
        """What each layer retrieves for `query` read as a question (see `report.retrieval_report`)."""
        return retrieval_report(self.store, self.model, self.tokenizer, query, layer, top)

    def summary(self) -> dict:
        return store_summary(self.store)

    def close(self) -> None:
        self._o.close()

    def __enter__(self) -> "Memory":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def create(path: str | Path, model: str | None = None, profile: str | None = None, chat: bool = True,
           log: Callable[[str], None] | None = None, dtype: str | None = None, kv_format: str | None = None) -> Memory:
    """A new, empty store at `path` for `model` (a profile alias, a local folder or a cached hub id;
    default: `emllm.models.default_model()`), computing in `dtype` (auto, float32, bfloat16; None: the
    profile's, auto by default), keeping keys and values in `kv_format` (None: the compute dtype;
    bfloat16, int8, int4). It takes its name at its first ingest."""
    src = models.resolve(model, profile, log=log)
    mdl, tok = models.load(src, dtype=dtype)
    name = str(src.path.resolve()) if Path(src.name).exists() else src.name
    st = create_store(Path(path), name, mdl, tok, src.profile, chat=chat, kv_format=kv_format)
    return Memory(OpenStore(st, mdl, tok, src))


def open(path: str | Path, writable: bool = False, model: str | None = None,  # noqa: A001 - emllm.open
         log: Callable[[str], None] | None = None) -> Memory:
    """The store at `path` with the model it was written with, loaded and checked."""
    return Memory(open_store(Path(path), writable=writable, model=model, log=log))


__all__ = ["Memory", "create", "open"]
