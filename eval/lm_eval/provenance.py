"""What a golden records of its inputs, computed one way for the golden script
(scripts/make_lm_eval_goldens.py) and the check (tests/python/lm_eval_check.py): SHA-256 of
files, keyed by their path from the repository root."""

import hashlib
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent


def sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def rel(path):
    """`path` from the repository root (absolute outside it)."""
    path = pathlib.Path(path).resolve()
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


def file_hashes(directory):
    """SHA-256 of every file under `directory` but caches, keyed by path from the repo root."""
    return {
        rel(p): sha256_of(p)
        for p in sorted(pathlib.Path(directory).resolve().rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }
