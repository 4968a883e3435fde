"""Tests of tvmpipe.cluster."""
