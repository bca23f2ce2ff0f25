"""What several test modules share: the server harness, engine and kernel helpers, the transformers oracle, paths.

Modules here are not collected (no ``test_`` names); test modules import them, never each other. Fixtures live in
the conftest.py files.
"""
