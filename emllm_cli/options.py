"""Options shared by several commands."""

from __future__ import annotations

import typer

ModelOpt = typer.Option(
    None, "--model", "-m",
    help="Profile alias (smollm2, llama3.1, llama3, mistral, phi3, phi3.5, qwen2.5), a local model folder, "
    "or a hub id already in the HF cache. Default: smollm2 (embedded).",
)
ProfileOpt = typer.Option(None, "--profile", "-p", help="Built-in profile name or a .yaml file; default: the model's.")
