"""Where emllm keeps its state: converted models and stores, under one home directory."""

from __future__ import annotations

import os
import re
from pathlib import Path

_UNSAFE = re.compile(r"[^\w.-]+")  # \w: letters and digits of any script, and "_"


def home() -> Path:
    """$EMLLM_HOME, else $XDG_DATA_HOME/emllm, else ~/.local/share/emllm (not created here)."""
    if os.environ.get("EMLLM_HOME"):
        return Path(os.environ["EMLLM_HOME"]).expanduser()
    xdg = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(xdg) / "emllm"


def models_dir() -> Path:
    """Converted models; $EMLLM_MODELS overrides, so tests with a throwaway home share one copy."""
    if os.environ.get("EMLLM_MODELS"):
        return Path(os.environ["EMLLM_MODELS"]).expanduser()
    return home() / "models"


def stores_dir() -> Path:
    return home() / "stores"


def store_name_for(document: str) -> str:
    """The name of the store a document makes when none is given: its file name without the
    extension, keeping letters, digits, "_", "." and "-" (any other run becomes "-": no control
    characters or markup reach a terminal or a path), never starting with a dot."""
    name = _UNSAFE.sub("-", Path(document).stem).strip("-.")
    return name or "document"
