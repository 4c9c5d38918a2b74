"""Evaluation, outside the engine's import graph: the passkey grid (`passkey`) and its scratch and
kept stores (`scratch`), RULER-style generators (`ruler`), the retrieval baseline (`rag`), and
crash-safe result logs (`results_log`). May import every layer; none imports it."""
