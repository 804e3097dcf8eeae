import sys
from pathlib import Path

# synth.py and planted.py live next to the tests and are imported by name.
sys.path.insert(0, str(Path(__file__).parent))
