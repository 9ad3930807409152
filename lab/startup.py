"""
A process's first moments, before torch imports (the entry scripts, train_tiny.py, sample.py and
bench.py, call `guard` first thing; a --jobs process reaches it too, as it imports what it runs):
the run's Ctrl-C means "nothing was run" only while it is true, and a --jobs process ends itself
when the run that started it dies. Importing this file loads nothing that takes time (os and sys are
loaded with the interpreter, signal is a few lines over a built-in): the handler is in place ~1 ms
after the interpreter's own start-up, which no script can shorten.
"""

if __name__ == "__main__":  # no script: one line saying what to run (first: by its path the project is not importable)
    import sys
    print("lab/startup.py is no script: run python train_tiny.py", file=sys.stderr)
    sys.exit(2)

import os
import signal
import sys

WATCHING = []  # the watch thread, once started


def guard(name):
    """In the run's own process (`name` "__main__"): Ctrl-C ends it at once with one line and 130.
    In a --jobs process (multiprocessing names it; its imports are this moment): it watches its parent."""
    if name == "__main__":
        signal.signal(signal.SIGINT, interrupted_during_start_up)
        threads_from_env()
    elif "multiprocessing" in sys.modules and sys.modules["multiprocessing"].current_process().name != "MainProcess":
        end_with_parent()  # a spawned process has multiprocessing loaded before it imports anything of ours


def threads_from_env(quiet=False):
    """An empty or invalid OMP_NUM_THREADS reads as unset: dropped from the environment before torch
    loads libgomp (which would warn in this process's stderr and every child's); the run sets its own
    threads (--threads). A value that is not empty gets one line saying so, unless quiet."""
    value = os.environ.get("OMP_NUM_THREADS")
    if value is None or all(x.strip().isdigit() and 0 < int(x) < 2**31 for x in value.split(",")):
        return
    del os.environ["OMP_NUM_THREADS"]
    if value.strip() and not quiet:
        os.write(2, f"note: OMP_NUM_THREADS={value!r} is not a thread count; read as unset\n".encode(errors="replace"))


def interrupted_during_start_up(sig, frame):
    """Ctrl-C before the run opens its folder: nothing is written yet, so the process ends here and
    now. An exception raised instead could land inside an import (torch's, numpy's), where the import
    machinery may lose it, or turn it into another error, and the run would go on."""
    os.write(2, b"interrupted during start-up: nothing was run or written\n")
    os._exit(130)


def end_with_parent(poll=0.5):
    """A thread that kills this process once its parent has gone (its parent id changes: a kill -9
    of the run leaves no process training on unseen); started once per process."""
    import threading
    import time
    if WATCHING:
        return
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(poll)
        os.kill(os.getpid(), signal.SIGKILL)
    WATCHING.append(threading.Thread(target=watch, daemon=True))
    WATCHING[0].start()
