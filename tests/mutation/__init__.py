"""The mutation runner (on demand, not part of the default suite): see ``run.py``."""
