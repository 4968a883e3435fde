"""Tests of tvmpipe.serve."""
