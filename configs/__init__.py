"""Experiment configs: one file per family, rows picked by `file.py:args`."""
