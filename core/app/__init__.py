"""Use cases over a store with its model: opening a stream on a store (`stream`), ingesting
documents (`ingest`), asking (`ask`; re-reading what the memory chose: `reread`), tracing retrieval (`trace`) and reporting it (`report`),
segmenting a document (`document`), reading input as a stream (`textinput`), a folder's files as a code base (`folders`), and the library's
handle, `Memory` (`api`). May import: engine, store, memory, math, config, models, home."""
