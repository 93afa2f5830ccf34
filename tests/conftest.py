import os
import sys

# Tests import helpers from this folder (``from multirank import ...``) and keep the
# Triton kernels on the CPU interpreter: the suite runs where there is no GPU.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TRITON_INTERPRET", "1")
