"""The audio health check's warnings on the CLI: one line each on stderr (its errors are the run's error, raised
before anything is written)."""

from __future__ import annotations

import sys

from ..request.audio_health import warning_line


def print_audio_warnings(result) -> None:
    for finding in result.audio_warnings:
        print(f"warning: {warning_line(finding)}", file=sys.stderr)
