import os
import sys

# Make `import resilient_comm` resolve to this checkout when tests run from the repo root.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
