import os
import pathlib
import sys

# Local Ray clusters in tests stay on loopback (Ray reads this when first imported).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
