"""Nothing lost, nothing left behind (issue #22): h2g and g2h on a full disk end in one line, leave no temporary
directory and keep an earlier output; a save directory has one owner (:class:`galva_ckpt.saves.SaveDirLock`).

The full disk is a real tmpfs mounted small (root or CAP_SYS_ADMIN needed; the tests skip with the reason otherwise).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from galva_ckpt.saves import LOCK_FILE, SaveDirBusy, SaveDirLock


def _fails(run, *needles: str) -> None:
    """Exit 2, one stderr line 'galva-ckpt: error: ...' containing every needle, no traceback."""
    assert run.code == 2, run
    lines = run.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("galva-ckpt: error: "), run.err
    assert "Traceback" not in run.err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_h2g_on_a_full_disk_is_one_line_and_leaves_nothing(tmp_path: Path, cli, tiny, small_disk) -> None:
    """tiny-gpt2 is about 0.9 MB; the disk takes 512 KiB."""
    tiny.save(tmp_path / "hf", "tiny-gpt2")
    disk = small_disk("512k")
    _fails(cli("h2g", tmp_path / "hf", disk / "galva"), f"cannot write {disk / 'galva'}: No space left on device")
    assert list(disk.iterdir()) == []


def test_g2h_replacing_an_output_on_a_full_disk_keeps_it(tmp_path: Path, cli, tiny, small_disk) -> None:
    """A 1.5 MiB disk holds one 0.9 MB Hugging Face copy, not two: ``--force`` fails and the first copy stays."""
    tiny.save(tmp_path / "hf", "tiny-gpt2")
    assert cli("h2g", tmp_path / "hf", tmp_path / "galva").code == 0
    disk = small_disk("1536k")
    out = disk / "back"
    assert cli("g2h", tmp_path / "galva", out).code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    _fails(cli("g2h", tmp_path / "galva", out, "--force"), f"cannot write {out}: No space left on device")
    assert [p.name for p in disk.iterdir()] == ["back"]  # no .tmp-* / .old-* left
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_save_dir_has_one_owner_and_a_dead_owner_blocks_nothing(tmp_path: Path) -> None:
    root = tmp_path / "saves"
    with SaveDirLock(root) as lock:
        assert (root / LOCK_FILE).read_text() == f"pid {os.getpid()} on host {socket.gethostname()}\n"
        with pytest.raises(SaveDirBusy) as busy:
            SaveDirLock(root).acquire()  # another open file: flock treats it as another owner
        message = str(busy.value)
        assert message.count("\n") == 0 and str(root) in message
        assert f"in use by another run (pid {os.getpid()} on host {socket.gethostname()})" in message
        assert lock.path.exists()
    assert not (root / LOCK_FILE).exists()  # released: removed
    (root / LOCK_FILE).write_text("pid 999999999 on host gone\n")  # a killed owner's file: its flock died with it
    with SaveDirLock(root):
        assert str(os.getpid()) in (root / LOCK_FILE).read_text()
