"""Smoke test of an installed vescale, run by `make test-package` in a fresh venv from
outside the source tree: the import must find the installed copy (package files and the
compiled extension), and one DTensor op must run through the engine.

Usage: python package_smoke.py SOURCE_DIR
"""

import os
import sys
import tempfile

import torch
import torch.distributed as dist

import vescale
from vescale import Replicate, Shard

in_tree = os.path.realpath(os.path.join(sys.argv[1], "vescale"))
for module in (vescale, vescale._C):
    where = os.path.dirname(os.path.realpath(module.__file__))
    assert where != in_tree, f"imported the source tree's {module.__file__}, not the installed copy"
print("vescale from", os.path.dirname(vescale.__file__))

with tempfile.TemporaryDirectory() as tmp:
    # A one-rank gloo group through a file store: no port to pick.
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
    try:
        mesh = vescale.init_device_mesh("cpu", (1,))
        a, b = torch.randn(4, 3), torch.randn(4, 3)
        x = vescale.distribute_tensor(a, mesh, [Shard(0)])
        y = vescale.distribute_tensor(b, mesh, [Replicate()])
        z = x + y
        assert isinstance(z, vescale.DTensor), type(z)
        torch.testing.assert_close(z.full_tensor(), a + b)
    finally:
        dist.destroy_process_group()
print("package smoke test passed")
