"""Hypothesis profiles: CI draws a fixed sequence of examples, so a red run is reproducible."""

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
