"""Profiles validate on load; model resolution never downloads and says what is missing."""

from __future__ import annotations

from pathlib import Path

import pytest

from emllm.config import ProfileError, builtin_profile_names, load_profile, load_profile_file
from emllm.models import ModelNotFoundError, guess_profile, resolve


def test_builtin_profiles_load_with_spec_values():
    assert {"smollm2", "llama3.1", "llama3", "mistral", "phi3", "phi3.5", "qwen2.5"} <= set(builtin_profile_names())
    m = load_profile("mistral")
    assert (m.n_local, m.n_mem, m.max_block, m.gamma, m.segmentation, m.contiguity) == (4096, 2048, 128, 1.0, "SM", True)
    p = load_profile("phi3.5")
    assert (p.n_local, p.n_mem, p.max_block) == (1024, 3072, 64)
    assert load_profile("llama3").gamma == 2.0
    assert load_profile("llama3.1").surprise_window == 4096 - 512


@pytest.mark.parametrize("body, msg", [
    ("n_local: 4096\nwindow: 3\n", "unknown key 'window'"),
    ("n_local: -5\n", "n_local: must be an integer >= 1"),
    ("segmentation: XYZ\n", "segmentation: must be one of"),
    ("gamma: high\n", "gamma: must be a number"),
    ("min_block: 200\n", "min_block"),
    ("- a\n- b\n", "expected a mapping"),
    ("n_local: [\n", "not valid YAML"),
])
def test_bad_profiles_are_clear_errors(tmp_path, body, msg):
    f = tmp_path / "mine.yaml"
    f.write_text(body)
    with pytest.raises(ProfileError, match=msg):
        load_profile_file(f)


def test_unknown_profile_name():
    with pytest.raises(ProfileError, match="unknown profile 'nope'"):
        load_profile("nope")


def test_models_not_on_machine_are_clear_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    with pytest.raises(ModelNotFoundError, match="never downloads"):
        resolve("llama3.1")
    with pytest.raises(ModelNotFoundError, match="never downloads"):
        resolve("someone/some-model")
    with pytest.raises(ModelNotFoundError, match="unknown model"):
        resolve("not a model")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve(str(tmp_path / "empty"))


def test_guess_profile():
    assert guess_profile({"model_type": "llama", "rope_parameters": {"rope_type": "llama3"}}) == "llama3.1"
    assert guess_profile({"model_type": "phi3", "rope_parameters": {"rope_type": "longrope"}}) == "phi3.5"
    assert guess_profile({"model_type": "qwen2"}) == "qwen2.5"
    assert guess_profile({"model_type": "gemma3_text"}) == guess_profile({"model_type": "gemma2"}) == "gemma3-270m"


def test_faiss_and_sketch_thresholds_are_separate_keys_and_old_profiles_keep_their_meaning(tmp_path):
    from emllm.config import load_profile_file, profile_from_dict

    old = tmp_path / "old.yaml"
    old.write_text("faiss_threshold: 40\n")  # written when one key governed both
    assert load_profile_file(old).sketch_threshold == 40 == load_profile_file(old).faiss_threshold
    both = tmp_path / "both.yaml"
    both.write_text("faiss_threshold: 40\nsketch_threshold: null\n")
    p = load_profile_file(both)
    assert (p.faiss_threshold, p.sketch_threshold) == (40, None)
    stored = {"name": "t", "faiss_threshold": 7}  # a store's profile from before the split
    assert profile_from_dict(stored, "t").sketch_threshold == 7
    unset = tmp_path / "unset.yaml"  # neither key: retrieval in RAM exact, stores sketched from 20,000
    unset.write_text("n_mem: 1024\n")
    assert (load_profile_file(unset).faiss_threshold, load_profile_file(unset).sketch_threshold) == (None, 20000)
    for name in builtin_profile_names():  # the graph missed the 256k passkey: no profile turns it on
        assert (load_profile(name).faiss_threshold, load_profile(name).sketch_threshold) == (None, 20000), name
    bad = tmp_path / "bad.yaml"
    bad.write_text("sketch_threshold: 0\n")
    with pytest.raises(Exception, match="sketch_threshold"):
        load_profile_file(bad)


def test_the_default_model_and_emllm_model(monkeypatch):
    from emllm.models import DEFAULT_MODEL, default_model

    monkeypatch.delenv("EMLLM_MODEL", raising=False)
    assert default_model() == DEFAULT_MODEL == "qwen2.5-coder-0.5b"
    assert load_profile(DEFAULT_MODEL).model == "embedded:qwen2.5-coder-0.5b"
    monkeypatch.setenv("EMLLM_MODEL", "")  # empty: unset
    assert default_model() == DEFAULT_MODEL
    monkeypatch.setenv("EMLLM_MODEL", "smollm2")
    assert resolve().name == "smollm2" and resolve("qwen2.5-coder-0.5b").name == "qwen2.5-coder-0.5b"
    monkeypatch.setenv("EMLLM_MODEL", "no such model")
    with pytest.raises(ModelNotFoundError, match=r"unknown model 'no such model' \(from \$EMLLM_MODEL\)"):
        resolve()


def test_every_profile_key_has_a_rule_and_the_rule_refuses_what_it_must():
    """Validation is declared per field (`Rule`): every key has one, and every kind refuses values
    of the wrong type, out of its bounds, or NaN, naming the key; the built-in profiles pass."""
    import dataclasses

    from emllm.config import Profile, ProfileError, builtin_profile_names, load_profile

    base = load_profile("smollm2")
    wrong = {"int": ["x", 1.5, True, -1, 1 << 30], "number": ["x", float("nan"), True, None], "bool": ["yes", 1, None],
             "choice": ["nope", None], "text": [3, None], "texts": ["a", [1]]}
    for f in dataclasses.fields(Profile):
        rule = f.metadata["rule"]
        values = list(wrong[rule.kind]) + ([rule.hi + 1] if rule.kind == "number" and rule.hi is not None else [])
        for v in values:
            if v is None and rule.null:
                continue
            with pytest.raises(ProfileError, match=rf": {f.name}: must"):
                base.replace(**{f.name: v})
    assert [load_profile(n).name for n in builtin_profile_names()] == builtin_profile_names()
    with pytest.raises(ProfileError, match="chunk_size"):
        base.replace(chunk_size=base.n_local + 1)


def test_ollama_models_are_found_by_their_manifest(tmp_path, monkeypatch):
    """`-m ollama:NAME[:TAG]`: the GGUF blob that ollama's manifest names (under $OLLAMA_MODELS),
    converted as any GGUF file is; what ollama lacks, or a manifest that names no sha256 blob, is
    one clear line."""
    import json

    from emllm import models

    root = tmp_path / "ollama"
    monkeypatch.setenv("OLLAMA_MODELS", str(root))

    def pulled(where: str, tag: str, digest: str) -> None:
        m = root / "manifests" / where / tag
        m.parent.mkdir(parents=True, exist_ok=True)
        m.write_text(json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.license", "digest": "sha256:" + "0" * 64},
                                            {"mediaType": "application/vnd.ollama.image.model", "digest": digest}]}))
        (root / "blobs").mkdir(exist_ok=True)
        if digest.startswith("sha256:"):
            (root / "blobs" / digest.replace(":", "-")).write_bytes(b"GGUF")

    pulled("registry.ollama.ai/library/llama3.2", "latest", "sha256:" + "a" * 64)
    pulled("registry.ollama.ai/library/llama3.2", "1b", "sha256:" + "b" * 64)
    pulled("registry.ollama.ai/me/tiny", "q4", "sha256:" + "c" * 64)
    assert models.ollama_blob("llama3.2") == root / "blobs" / ("sha256-" + "a" * 64)
    assert models.ollama_blob("llama3.2:1b") == root / "blobs" / ("sha256-" + "b" * 64)
    assert models.ollama_blob("me/tiny:q4") == root / "blobs" / ("sha256-" + "c" * 64)
    converted: list = []
    monkeypatch.setattr(models, "gguf_folder", lambda path, log=None: converted.append(path) or Path("/nowhere"))
    with pytest.raises(ModelNotFoundError, match="no config.json|cannot read"):  # (the stand-in folder has none)
        resolve("ollama:llama3.2:1b")
    assert converted == [root / "blobs" / ("sha256-" + "b" * 64)]
    with pytest.raises(ModelNotFoundError, match=r"ollama has no model 'qwen3' .*emllm never downloads: ollama pull qwen3"):
        models.ollama_blob("qwen3")
    for bad in ("../x", "a/b/c/d", ""):
        with pytest.raises(ModelNotFoundError, match="not an ollama model name"):
            models.ollama_blob(bad)
    pulled("registry.ollama.ai/library/odd", "latest", "../../../etc/passwd")
    with pytest.raises(ModelNotFoundError, match="is not a sha256"):
        models.ollama_blob("odd")
    (root / "blobs" / ("sha256-" + "a" * 64)).unlink()
    with pytest.raises(ModelNotFoundError, match="which is missing: ollama pull llama3.2"):
        models.ollama_blob("llama3.2")
    (root / "manifests" / "registry.ollama.ai/library/llama3.2/latest").write_text("not json")
    with pytest.raises(ModelNotFoundError, match="not an ollama manifest with a model layer"):
        models.ollama_blob("llama3.2")


def test_a_profile_file_sets_its_keys_over_the_models_own_profile(tmp_path):
    """`-p tweak.yaml` that sets n_local keeps the rest of the model's profile (the alias's, or the
    family's for a folder): it used to take Profile's defaults for every key it left out (n_mem 2048
    where SmolLM2's is 1024, contiguity off where Mistral's is on). A built-in name replaces whole."""
    import json

    tweak = tmp_path / "tweak.yaml"
    tweak.write_text("n_local: 512\ngamma: 1.5\n")
    own = load_profile("smollm2")
    p = resolve("smollm2", str(tweak)).profile
    assert (p.name, p.n_local, p.gamma, p.aliases) == ("tweak", 512, 1.5, ())
    assert p == own.replace(name="tweak", n_local=512, gamma=1.5, aliases=())
    assert load_profile_file(tweak) != p and load_profile_file(tweak).n_mem == 2048  # (no base: Profile's defaults)
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "mistral"}))
    q = resolve(str(folder), str(tweak)).profile
    assert q == load_profile("mistral").replace(name="tweak", n_local=512, gamma=1.5, aliases=()) and q.contiguity
    assert resolve("smollm2", "mistral").profile == load_profile("mistral")  # a built-in: whole
    too_small = tmp_path / "small.yaml"
    too_small.write_text("n_local: 256\n")  # (the model's chunk of 512 does not fit it: said, naming the file)
    with pytest.raises(ProfileError, match=r"small.*chunk_size: \(512\) must not exceed n_local \(256\)"):
        resolve("smollm2", str(too_small))
