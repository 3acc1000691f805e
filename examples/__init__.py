"""Runnable examples of the plugin hooks (importable as examples.<name>)."""
