"""Where emllm keeps its state: converted models and stores, under one home directory."""

from __future__ import annotations

import os
from pathlib import Path


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
