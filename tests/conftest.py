import sys
from pathlib import Path

# The test doubles live beside the tests (tests/fakes.py).
sys.path.insert(0, str(Path(__file__).parent))
