"""What a generated answer's tokens attend to in memory (profile answer_retrieval): "question", the
events the question's last chunk retrieved, kept for the whole answer; "token", each token's own
retrieval (the paper's). Checked against the layers' own selections and gathers, and against
"token" where both must give the same bits."""

from __future__ import annotations

import torch

from emllm.engine.stream import Engine
from tests.conftest import tiny_model, tiny_profile


def _read(prof, seed: int = 3) -> tuple[Engine, list]:
    """An engine over a tiny Llama that has read 240 tokens and a question of 6; the listener's
    record of every retrieval (layer, ids)."""
    eng = Engine(tiny_model("llama3.1"), prof)
    heard: list = []
    windows = {w.layer_idx: w for w in eng.windows}
    # (layer, ids, the events there were)
    eng.on_retrieval = lambda layer, sel, q: heard.append((layer, sel.ids.tolist(), len(windows[layer].events)))
    g = torch.Generator().manual_seed(seed)
    eng.feed(torch.randint(0, 300, (240,), generator=g))
    eng.begin_question()
    eng.feed(torch.randint(0, 300, (6,), generator=g))
    return eng, heard


def test_the_answer_attends_to_the_questions_selection_without_retrieving():
    eng, heard = _read(tiny_profile(answer_retrieval="question"))
    asked = {layer: ids for layer, ids, _ in heard[-len(eng.windows):]}  # the question's chunk
    n_question = {layer: n for layer, _, n in heard[-len(eng.windows):]}
    assert all(len(ids) < len(w.events) for w, ids in zip(eng.windows, asked.values()))  # a real choice
    n = len(heard)
    answer = eng.generate(8)
    assert len(answer) == 8 and len(heard) == n  # no token retrieved
    assert all(len(w.events) > n_question[w.layer_idx] for w in eng.windows)  # events closed since
    for w in eng.windows:  # what each layer attends to: the question's events, as gathered
        k, v, valid, closed = w._kept
        # with the events closed while answering (the last step's join at the next one): they left the window
        k, v = torch.cat((k, *(a for a, _ in closed)), 1), torch.cat((v, *(b for _, b in closed)), 1)
        ids = torch.tensor(asked[w.layer_idx] + list(range(n_question[w.layer_idx], len(w.events))))
        want_k, want_v = w.events.gather(ids)
        assert valid is None and torch.equal(k, want_k) and torch.equal(v, want_v)
    # the next chunk of document retrieves again and keeps nothing
    eng.feed(torch.randint(0, 300, (8,)))
    assert len(heard) == n + len(eng.windows) and all(w._kept is None for w in eng.windows)


def test_the_paper_retrieves_at_every_token():
    eng, heard = _read(tiny_profile(answer_retrieval="token"))
    n = len(heard)
    eng.generate(8)
    assert len(heard) == n + 8 * len(eng.windows)
    assert any(ids != heard[n - len(eng.windows) + i % len(eng.windows)][1] for i, (_, ids, _) in enumerate(heard[n:]))


def test_where_every_event_fits_both_give_the_same_bits():
    """A budget larger than the memory: every step selects every event, so the kept selection is
    the one each token would retrieve, and the answers' logits are equal bit for bit."""
    got = {}
    for how in ("question", "token"):
        eng, _ = _read(tiny_profile(answer_retrieval=how, n_mem=4096))
        assert all(w._kept is not None or how == "token" for w in eng.windows)
        logits = []
        for tok in eng.generate_iter(6):
            logits.append(eng.last_logits.clone())
        got[how] = torch.stack(logits)
    assert torch.equal(got["question"], got["token"])


def test_without_a_question_each_token_retrieves():
    """generate after a document alone (no `begin_question`): nothing was kept, the tokens retrieve."""
    eng = Engine(tiny_model("llama3.1"), tiny_profile(answer_retrieval="question"))
    heard: list = []
    eng.on_retrieval = lambda layer, sel, q: heard.append(layer)
    eng.feed(torch.randint(0, 300, (240,), generator=torch.Generator().manual_seed(4)))
    n = len(heard)
    eng.generate(4)
    assert len(heard) == n + 4 * len(eng.windows)


def test_a_restored_engine_forgets_what_was_kept():
    from emllm.engine import window

    eng, _ = _read(tiny_profile(answer_retrieval="question"))
    state = {k: v.clone() for k, v in eng.state_dict().items()}
    eng.windows[0].load_state({k[len("layer0."):]: v for k, v in state.items() if k.startswith("layer0.")})
    assert eng.windows[0]._kept is None and isinstance(eng.windows[0], window.LayerWindow)
