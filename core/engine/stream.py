"""The streaming engine: feeds a token stream of any length through the patched model chunk by
chunk, forms events from surprise, and generates an answer from the memory.

    engine = Engine(model, profile)
    engine.feed(ids)                    # prefill, chunk by chunk; memory grows
    engine.begin_question()
    engine.feed(question_ids)           # each layer retrieves the events the question calls for
    answer = engine.generate(64)        # greedy, one token at a time (profile answer_retrieval)

The model itself is untouched apart from its attention implementation, which is set to the
registered "emllm" function; the per-layer windows reach it through a forward keyword argument.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import Tensor
from transformers import PreTrainedModel

from emllm.errors import EmllmError, NotFiniteError
from emllm.math import attention
from emllm.config import Profile
from emllm.memory.buffers import GrowBuffer
from emllm.memory.distinct import span_groups
from emllm.memory.events import EventMemory, EventStorage
from emllm.memory.passages import event_spans
from emllm.memory.selection import Selection
from emllm.models import device_of, input_device
from emllm.math.rope import Rotary
from emllm.math.segmentation import enforce_block_sizes, key_adjacency, refine, refined_max_block, surprise_starts
from emllm.math import surprise as surprise_math
from emllm.math.surprise import Head, boundary_flags, probe_positions, shortlist_surprise, token_surprise
from emllm.engine.sampling import Chooser, greedy
from emllm.engine.sliding import SlidingLayer
from emllm.engine.window import LayerWindow, StepInfo, close_events

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text")
TOKEN_SLACK = 256  # generated tokens between two rotations of a layer's whole window


class UnsupportedModelError(EmllmError, ValueError):
    """The architecture cannot run under emllm (yet); the message says why."""


def repr_heads(profile: Profile, kv_heads: int, q_heads: int) -> int:
    """Heads of a new memory's representative keys: mean keys are the same for every query head of
    a KV head's group, so they are kept per KV head; attention's differ per query head."""
    return kv_heads if profile.representative == "mean" else q_heads


def check_supported(model: PreTrainedModel) -> None:
    cfg = model.config
    mt = getattr(cfg, "model_type", "?")
    if mt not in SUPPORTED:
        raise UnsupportedModelError(
            f"model type {mt!r} is not supported by emllm (supported: {', '.join(SUPPORTED)}); "
            "its attention would run wrong rather than fail"
        )
    if getattr(getattr(model, "model", None), "rotary_emb", None) is None:
        raise UnsupportedModelError(f"model type {mt!r}: no shared rotary embedding found at model.model.rotary_emb")


def sliding_layers(cfg) -> list[int | None]:
    """Per layer, the sliding window it attends within where the model mixes sliding-window and
    global layers (Gemma 2 and 3: `layer_types`), None for a global one. Such a sliding layer gets
    no memory (`engine.sliding`). A model whose layers all slide (Mistral) is not mixed: every
    entry is None, and its window bounds the profile's instead (`Engine`)."""
    types = getattr(cfg, "layer_types", None) or []
    sw = getattr(cfg, "sliding_window", None)
    if not sw or "sliding_attention" not in types or "full_attention" not in types:
        return [None] * cfg.num_hidden_layers
    return [sw if t == "sliding_attention" else None for t in types]


@dataclass
class Hooks:
    """The `emllm` keyword of one forward: each layer's window, and what they share this step."""

    layers: list[LayerWindow | SlidingLayer]  # by the model's layer index
    step: StepInfo


@dataclass
class ChunkReport:
    """Passed to the progress callback after each chunk."""

    tokens_done: int
    tokens_total: int
    events: int


class RetrievalListener:
    """Sees every layer's retrieval while attached (`Engine.on_retrieval`), then passes it on to
    the callback that was set before, so that listeners nest (a trace inside a recall probe).
    Subclasses define `heard`; `detach` restores the callback before it."""

    def __init__(self, engine: "Engine") -> None:
        self.engine = engine
        self._before: Callable[[int, Selection, Tensor], None] | None = engine.on_retrieval
        engine.on_retrieval = self._call

    def heard(self, layer: int, sel: Selection, query: Tensor) -> None:
        raise NotImplementedError

    def _call(self, layer: int, sel: Selection, query: Tensor) -> None:
        self.heard(layer, sel, query)
        if self._before is not None:
            self._before(layer, sel, query)

    def detach(self) -> None:
        self.engine.on_retrieval = self._before


class Engine:
    def __init__(
        self, model: PreTrainedModel, profile: Profile, memory: Callable[[int], EventStorage] | None = None
    ) -> None:
        """memory: i -> the event memory of the i-th layer that holds one (`windows[i]`; every layer
        but a mixed model's sliding ones: `sliding_layers`). Default: in RAM; a store gives its own."""
        check_supported(model)
        cfg = model.config
        sw = getattr(cfg, "sliding_window", None)
        sliding = sliding_layers(cfg)
        mixed = any(sliding)
        if (not mixed and sw and getattr(cfg, "use_sliding_window", True)
                and profile.n_local + profile.chunk_size > sw):
            raise UnsupportedModelError(
                f"the model attends within a sliding window of {sw} tokens; the profile's local window "
                f"n_local + chunk_size = {profile.n_local + profile.chunk_size} exceeds it: lower n_local"
            )
        n_layers = cfg.num_hidden_layers
        if profile.refine_from_layer is not None and profile.refine_from_layer >= n_layers:
            # the profile cannot check this (it does not know the model); refinement would have
            # no layers to build its similarity graph from
            from emllm.config import ProfileError

            raise ProfileError(
                f"profile {profile.name!r}: refine_from_layer = {profile.refine_from_layer} but the model "
                f"has {n_layers} layers (0..{n_layers - 1})"
            )
        self.model = model
        self.profile = profile
        attention.register()
        model.set_attn_implementation(attention.NAME)
        rope = model.model.rotary_emb
        typed = getattr(rope, "layer_types", None) is not None  # one table per kind of layer (Gemma 3)
        kinds = getattr(cfg, "layer_types", None)
        global_kind = next((kinds[i] for i, w in enumerate(sliding) if w is None), None) if typed else None
        self.rotary = Rotary(rope, global_kind)
        self.sliding_rotary = Rotary(rope, "sliding_attention" if typed else None) if mixed else None
        self.sliding_window = sw if mixed else None
        self.dtype = next(model.parameters()).dtype
        # Where the token ids go: the input embedding's device (accelerate moves them on from there).
        self.device = input_device(model)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # Each layer's memory lives on its layer's device (a model split with accelerate's device_map).
        layer_devices = [device_of(layer, self.device) for layer in model.model.layers]
        heads = repr_heads(profile, cfg.num_key_value_heads, cfg.num_attention_heads)
        with_memory = [i for i, w in enumerate(sliding) if w is None]
        memory = memory or (lambda j: EventMemory(cfg.num_key_value_heads, heads, head_dim, self.dtype,
                                                   layer_devices[with_memory[j]], profile.faiss_threshold))
        # the layers that hold memory, in order; `layers`: every layer's hook, by its index
        self.windows = [
            LayerWindow(i, cfg.num_key_value_heads, cfg.num_attention_heads, head_dim, self.dtype, layer_devices[i], memory(j))
            for j, i in enumerate(with_memory)
        ]
        by_index = {w.layer_idx: w for w in self.windows}
        self.layers: list[LayerWindow | SlidingLayer] = [
            by_index[i] if i in by_index else
            SlidingLayer(i, cfg.num_key_value_heads, head_dim, self.dtype, layer_devices[i], sliding[i])
            for i in range(n_layers)
        ]
        if profile.refine_from_layer is not None and not self.refinement_layers():
            from emllm.config import ProfileError

            raise ProfileError(f"profile {profile.name!r}: refine_from_layer = {profile.refine_from_layer} but the "
                               f"model's last layer with memory is layer {with_memory[-1]}")
        self.ids = GrowBuffer((0,), 0, torch.long, torch.device("cpu"))
        self.surprise = GrowBuffer((0,), 0, torch.float32, torch.device("cpu"))  # NaN: none
        self.flags = GrowBuffer((0,), 0, torch.bool, torch.device("cpu"))
        self.rem_start = profile.n_init  # stream position of the first token not yet in an event
        self.last_logits: Tensor | None = None  # [V] predicts the next token
        self.source: str | None = None  # the store the memory is read from, named in errors
        self.on_retrieval: Callable[[int, Selection, Tensor], None] | None = None
        self.answering = False  # a question is being read or answered (`begin_question`)
        self._groups: tuple[tuple[int, int], Tensor] | None = None  # `event_groups`: ((events, rem_start), labels)
        # profile surprise_head "shortlist": the model's head as surprise computes it, once checked
        # against the model's own logits (None: not yet; False: they differ, every logit is computed)
        self._head: Head | bool | None = None if profile.surprise_head == "shortlist" else False

    def refinement_layers(self) -> list[LayerWindow]:
        """The layers whose keys build refinement's similarity graph: those with memory from the
        profile's refine_from_layer on (None: the last third of them, at least one)."""
        first = self.profile.refine_from_layer
        if first is None:
            return self.windows[len(self.windows) - max(1, len(self.windows) // 3):]
        return [w for w in self.windows if w.layer_idx >= first]

    def begin_question(self) -> None:
        """What comes next is a question and its answer: retrieval scores with the profile's
        `question_centering` from here on (where it is set)."""
        self.answering = True

    def event_groups(self) -> Tensor:
        """[E] group labels of the events: equal for events holding the same tokens
        (`memory.distinct.span_groups`), computed again only when events have closed since."""
        key = (self.n_events, self.rem_start)
        if self._groups is None or self._groups[0] != key:
            spans = event_spans(self.windows[0].events.event_lengths(), self.profile.n_init)
            self._groups = key, span_groups(self.ids.view(), spans).to(self.device)
        return self._groups[1]

    @property
    def n_tokens(self) -> int:
        return self.ids.n

    @property
    def window_start(self) -> int:
        """Stream position of the local window's first token (the window holds the rest)."""
        return self.n_tokens - self.windows[0].local_k.shape[1]

    @property
    def similarity_budget(self) -> int:
        """Tokens each layer retrieves by score at a step: n_mem, less the contiguity buffer's share."""
        pr = self.profile
        return pr.n_mem - (int(pr.n_mem * pr.contiguity_ratio) if pr.contiguity else 0)

    @property
    def n_events(self) -> int:
        return len(self.windows[0].events)

    # -- prefill -------------------------------------------------------------------------------
    def feed(
        self,
        ids: Tensor | list[int],
        progress: Callable[[ChunkReport], None] | None = None,
        surprise: bool = True,
    ) -> Tensor:
        """Stream `ids` [n] through the model in chunks. Returns the logits of the last token [V].

        surprise=False marks the tokens as having none (generated text): they are cut into
        max_block events instead of at surprise boundaries.
        """
        ids = torch.as_tensor(ids, dtype=torch.long).flatten()
        if ids.numel() == 0:
            raise ValueError("nothing to feed: the token sequence is empty")
        cs = self.profile.chunk_size
        for off in range(0, ids.numel(), cs):
            self.step(ids[off : off + cs], surprise)
            if progress is not None:
                progress(ChunkReport(min(off + cs, ids.numel()), ids.numel(), self.n_events))
        return self.last_logits

    @torch.no_grad()
    def step(self, chunk: Tensor, with_surprise: bool = True, kept_memory: bool = False,
             every_logit: bool = False) -> Tensor:
        """One forward over `chunk` [c] (at most chunk_size tokens); returns its logits [c, V]
        (with_surprise=False, or surprise from a shortlist head: the last token's only, [1, V];
        nothing needs the others, and the model's head then computes one row instead of c;
        every_logit: [c, V] all the same, the surprise then exact).
        kept_memory: each layer attends to the events the question's last chunk retrieved
        instead of retrieving (a generated answer's token; profile answer_retrieval "question")."""
        pr = self.profile
        c = chunk.numel()
        window = min(self.n_tokens, pr.n_local) + c
        # a step of one token keeps the window rotated at positions up to n_local + TOKEN_SLACK
        # (not for rope types whose angles depend on the sequence's length: their window is rotated whole)
        slack = TOKEN_SLACK if c == 1 and not self.rotary.length_dependent else 0
        cos, ssin = self.rotary.signed_table(max(window, pr.n_local + slack), self.device, self.dtype)
        budget = self.similarity_budget
        centering = pr.question_centering if self.answering and pr.question_centering else pr.query_centering
        scoring = pr.question_scoring if self.answering and pr.question_scoring != "mean" and c > 1 else None
        step = StepInfo(cos, ssin, pr.n_local, pr.n_init, budget, pr.n_mem - budget, pr.neighbours, centering,
                        bool(pr.query_centering or pr.question_centering), self.on_retrieval,
                        pr.representative == "attention", slack, scoring,
                        self.event_groups() if scoring and pr.distinct_events else None,
                        self._sliding_rope(c), keep_memory=self.answering and not kept_memory,
                        reuse_memory=kept_memory)
        if with_surprise and self._head is None:
            self._head = self._check_head()
        if self.model.config._attn_implementation != attention.NAME:  # someone ran the plain model meanwhile
            self.model.set_attn_implementation(attention.NAME)
        x = chunk.to(self.device)[None]
        # a chunk of a few tokens computes every logit: the probes would cost as much
        shortlist = (with_surprise and isinstance(self._head, Head) and c > 2 * surprise_math.SHORTLIST_PROBES
                     and not every_logit)
        probes = probe_positions(c).to(self.device) if shortlist else None
        hidden: list[Tensor] = []  # the final hidden states [1, c, d], for a shortlist's surprise
        hook = self.model.model.register_forward_hook(lambda m, a, o: hidden.append(o[0])) if shortlist else None
        try:
            out = self.model(
                input_ids=x,
                position_ids=torch.zeros_like(x),  # identity rotation: the attention gets keys before RoPE
                use_cache=False,
                logits_to_keep=probes if shortlist else 0 if with_surprise else 1,  # (0: all)
                emllm=Hooks(self.layers, step),  # reaches the attention function of every layer
            )
        finally:
            if hook is not None:
                hook.remove()
        logits = out.logits[0]  # [c, V] ([1, V] without surprise; [P, V] at the probes with a shortlist)
        if with_surprise:
            if shortlist:
                s = shortlist_surprise(hidden[0][0], x[0], self.last_logits, self._head, self.n_tokens, probes, logits).cpu()
                logits = logits[-1:]
            else:
                s = token_surprise(logits, x[0], self.last_logits).cpu()
            if self.n_tokens == 0:
                s[0] = float("nan")
        else:
            s = torch.full((c,), float("nan"))
        last = logits[-1].float()
        # NaN and infinities in any key or value the step read reach the last token's logits (they
        # carry through softmax and every product after it): one sum a step refuses them
        if not bool(torch.isfinite(last.sum())):
            raise NotFiniteError(f"{self.source + ': ' if self.source else ''}the model's output is not finite at token "
                                 f"{self.n_tokens + c}: " + ("keys or values read from the store are not finite (it is "
                                 "damaged or was edited); it is refused" if self.source else "its weights or inputs hold NaN "
                                 "or infinities"))
        self.last_logits = last
        start = self.n_tokens
        self.ids.append(chunk.cpu())
        self.surprise.append(s)
        if pr.segmentation.startswith("F"):
            f = torch.zeros(c, dtype=torch.bool)
        else:
            f = boundary_flags(self.surprise.view(), start, pr.surprise_window, pr.gamma)
        self.flags.append(f)
        self._close_events()
        for w in self.windows:  # (a store's: every layer's rows a device step left there, in one read)
            w.events.flush()
        return logits

    @torch.no_grad()
    def _check_head(self) -> Head | bool:
        """The model's head as a `Head` if it turns the model's last hidden state into the model's
        own logits (one token through the plain model); False if not: a model that transforms its
        logits otherwise keeps computing them all, as with surprise_head "full". The same answer
        for every engine on the model, so a resumed stream cuts its events as the first read did."""
        lm = self.model.get_output_embeddings()
        if not isinstance(lm, torch.nn.Linear):
            return False
        head = Head(lm.weight, lm.bias, getattr(self.model.config.get_text_config(), "final_logit_softcapping", None))
        hidden: list[Tensor] = []
        hook = self.model.model.register_forward_hook(lambda m, a, o: hidden.append(o[0]))
        self.model.set_attn_implementation("eager")  # (the step sets emllm's back)
        try:
            ids = torch.tensor([[self.model.config.get_text_config().bos_token_id or 0]], device=self.device)
            theirs = self.model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0].float()
        finally:
            hook.remove()
        mine = head.logits(hidden[0][0, -1:]).float()
        return head if bool((mine - theirs).abs().max() <= 1e-2 * theirs.abs().max().clamp_min(1)) else False

    def _sliding_rope(self, c: int) -> tuple[Tensor, Tensor] | None:
        """cos and signed sin of the sliding layers for a step of c tokens (their window: size - 1 before them)."""
        if self.sliding_window is None:
            return None
        return self.sliding_rotary.signed_table(min(self.n_tokens, self.sliding_window - 1) + c, self.device, self.dtype)

    def _close_events(self) -> None:
        """Close every event that lies wholly in the evicted part of the stream (shared by all layers)."""
        pr = self.profile
        evicted = self.n_tokens - pr.n_local  # tokens [0, evicted) have left the local window
        if evicted - self.rem_start < 1:
            return
        # Flags up to and including `evicted`: a boundary there closes the event before it.
        # (evicted < n_tokens always, since n_local >= 1.) Every start but the last closes an event.
        f = self.flags.view()[self.rem_start : evicted + 1]
        starts = surprise_starts(f, pr.min_block, pr.max_block)
        if starts.numel() < 2:
            return
        if len(pr.segmentation) == 2:  # SM, SC, FM, FC: refine inside the closed stretch
            starts = self._refine(starts)
        lengths = torch.diff(starts)
        close_events(self.windows, lengths, pr.repr_topk, pr.repr_normalise, pr.representative == "mean")
        self.rem_start += int(lengths.sum())

    def _refine(self, starts: Tensor) -> Tensor:
        """Paper Algorithm 1 over the stretch [rem_start, rem_start + starts[-1]) about to close.

        The stretch's ends stay fixed (its last start opens the next, still open, event); the
        graph is the similarity of the tokens' pre-RoPE keys over the refinement layers.
        """
        pr = self.profile
        n = int(starts[-1])
        layers = self.refinement_layers()
        dev = layers[0].rem_k.device  # layers may sit on several devices
        keys = torch.stack([w.rem_k[:, :n].to(dev) for w in layers])  # [layers, H_kv, n, D]
        a = key_adjacency(keys)
        metric = "modularity" if pr.segmentation.endswith("M") else "conductance"
        # Every event of the stretch is closed, so all of them (the last one, [starts[-2], n),
        # included) must stay in [min_block, cap]: refine only moves a boundary where both
        # events it changes stay in bounds. enforce_block_sizes is then a no-op safety net.
        cap = refined_max_block(pr.segmentation, pr.max_block)
        inner = refine(a, starts[:-1], metric, min_block=pr.min_block, max_block=cap)
        inner = enforce_block_sizes(inner, n, pr.min_block, cap)
        return torch.cat((inner, starts[-1:]))

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Tensor]:
        """Everything that continues the stream besides the events and the token arrays:
        per layer the initial tokens, remainder and local window with their attention mass, the
        contiguity queue; the last logits and the stream counters."""
        out: dict[str, Tensor] = {"rem_start": torch.tensor(self.rem_start), "n_tokens": torch.tensor(self.n_tokens)}
        if self.last_logits is not None:
            out["last_logits"] = self.last_logits
        for w in self.layers:
            for name, t in w.state().items():
                out[f"layer{w.layer_idx}.{name}"] = t
        return out

    def snapshot(self) -> dict:
        """A copy of where the stream is now, to come back to with `restore` (a server answers each
        request from the same point without reading the store's tail again). The layers' memories
        must be able to forget what is appended after it (`mark`/`truncate`: a read-only store's)."""
        return {"state": {k: v.clone() for k, v in self.state_dict().items()}, "ids": self.ids.view().clone(),
                "surprise": self.surprise.view().clone(), "flags": self.flags.view().clone(),
                "memory": [w.events.mark() for w in self.windows]}

    def restore(self, snap: dict) -> None:
        """Back to a `snapshot`: events closed since are forgotten, the windows and counters reset."""
        for w, m in zip(self.windows, snap["memory"]):
            w.events.truncate(m)
        self.load_state_dict({k: v.clone() for k, v in snap["state"].items()}, snap["ids"], snap["surprise"], snap["flags"])

    def load_state_dict(self, state: dict[str, Tensor], ids: Tensor, surprise: Tensor, flags: Tensor) -> None:
        """Continue a stream: `state` from `state_dict`, and the stream's token arrays [n]."""
        n = int(state["n_tokens"])
        if not ids.numel() == surprise.numel() == flags.numel() == n:
            raise ValueError(f"state is for {n} tokens, arrays hold {ids.numel()}")
        self.ids = GrowBuffer((0,), 0, torch.long, torch.device("cpu"))
        self.surprise = GrowBuffer((0,), 0, torch.float32, torch.device("cpu"))
        self.flags = GrowBuffer((0,), 0, torch.bool, torch.device("cpu"))
        if n:
            self.ids.append(ids.long())
            self.surprise.append(surprise.float())
            self.flags.append(flags.bool())
        if n and (int(ids.min()) < 0 or int(ids.max()) >= self.model.config.vocab_size):
            raise ValueError("token ids outside the vocabulary")
        self.rem_start = int(state["rem_start"])
        self._groups = None  # (the events may be others now: `restore`)
        if not 0 <= self.rem_start <= max(n, self.profile.n_init):  # n_init until the stream is that long
            raise ValueError(f"rem_start {self.rem_start} outside the stream")
        self.last_logits = state.get("last_logits")
        if self.last_logits is not None and tuple(self.last_logits.shape) != (self.model.config.vocab_size,):
            raise ValueError("last_logits of the wrong shape")
        for w in self.layers:
            prefix = f"layer{w.layer_idx}."
            w.load_state({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})

    # -- generation ----------------------------------------------------------------------------
    def generate_iter(self, max_new_tokens: int, stop_ids: set[int] | None = None,
                      choose: Chooser = greedy) -> Iterator[int]:
        """One token per forward (greedy unless `choose` samples: engine.sampling); yields token ids
        as they are chosen."""
        if self.last_logits is None:
            raise ValueError("feed a prompt before generating")
        stop_ids = stop_ids or set()
        kept = self.answering and self.profile.answer_retrieval == "question"  # (after a question only)
        if not self.profile.question_centering_answer:
            self.answering = False  # the answer's tokens score as the document's did
        answer: list[int] = []
        for _ in range(max_new_tokens):
            tok = choose(answer, self.last_logits)
            if tok in stop_ids:
                return
            answer.append(tok)
            yield tok
            self.step(torch.tensor([tok]), with_surprise=False, kept_memory=kept)

    def generate(self, max_new_tokens: int, stop_ids: set[int] | None = None) -> list[int]:
        return list(self.generate_iter(max_new_tokens, stop_ids))
