"""
What a run writes and reads back: every file through `atomic` (a killed run never leaves half a
file), checkpoints that resume exactly (trainer.train saves and resumes through them), and the
finished rows (rows.json: a (suite, seed) whose rows are saved is not trained again). Each file
carries the sha256 of its contents and what it belongs to, checked on reading.
"""

if __name__ == "__main__":  # no script: one line saying what to run (first: by its path the project is not importable)
    import sys
    print("lab/files.py is no script: run python train_tiny.py", file=sys.stderr)
    sys.exit(2)

import hashlib
import io
import json
import os
import re
from dataclasses import asdict
from pathlib import Path

import torch


def atomic(path, write):
    """Write through a temporary file and rename: a killed run never leaves half a file."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # one per process: DDP ranks may race
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except OSError as e:  # a full disk, no permission: the error names the file being written
        tmp.unlink(missing_ok=True)
        if e.filename is None or str(e.filename) == str(tmp):
            raise OSError(e.errno, e.strerror or str(e), str(path)) from e
        raise
    except BaseException:  # a kill, a Ctrl-C: no half-written .tmp stays behind
        tmp.unlink(missing_ok=True)
        raise


# -----------------------------------------------------------------------------
# Checkpoints


def checkpoint_path(ctx, name, seed):
    """An arm's checkpoint: its name as a file name ("hd/n=2 continued" -> "hd_n_2_continued"); the
    checkpoint names its arm too, so two arms meeting in one file name are caught on loading."""
    return ctx.run_dir / "ckpt" / f"{re.sub(r'[^A-Za-z0-9]+', '_', name).strip('_')}_s{seed}.pt"


def save_checkpoint(ckpt, model, opts, done, losses, meta):
    """The state after step `done`, what it belongs to (meta) and the config that rebuilds its model
    (nanoGPT's model_args: sample.py reads it), after the sha256 of its bytes (the trainer has
    checked that the weights are finite)."""
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    write_checkpoint(ckpt, {"model": model.state_dict(), "opts": [o.state_dict() for o in opts], "iter": done,
                            "losses": losses, "meta": meta, "config": asdict(model.cfg)})


def write_checkpoint(ckpt, state):
    """A state as a checkpoint file: the sha256 of its bytes, a newline, its bytes (torch.save)."""
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getvalue()
    atomic(ckpt, lambda f: f.write(hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload))


def load_checkpoint(ckpt, dev="cpu"):
    """A checkpoint's state, after checking the sha256 of its bytes (written by save_checkpoint)."""
    raw = ckpt.read_bytes()
    digest, payload = raw[:64], raw[65:]
    if hashlib.sha256(payload).hexdigest().encode() != digest:
        raise SystemExit(f"error: checkpoint {ckpt} is damaged (its checksum does not match its contents); "
                         f"delete it to train this arm again, or run with --fresh")
    try:
        return torch.load(io.BytesIO(payload), map_location=dev, weights_only=False)
    except Exception as e:
        raise SystemExit(f"error: checkpoint {ckpt} cannot be read ({type(e).__name__}); delete it to train "
                         f"this arm again, or run with --fresh")


def resume(ckpt, model, opts, dev, meta):
    """A checkpoint loaded into model and optimizers, if one exists: (first step, losses so far);
    it must be this arm's, intact and finite."""
    if not ckpt.exists():
        return 0, []
    state = load_checkpoint(ckpt, dev)
    fix = "delete it to train this arm again, or run with --fresh"
    if state.get("meta") != meta or not 0 < state.get("iter", 0) <= meta["iters"]:
        raise SystemExit(f"error: checkpoint {ckpt} holds {state.get('meta')} at step {state.get('iter')}, "
                         f"not {meta}; {fix}")
    try:
        model.load_state_dict(state["model"])
        for o, s in zip(opts, state["opts"]):
            o.load_state_dict(s)
    except Exception as e:
        raise SystemExit(f"error: checkpoint {ckpt} cannot be resumed ({type(e).__name__}); {fix}")
    if not all(torch.isfinite(t).all() for t in state["model"].values() if t.is_floating_point()):
        raise SystemExit(f"error: checkpoint {ckpt} holds non-finite weights; {fix}")
    return state["iter"], state["losses"]


class Checkpoints:
    """A stage's checkpoints as the trainer keeps them (trainer.Context.checkpoints, given by
    lab/runner.py): the functions above. An object, not this module, so that a context pickles."""
    checkpoint_path, resume, save_checkpoint = map(staticmethod, (checkpoint_path, resume, save_checkpoint))



# -----------------------------------------------------------------------------
# The finished rows of a run


ROW_KEYS = {"suite", "effect", "effect_id", "paper", "arm", "arm_id", "metric", "seed", "value"}


def rows_digest(rows):
    return hashlib.sha256(json.dumps(rows, indent=1).encode()).hexdigest()


def save_rows(path, rows, key):
    """The finished rows, with the run's key and the sha256 load_rows checks."""
    doc = {"run": key, "sha256": rows_digest(rows), "rows": rows}
    atomic(path, lambda f: f.write(json.dumps(doc, indent=1).encode()))


def load_rows(path, key):
    """The finished rows of run `key`, or one line if the file was changed or is another run's."""
    if not path.exists():
        return []
    try:
        doc = json.loads(path.read_text())
        rows = doc["rows"]
        ok = doc["sha256"] == rows_digest(rows) and all(isinstance(r, dict) and r.keys() == ROW_KEYS for r in rows)
    except (ValueError, KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise SystemExit(f"error: {path} is damaged (unreadable, or its checksum does not match); delete it "
                         f"(the checkpoints beside it are reused), or run with --fresh")
    if doc.get("run") != key:
        raise SystemExit(f"error: {path} holds the rows of run {doc.get('run')}, not of this run ({key}); delete "
                         f"it, or run with --fresh")
    return rows
