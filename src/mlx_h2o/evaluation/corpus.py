"""Real English text for evaluation, never bundled with the package.

Default corpus: Debian's python3-doc (reST sources of the Python docs) plus the licence texts in
/usr/share/common-licenses. Where those are absent (macOS, other distros), a portable fallback built
from the docstrings of the Python standard library, with a message saying so.
"""

import glob
import os
import random
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

PYTHON_DOC_GLOB = "/usr/share/doc/python3*/html/_sources/**/*.txt"
LICENSE_DIR = "/usr/share/common-licenses"
# Roughly 3.5 characters per token for English prose with this family of BPE tokenizers: used only
# to skip documents that are clearly too short before tokenizing them.
CHARS_PER_TOKEN_LOWER_BOUND = 2.5


@dataclass
class Corpus:
    name: str
    documents: List[Tuple[str, str]]  # (document id, text)


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read text file {path!r}: {e}") from None


def _debian_corpus() -> Optional[Corpus]:
    # Several python3* doc folders are symlinks to one tree: keep each real file once.
    docs = sorted({os.path.realpath(p) for p in glob.glob(PYTHON_DOC_GLOB, recursive=True)})
    licences = sorted(
        p for p in glob.glob(os.path.join(LICENSE_DIR, "*")) if os.path.isfile(p) and not os.path.islink(p)
    )
    if not docs and not licences:
        return None
    documents = [(p, _read_text(p)) for p in licences + docs]
    parts = []
    if docs:
        parts.append(f"python3-doc ({len(docs)} files)")
    if licences:
        parts.append(f"{LICENSE_DIR} ({len(licences)} files)")
    return Corpus(" + ".join(parts), documents)


def _stdlib_docstring_corpus() -> Corpus:
    """One document per standard-library module that has substantial docstrings."""
    import importlib
    import inspect
    import pkgutil

    documents = []
    for mod in sorted(m.name for m in pkgutil.iter_modules() if not m.name.startswith("_")):
        if mod in ("antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo"):
            continue
        try:
            module = importlib.import_module(mod)
        except Exception:  # any import error just means the module is not usable text
            continue
        if not getattr(module, "__file__", "") or "site-packages" in module.__file__:
            continue
        texts = [inspect.getdoc(module) or ""]
        for _, obj in inspect.getmembers(module):
            if inspect.isfunction(obj) or inspect.isclass(obj):
                texts.append(inspect.getdoc(obj) or "")
        text = "\n\n".join(t for t in texts if t)
        if len(text) > 2000:
            documents.append((f"stdlib:{mod}", text))
    return Corpus(f"standard-library docstrings ({len(documents)} modules; python3-doc not found)", documents)


def load_corpus(files: Optional[Sequence[str]] = None) -> Corpus:
    """User files if given, else the Debian corpus, else the stdlib-docstring fallback."""
    if files:
        documents = []
        for p in files:
            if not os.path.isfile(p):
                raise ValueError(f"text file not found: {p!r}")
            documents.append((p, _read_text(p)))
        return Corpus(f"user files ({len(documents)})", documents)
    return _debian_corpus() or _stdlib_docstring_corpus()


def _source_of(doc_id: str) -> str:
    if doc_id.startswith(LICENSE_DIR):
        return "licences"
    if "/_sources/" in doc_id:
        return "python3-doc"
    return doc_id.split(":")[0] if ":" in doc_id else os.path.dirname(doc_id)


def _documents_in_order(tokenizer, corpus: Corpus, min_tokens: int, seed: int):
    """(document id, all its token ids) for every document with >= `min_tokens` tokens, in a seeded
    order that alternates between the corpus's sources (licences vs. Python docs), so a small
    sample still mixes genres. Deterministic for a given corpus/seed; documents are tokenized as
    they are reached."""
    rng = random.Random(seed)
    candidates = [d for d in corpus.documents if len(d[1]) >= min_tokens * CHARS_PER_TOKEN_LOWER_BOUND]
    rng.shuffle(candidates)
    by_source = {}
    for doc in candidates:
        by_source.setdefault(_source_of(doc[0]), []).append(doc)
    queues = [by_source[k] for k in sorted(by_source)]
    while any(queues):
        for q in queues:
            while q:
                name, text = q.pop()
                ids = tokenizer.encode(text)
                if len(ids) >= min_tokens:
                    yield name, list(ids)
                    break


def token_samples(
    tokenizer, corpus: Corpus, n_samples: int, length: int, seed: int = 0
) -> List[Tuple[str, List[int]]]:
    """`n_samples` token sequences of exactly `length` tokens (each document's first ones), each from
    a different document, in the seeded round-robin order of `_documents_in_order`."""
    if n_samples < 1:
        raise ValueError(f"n_samples must be >= 1, got {n_samples}")
    if length < 2:
        raise ValueError(f"length must be >= 2 tokens, got {length}")
    samples = []
    for name, ids in _documents_in_order(tokenizer, corpus, length, seed):
        samples.append((name, ids[:length]))
        if len(samples) == n_samples:
            return samples
    raise ValueError(
        f"only {len(samples)} documents of {corpus.name} have >= {length} tokens; "
        f"need n_samples={n_samples}: lower n_samples or the length, or give more text files"
    )


# Disjoint document sets (tuning vs held-out text). Set k is documents [k * SET_DOCS, (k + 1) *
# SET_DOCS) of the seeded order of documents with >= SET_MIN_TOKENS tokens, so membership does not
# depend on the sample length, and set 0's first four documents are the samples of
# `token_samples(n_samples=4, length=2048)` (the documents earlier results were measured on).
SET_DOCS = 8
SET_MIN_TOKENS = 2048
N_SETS = 3


def document_set(tokenizer, corpus: Corpus, index: int, seed: int = 0) -> List[Tuple[str, List[int]]]:
    """The SET_DOCS documents of set `index` (0-based): (document id, all its tokens), each with at
    least SET_MIN_TOKENS tokens. Sets with different indices share no document."""
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"doc set index must be an integer >= 0, got {index!r}")
    docs = []
    for doc in _documents_in_order(tokenizer, corpus, SET_MIN_TOKENS, seed):
        docs.append(doc)
        if len(docs) == (index + 1) * SET_DOCS:
            return docs[index * SET_DOCS :]
    raise ValueError(
        f"{corpus.name} has {len(docs)} documents of >= {SET_MIN_TOKENS} tokens: too few for doc set {index} "
        f"({SET_DOCS} documents per set)"
    )


def set_samples(tokenizer, corpus: Corpus, index: int, n_samples: int, length: int, seed: int = 0):
    """`n_samples` samples of `length` tokens from the first documents of set `index`."""
    if not 1 <= n_samples <= SET_DOCS:
        raise ValueError(f"n_samples must be in [1, {SET_DOCS}] with a doc set, got {n_samples}")
    if not 2 <= length <= SET_MIN_TOKENS:
        raise ValueError(f"length must be in [2, {SET_MIN_TOKENS}] with a doc set, got {length}")
    return [(name, ids[:length]) for name, ids in document_set(tokenizer, corpus, index, seed)[:n_samples]]
