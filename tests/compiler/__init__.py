"""Tests of tvmpipe.compiler."""
