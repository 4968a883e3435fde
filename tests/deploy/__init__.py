"""Tests of tvmpipe.deploy."""
