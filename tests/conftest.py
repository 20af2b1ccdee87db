"""Tests import the installed (editable) package; see scripts/setup.sh."""
