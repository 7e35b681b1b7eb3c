"""The size-or-timeout batcher for fixed-shape models, usable as a library: `flusher.Flusher`
(exported as `batcher.Batcher`) flushes at N items or after T ms and answers request-ID futures;
`embeddings` serves an embedding model through it."""
