"""One layer's events in RAM and how they are chosen: growing buffers (`buffers`), the retrieval
policy (`selection`: scores, the budget, representative keys, the contiguity buffer), events in
RAM (`events`), the faiss index past a threshold (`index`), the sketch that bounds scores exactly
(`sketch`), the cache of recently read events (`cache`), and the passages a re-read answer
takes, by the layers' votes (`passages`). May import: math, config."""
