"""Tests of tvmpipe.executor."""
