import sys
from pathlib import Path

# The synthetic trace builder lives with the report tests; share it instead of copying it.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "report"))
