"""Integrations with training frameworks (integrations and CLI layer): one module per framework,
each importing its framework only when the module itself is imported.

- `safepoint.integrations.lightning`: `SafepointCheckpointIO`, a Lightning `CheckpointIO`.
"""
