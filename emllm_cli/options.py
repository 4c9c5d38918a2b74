"""Options shared by several commands."""

from __future__ import annotations

import typer

ModelOpt = typer.Option(
    None, "--model", "-m",
    help="A model alias (embedded: qwen2.5-coder-0.5b, qwen2.5-coder-1.5b, smollm2, gemma3-270m; from the HF cache: llama3.1, "
    "llama3, mistral, phi3, phi3.5, qwen2.5), a local model folder, a GGUF file (converted once), a model ollama has "
    "pulled (ollama:llama3.2), or a hub id already in the HF cache. "
    "Default: $EMLLM_MODEL, else qwen2.5-coder-0.5b (embedded).",
)
StoreModelOpt = typer.Option(
    None, "--model", "-m",
    help="The store's model where it no longer is where the store says (a model folder or GGUF file moved): its "
    "new path or name, checked against the weights the store was written with. Default: the store's.",
)
ProfileOpt = typer.Option(None, "--profile", "-p", help="A built-in profile's name (replaces the model's), or a .yaml file of keys set over the model's profile; default: the model's.")


def _dtype(value: str | None) -> str | None:
    if value is not None and value not in ("auto", "float32", "bfloat16"):
        raise typer.BadParameter(f"{value!r} is not one of auto, float32, bfloat16")
    return value


KV_FORMATS = ("auto", "float32", "bfloat16", "int8", "int4")


def _kv_format(value: str | None) -> str | None:
    if value is not None and value not in KV_FORMATS:
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(KV_FORMATS)}")
    return value


FormatOpt = typer.Option(
    None, "--format", callback=_kv_format, metavar="auto|float32|bfloat16|int8|int4",
    help="How a new store keeps keys and values: auto (the compute dtype: lossless, bfloat16 halves "
    "float32), int8 (about a quarter of float32's disk), int4 (about a sixth); integer formats quantise each token in "
    "groups of 32 channels with their scales, keys after a per-channel centre and scale fitted on the "
    "store's first tokens. Fixed when the store is created.",
)
DtypeOpt = typer.Option(
    None, "--dtype", callback=_dtype, metavar="auto|float32|bfloat16",
    help="Compute dtype: auto (bfloat16 where the processor computes it natively: CUDA, AVX-512 BF16 or AMX; "
    "else float32), float32, bfloat16. Default: the profile's (auto). A store keeps the dtype it was made in.",
)

# Sampling, shared by ask and chat (`emllm.sampling`; unset: the model's generation config).
TemperatureOpt = typer.Option(None, "--temperature", min=0.0, help="Sample at this temperature (0: greedy). Default: the model's generation config, else greedy.")
TopPOpt = typer.Option(None, "--top-p", min=0.0, max=1.0, help="Sample from the smallest set of tokens holding this probability.")
TopKOpt = typer.Option(None, "--top-k", min=0, help="Sample from the k likeliest tokens (0: all).")
RepetitionPenaltyOpt = typer.Option(None, "--repetition-penalty", min=0.0, help="Divide the score of tokens already in the question or the answer (1: none; 1.1-1.3 stops loops).")
SeedOpt = typer.Option(None, "--seed", help="Seed of the sampling: the same seed, the same answer.")
StopOpt = typer.Option(None, "--stop", help="End the answer before this text (repeatable).")


def sampling_of(model, temperature, top_p, top_k, repetition_penalty, seed):  # type: ignore[no-untyped-def]
    """The sampling the options ask for (a bad combination: one line, exit 1, as the library's errors)."""
    import emllm

    return emllm.sampling(model, temperature=temperature, top_p=top_p, top_k=top_k,
                          repetition_penalty=repetition_penalty, seed=seed)
