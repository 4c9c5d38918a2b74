"""A model that mixes sliding-window and global layers (Gemma 3 270M): what surprise costs a chunk,
and what its store costs a token against a Llama-shaped model of the same size.

    python -m benchmarks.hybrid --model gemma3-270m --chunks 6 --out docs/results/hybrid-gemma3.jsonl

Surprise needs the logits of every token of a chunk, where the plain model's prefill needs the
last one's: over Gemma 3's 262,144-token vocabulary that head is most of the model's weights. Per
chunk, side by side in lockstep (one of each in turn, after a real prefix of a full window):
  body       the plain model's forward over the chunk, the last token's logits only
  probes     the same with the logits of the shortlist's probe rows (the last one among them)
  logits     the same forward with every token's logits (what exact surprise needs)
  surprise   `token_surprise` on those logits (the log-softmax and the pick: the rest of its cost)
  shortlist  `shortlist_surprise` on the probes' hidden states (profile surprise_head: shortlist);
             its cost is this and what the probes add to the body
  emllm      emllm's whole step with the profile's surprise head
  emllm_full the same with surprise_head: full
The two engines read the same stream: how far the shortlist's surprise is from the exact one, and
how many boundaries both place (F1), are printed with the times.
Then the bytes a store grows by per token (its files but the state, measured on disk after
ingesting the same text) and the state that continues it (a sliding layer's window is there),
for the model and for a Llama-shaped model of its size whose every layer is global (random
weights: a store's bytes do not depend on them).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from benchmarks import machine
from emllm import models
from emllm.app import ingest as ing, stream
from emllm.engine.stream import Engine
from emllm.evals.corpus import tokens as corpus_tokens
from emllm.math.surprise import Head, probe_positions, shortlist_surprise, token_surprise


def llama_like(cfg) -> LlamaConfig:
    """A Llama of the hybrid model's shapes (layers, heads, head size, vocabulary), every layer global."""
    return LlamaConfig(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                       num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
                       num_key_value_heads=cfg.num_key_value_heads, vocab_size=cfg.vocab_size,
                       head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
                       max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=True)


def store_bytes_per_token(model, tok, prof, text: str, root: Path, name: str) -> tuple[float, int, int]:
    """(bytes per token of the files that grow with the stream, bytes of the state that continues
    it, layers with memory) of a store that has ingested `text`."""
    path = root / name
    with stream.create_store(path, name, model, tok, prof) as st:
        engine = stream.open_engine(st, model)
        ing.add_documents(st, tok, [("text", text)])
        ing.run_job(st, engine, 8)
        n, layers = st.tokens.rows, len(engine.windows)
    files = [p for p in path.rglob("*") if p.is_file() and not p.name.startswith("job")]
    state = sum(p.stat().st_size for p in files if p.name.startswith("state-"))
    grows = sum(p.stat().st_size for p in files if not p.name.startswith("state-") and p.name != "manifest.json")
    return grows / n, state, layers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", "-m", default="gemma3-270m")
    ap.add_argument("--dtype", default=None, choices=models.DTYPES)
    ap.add_argument("--chunks", type=int, default=6, help="timed chunks of each kind")
    ap.add_argument("--store-tokens", type=int, default=8192, help="tokens each store reads for its bytes per token")
    ap.add_argument("--out", default=None, help="JSON lines, appended")
    a = ap.parse_args()
    src = models.resolve(a.model)
    model, tok = models.load(src, dtype=a.dtype)
    prof = src.profile
    cs = prof.chunk_size
    prefix = prof.n_init + prof.n_local + prof.n_mem
    ids = torch.tensor(corpus_tokens(tok, "prose", prefix + (a.chunks + 1) * cs))
    eng = Engine(model, prof)
    full = Engine(model, prof.replace(surprise_head="full"))
    eng.feed(ids[:prefix])
    full.feed(ids[:prefix])
    lm = model.get_output_embeddings()
    head = Head(lm.weight, lm.bias, getattr(model.config.get_text_config(), "final_logit_softcapping", None))

    def plain(x: torch.Tensor, keep: int | torch.Tensor, hidden: list | None = None) -> torch.Tensor:
        model.set_attn_implementation("sdpa")  # (emllm's step sets its own)
        hook = model.model.register_forward_hook(lambda m, i, o: hidden.append(o[0][0])) if hidden is not None else None
        with torch.no_grad():
            out = model(input_ids=x[None], logits_to_keep=keep).logits[0]
        if hook is not None:
            hook.remove()
        return out

    kinds = ("body", "probes", "logits", "surprise", "shortlist", "emllm", "emllm_full")
    at = probe_positions(cs)
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for i in range(a.chunks + 1):  # the first round untimed (warm-up)
        x = ids[prefix + i * cs : prefix + (i + 1) * cs]
        hidden: list = []
        t = [time.perf_counter()]
        plain(x, 1)
        t.append(time.perf_counter())
        zp = plain(x, at, hidden)
        t.append(time.perf_counter())
        lg = plain(x, 0)
        t.append(time.perf_counter())
        token_surprise(lg, x, lg[-1])
        t.append(time.perf_counter())
        with torch.no_grad():
            shortlist_surprise(hidden[0], x, lg[-1], head, i, at, zp)
        t.append(time.perf_counter())
        eng.step(x)
        t.append(time.perf_counter())
        full.step(x)
        t.append(time.perf_counter())
        if i:
            for k, t0, t1 in zip(kinds, t, t[1:]):
                times[k].append(t1 - t0)
    mean = {k: sum(v) / len(v) for k, v in times.items()}
    head_s = mean["logits"] - mean["body"]  # every token's logits instead of the last one's
    diff = (eng.surprise.view() - full.surprise.view()).abs()[1:]
    fa, fb = full.flags.view(), eng.flags.view()
    row = {"model": a.model, "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
           "machine": machine(torch.get_num_threads()), "chunk": cs,
           "vocab": model.config.vocab_size, "surprise_head": prof.surprise_head,
           **{f"{k}_s": round(v, 3) for k, v in mean.items()},
           "full_head_and_surprise_share_of_full_step": round((head_s + mean["surprise"]) / mean["emllm_full"], 3),
           "shortlist_share_of_step": round((mean["shortlist"] + mean["probes"] - mean["body"]) / mean["emllm"], 3),
           "step_ratio": round(mean["emllm"] / mean["emllm_full"], 3),
           "tokens_compared": int(diff.numel()),
           "surprise_abs_diff_median": round(float(diff.median()), 4), "surprise_abs_diff_p99": round(float(diff.quantile(0.99)), 4),
           "surprise_abs_diff_max": round(float(diff.max()), 4),
           "boundaries_exact": int(fa.sum()), "boundaries_shortlist": int(fb.sum()),
           "boundary_f1": round(2 * int((fa & fb).sum()) / max(1, int(fa.sum() + fb.sum())), 4),
           "events_exact": full.n_events, "events_shortlist": eng.n_events}
    print(json.dumps(row), flush=True)
    n = a.store_tokens
    text = tok.decode(corpus_tokens(tok, "prose", n))
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as tmp:
        mine, mine_state, mine_layers = store_bytes_per_token(model, tok, prof, text, Path(tmp), "hybrid")
        torch.manual_seed(0)
        llama = AutoModelForCausalLM.from_config(llama_like(model.config), dtype=next(model.parameters()).dtype).eval()
        theirs, their_state, their_layers = store_bytes_per_token(llama, tok, prof, text, Path(tmp), "llama")
    store = {"model": a.model, "store_tokens": n, "bytes_per_token": round(mine), "state_bytes": mine_state,
             "layers_with_memory": mine_layers, "llama_bytes_per_token": round(theirs), "llama_state_bytes": their_state,
             "llama_layers_with_memory": their_layers, "ratio": round(mine / theirs, 3)}
    print(json.dumps(store), flush=True)
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps({"run": {"date": time.strftime("%Y-%m-%d %H:%M"), "argv": vars(a)}}) + "\n")
            f.write(json.dumps(row) + "\n")
            f.write(json.dumps(store) + "\n")


if __name__ == "__main__":
    main()
