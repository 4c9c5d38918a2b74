"""`emllm serve`: the OpenAI-compatible HTTP API over the stores, each answered by its own model."""

from __future__ import annotations

import ipaddress
import os

import typer

from . import render
from .errors import UserError, guarded
from .options import DtypeOpt, ModelOpt, ProfileOpt


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _warm_newest_store(pool, log) -> bool:
    """Open the store written last with its model, as its first request would: with no model
    named, the one a server is likeliest to be asked for, and no other model loaded (or converted)
    first only to be unloaded. False where there is no store it can open (said in a line)."""
    import emllm

    newest = next((s for s in emllm.list_stores() if s["status"] != "damaged"), None)
    if newest is None:
        return False
    try:
        with render.status(f"loading the model of {render.shown(newest['name'])}"):
            pool.memory(newest["path"])
    except emllm.EmllmError as e:
        log(f"store {newest['name']}: {e}; loading {emllm.default_model()}")
        return False
    return True


@guarded
def serve(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind; other than loopback only with an API key."),
    port: int = typer.Option(8080, "--port", min=1, max=65535, help="Port to listen on."),
    api_key: str = typer.Option(None, "--api-key", envvar="EMLLM_API_KEY", help="Require 'Authorization: Bearer KEY' (or set EMLLM_API_KEY)."),
    model: str = ModelOpt,
    profile: str = ProfileOpt,
    dtype: str = DtypeOpt,
    max_tokens: int = typer.Option(2048, "--max-tokens", min=1, help="The most tokens a request may ask for."),
    max_models: int = typer.Option(1, "--max-models", min=1, help="Models kept loaded at once. A request for a store of a model not loaded loads it (in the store's dtype), unloading the one used least recently first: more keeps stores of several models answering without reloading, at the memory of each."),
    max_stores: int = typer.Option(4, "--max-stores", min=1, help="Stores kept open between requests, the least recently used closed first: an open store answers its next request without reading its window again, at the memory of that window and a few open files a layer."),
    reread: bool = typer.Option(None, "--reread/--no-reread", show_default=False, help="Answer requests that do not say otherwise as `emllm ask` does, re-reading the passages the memory chose (a request's \"reread\": true or false decides for itself). Default (emllm.REREAD_CONVERSATION): emllm's own reading, which follows a conversation's last turns in its window; --reread suits questions about a document."),
) -> None:
    """Serve the stores under the emllm home through an OpenAI-compatible API: a request names a
    store as its model; its messages (/v1/chat/completions), or its prompt as it is
    (/v1/completions, a base model's form), continue that store's memory (on a copy, unless the
    request sets "remember": true). Each store is answered by the model it was written with: -m (with
    --profile, --dtype) is loaded at start, else the model of the store written last (with the
    store; the default model where there is none), another store's model when a request first
    needs it.

    Examples:

    \b
      emllm serve                                  # http://127.0.0.1:8080/v1, the newest store's model loaded
      emllm serve --host 0.0.0.0 --api-key secret  # reachable from other machines, with a key
      emllm serve --reread                         # answers re-read, as `emllm ask` gives them
      emllm serve -m smollm2 --max-models 2        # SmolLM2 loaded at start; two models kept loaded
      curl localhost:8080/v1/chat/completions -d '{"model": "book", "messages": [{"role": "user", "content": "who hid the key?"}]}'
      curl localhost:8080/v1/completions -d '{"model": "book", "prompt": "The key was hidden by", "max_tokens": 8}'
    """
    if not _loopback(host) and not api_key:
        raise UserError(f"--host {host} is reachable from other machines: give --api-key (or EMLLM_API_KEY)")
    import uvicorn

    import emllm
    from emllm.serve.api import Server, create_app

    log = lambda m: render.err.print(f"[dim]{render.shown(m)}[/dim]")  # noqa: E731
    pool = emllm.ModelPool(max_models, log, max_stores=max_stores)
    if not (model or profile or dtype or os.environ.get("EMLLM_MODEL")) and _warm_newest_store(pool, log):
        loaded = pool.models[-1]
    else:
        with render.status(f"loading {render.shown(model or emllm.default_model())}"):
            loaded = emllm.load(model, profile, dtype, log)
        pool.add(loaded)
    root = emllm.stores_dir()
    server = Server(root, pool, max_tokens=max_tokens, api_key=api_key, reread=reread)
    render.err.print(f"serving the stores under {render.shown(root)} at http://{host}:{port}/v1 "
                     f"(model {render.shown(loaded.given or loaded.name)} loaded; up to {max_models} at once"
                     f"{', API key required' if api_key else ''}); Ctrl-C stops")
    os.environ.setdefault("UVICORN_NO_COLOR", "1")
    uvicorn.run(create_app(server), host=host, port=port, log_level="warning")
