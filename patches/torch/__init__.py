"""Patches of torch modules (mirrors ``torch.*``)."""
