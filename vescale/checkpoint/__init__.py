"""Distributed checkpoints that reshard on load, and Hugging Face import/export."""

from .api import load, save, wait
from .interop import export_hf, export_torch, full_state_dict, import_hf, load_torch_state_dict
from .storage import CorruptCheckpoint

__all__ = ["save", "load", "wait", "CorruptCheckpoint", "export_hf", "export_torch", "full_state_dict", "import_hf", "load_torch_state_dict"]
