"""
What a learner may skip: the ablations (--suite all), the probes with their rows and claims, the
report's tables and the figures, the runner (flags, processes, resume, Ctrl-C, the time left), the
files a run writes (checkpoints, rows, the token cache), the preset checks, and their tests.
"""

from lab import startup

startup.guard(__name__)  # a --jobs process reaches the lab first among its imports: it watches its parent from here
