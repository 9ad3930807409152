"""`python -m lab`: lab/ is no script; it holds what the main job runs that a learner may skip."""

if __name__ == "__main__":  # no script: one line saying what to run
    import sys
    print("lab/ is no script: run python train_tiny.py (lab/ holds what it runs that a learner may skip)",
          file=sys.stderr)
    sys.exit(2)
