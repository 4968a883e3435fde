"""A strict fake of PyCUDA 2026.1 for CPU tests (tests/fakecuda/README.md). Only what tvmpipe's
PyCudaDevice uses exists; every call follows the real module's signature and error text."""

VERSION = (2026, 1)
VERSION_TEXT = "2026.1 (tvmpipe fake)"
FAKE = True
