"""Which code a benchmark measured: a checkout's commit, `-dirty` when its tracked files differ from it."""

from __future__ import annotations

import subprocess
from pathlib import Path


def tree_sha(repo: Path) -> str:
    """HEAD of the checkout at `repo`, with `-dirty` when tracked files differ from it; "" without git."""

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    sha = git("rev-parse", "HEAD")
    return sha + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "") if sha else ""
