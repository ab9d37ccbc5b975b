"""Tests of the Ray-free retrieval core."""
