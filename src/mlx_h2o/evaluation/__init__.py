"""Measurement harness: perplexity through a cache, decode speed and memory, corpora, reports."""

from .corpus import Corpus, load_corpus, token_samples
from .memory import kv_bytes, memory_snapshot, resident_bytes
from .perplexity import autoregressive_nll, teacher_forced_nll
from .speed import decode_benchmark, decode_step_times

__all__ = [
    "Corpus",
    "autoregressive_nll",
    "decode_benchmark",
    "decode_step_times",
    "kv_bytes",
    "load_corpus",
    "memory_snapshot",
    "resident_bytes",
    "teacher_forced_nll",
    "token_samples",
]
