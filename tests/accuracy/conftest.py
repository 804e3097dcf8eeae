import sys
from pathlib import Path

# cases.py lives next to the tests and is imported by name (also by bench/accuracy.py).
sys.path.insert(0, str(Path(__file__).parent))
