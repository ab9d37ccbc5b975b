"""Pure detectors: no Ray, no model loading; embeddings are passed in by the caller."""
