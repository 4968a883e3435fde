"""Tests of tvmpipe.bundle."""
