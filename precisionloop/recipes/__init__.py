"""Runnable recipes that ship with the package: `python -m precisionloop.recipes.<name>`."""
