"""The test suite. A package so `tests.support` imports from the repository root (pytest puts it on sys.path)."""
