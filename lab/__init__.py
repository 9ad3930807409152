"""
What a learner may skip: the ablations (--suite all), the probes with their rows and claims, the
report's tables and the figures, the runner (flags, processes, resume, Ctrl-C, the time left), the
files a run writes (checkpoints, rows, the token cache), the preset checks, and their tests.
"""

if __name__ == "__main__":  # no script: one line saying what to run (first: by its path the project is not importable)
    import sys
    print("lab/ is no script: run python train_tiny.py (lab/ holds what it runs that a learner may skip)",
          file=sys.stderr)
    sys.exit(2)

import sys

if "multiprocessing" in sys.modules:  # a --jobs process reaches the lab first among its imports: it watches its parent
    from lab import startup           # from here (a process spawned by multiprocessing has it loaded)
    startup.guard(__name__)
