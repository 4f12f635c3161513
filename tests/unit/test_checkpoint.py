"""The checkpoint failure message, from a real (single-process) Checkpointer."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from job.checkpoint import Checkpointer
from job.config import CheckpointConfig


def test_a_failed_save_names_the_step_the_cause_and_what_is_safe(tmp_path: Path) -> None:
    checkpoints = Checkpointer(tmp_path / "ck", CheckpointConfig())
    for name in ("2", "4", "6.orbax-checkpoint-tmp"):
        (tmp_path / "ck" / name).mkdir()
    cause = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    wrapped = ValueError("RESOURCE_EXHAUSTED: Error writing ... [os_error_code='28']")
    wrapped.__cause__ = cause
    text = str(checkpoints._failed(6, wrapped))
    assert text.startswith(f"checkpoint: expected to write step 6 to {tmp_path / 'ck'}, found No space left on device")
    assert "Complete checkpoints on disk: [2, 4] (a rerun resumes from step 4)" in text
    assert "Fix: free space in" in text
    checkpoints.close()


def test_the_message_survives_a_folder_that_cannot_be_listed(tmp_path: Path) -> None:
    checkpoints = Checkpointer(tmp_path / "ck", CheckpointConfig())
    shutil.rmtree(tmp_path / "ck")
    text = str(checkpoints._failed(8, OSError(errno.EIO, os.strerror(errno.EIO))))
    assert "found Input/output error (OSError:" in text
    assert "Complete checkpoints on disk: unknown (cannot list the folder: No such file or directory)" in text
    checkpoints.close()
