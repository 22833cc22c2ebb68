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


def token_samples(
    tokenizer, corpus: Corpus, n_samples: int, length: int, seed: int = 0
) -> List[Tuple[str, List[int]]]:
    """`n_samples` token sequences of exactly `length` tokens, each from a different document.

    Documents are drawn in a seeded order that alternates between the corpus's sources (licences
    vs. Python docs), so a small sample still mixes genres. Deterministic for a given corpus/seed.
    """
    if n_samples < 1:
        raise ValueError(f"n_samples must be >= 1, got {n_samples}")
    if length < 2:
        raise ValueError(f"length must be >= 2 tokens, got {length}")
    rng = random.Random(seed)
    candidates = [d for d in corpus.documents if len(d[1]) >= length * CHARS_PER_TOKEN_LOWER_BOUND]
    rng.shuffle(candidates)
    # Round-robin over sources (licences, Python docs, ...) so a small sample still mixes genres.
    by_source = {}
    for doc in candidates:
        by_source.setdefault(_source_of(doc[0]), []).append(doc)
    queues = [by_source[k] for k in sorted(by_source)]
    samples = []
    while any(queues):
        for q in queues:
            while q:
                name, text = q.pop()
                ids = tokenizer.encode(text)
                if len(ids) >= length:
                    samples.append((name, list(ids[:length])))
                    break
            if len(samples) == n_samples:
                return samples
    raise ValueError(
        f"only {len(samples)} documents of {corpus.name} have >= {length} tokens; "
        f"need n_samples={n_samples}: lower n_samples or the length, or give more text files"
    )
