"""What several test modules share: the tiny random models, the server harness, engine, kernel, sliding-window and
KV-scale helpers, the transformers oracle, paths.

Modules here are not collected (no ``test_`` names); test modules import them, never a conftest.py or each other
(tests/test_tests_layout.py checks it). Fixtures live in the conftest.py files.
"""
