"""vescale.save / vescale.load: sharded checkpoints that load into any mesh.

    vescale.save("ckpt/step100", {"model": model, "optimizer": opt, "lr_scheduler": sched})
    vescale.load("ckpt/step100", {"model": model, "optimizer": opt, "lr_scheduler": sched})

A checkpoint is a directory: the ranks' data files, the non-tensor state (never a
pickle), and a manifest with the global shape, dtype and saved boxes of every tensor, so
that it loads into any other mesh, world size or ZeRO stage. The parts, one job each:

- saving.py: what every rank saves and which rank writes each box; asynchronous saves;
- writing.py: the directory on disk, written all or nothing (a crash mid-save keeps the
  previous checkpoint);
- loading.py: the checks every rank makes before any rank changes its state, then the load;
- manifest.py: the file names, the format version, the manifest's own checksum;
- agreement.py: the checkpoint's process group, and the one collective after each step
  that has every rank go on or raise the same error.

Without torch.distributed (no process group), a single process saves and loads alone.
"""

from .loading import load
from .saving import save, wait

__all__ = ["save", "load", "wait"]
