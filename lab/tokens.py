"""
The text's token cache, keyed by the text's content, so that a later run reads the ids instead of
tokenizing again (tasks.TextData: cl100k BPE, the vocabulary compacted to the ids that occur).
"""

if __name__ == "__main__":  # no script: one line saying what to run (first: by its path the project is not importable)
    import sys
    print("lab/tokens.py is no script: run python train_tiny.py", file=sys.stderr)
    sys.exit(2)

import hashlib
import sys
from pathlib import Path

import numpy as np

from lab.files import atomic


def token_digest(tokens, vocab):
    return hashlib.sha256(tokens.tobytes() + vocab.tobytes()).digest()


def text_key(text):
    return hashlib.sha256(text.encode()).hexdigest()


class TokenCaches:
    """A folder of token caches, one file per text, named by its tag and its content
    (tasks.load_text's `caches`)."""

    def __init__(self, folder):
        self.folder = Path(folder)

    def cache(self, text, tag):
        return TokenCache(self.folder / f"{tag}_cl100k_{text_key(text)[:12]}.npz")


class TokenCache:
    """One text's token cache (tasks.TextData's `cache`): the ids, the vocabulary, their sha256 and
    the text's, in one .npz file written whole or not at all."""

    def __init__(self, path):
        self.path = Path(path)

    def read(self, text):
        """(vocab, tokens) if the file holds this text's intact, else None (tokenize again)."""
        return read_token_cache(self.path, text) if self.path.exists() else None

    def write(self, text, vocab, tokens):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        digest = np.frombuffer(token_digest(tokens, vocab), dtype=np.uint8)
        atomic(self.path, lambda f: np.savez(f, tokens=tokens, vocab=vocab, sha256=digest, text=np.array(text_key(text))))


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
