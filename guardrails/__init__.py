"""Guardrails: typed verdicts, per-model policy, pure detectors, and the input and streaming output rails.

Nothing here imports Ray; the guardrails deployment wraps these pieces. Heavy dependencies (torch,
transformers, scikit-learn) are imported only by the modules that need them.
"""
