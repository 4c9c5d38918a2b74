"""The stream: each layer's window (initial tokens, remainder, local window) and its attention call
(`window`), and the engine that feeds chunks through the patched model, closes events and generates
(`stream`). A layer is given its memory (in RAM, or a store's). May import: math, memory, config,
models."""
