"""One layer's events in RAM and how they are chosen: growing buffers (`buffers`), the retrieval
policy (`selection`: scores, the budget, representative keys, the contiguity buffer), events in
RAM (`events`), the faiss index past a threshold (`index`), the sketch that bounds scores exactly
(`sketch`), and the cache of recently read events (`cache`). May import: math."""
