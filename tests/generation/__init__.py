"""Tests of tvmpipe.generation."""
