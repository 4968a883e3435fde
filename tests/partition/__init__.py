"""Tests of tvmpipe.partition."""
