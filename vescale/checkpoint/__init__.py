"""Distributed checkpoints that reshard on load, and Hugging Face import/export."""

from .api import load, save, wait
from .storage import CorruptCheckpoint

__all__ = ["save", "load", "wait", "CorruptCheckpoint"]
