"""Example scripts (run them under ``resilient-run``; see each one's docstring)."""
