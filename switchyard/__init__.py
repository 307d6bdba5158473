"""Switchyard: the composition root (CLI, the embedded stack, the bundled sim model)."""
