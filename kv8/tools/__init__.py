"""Offline tools: KV-scale calibration (``kv8 calibrate``) and accuracy evaluation (``kv8 eval``)."""
