"""Helpers the tests of every layer import as `tests.support.<module>`.

A package (not folders put on sys.path) so every helper has one importable name, and so the
names can say what each module holds: tiny_bundle, synthetic_bundles, pipeline_harness, ...
"""
