"""``galva-train`` whose save of one step stops after its tensors are written, before their checksums and the
manifest, so that a test can kill the run there. The fault is injected here, in the test's process, not by a hook in
the checkpoint writer.

Usage: ``python _stalled_save.py STEP [galva-train arguments]``.
"""

from __future__ import annotations

import sys
import time

import galva_ckpt.sharded as sharded
from galva_models.cli.train import main

held_dir = f"step-{int(sys.argv[1]):08d}.tmp-"
checksum = sharded.sha256_file


def _held(path):  # the first thing a save does once every rank has written its tensors
    if held_dir in str(path):
        time.sleep(3600)
    return checksum(path)


sharded.sha256_file = _held
sys.argv = [sys.argv[0], *sys.argv[2:]]
sys.exit(main())
