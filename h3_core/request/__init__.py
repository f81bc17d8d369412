"""One generation request, as every front end and both engines (the local pipeline, a remote server) see it: its
grid (`grid.py`), its fields and their rules (`generation_request.py`), its media normalised (`keyframes.py`,
`references.py`), and what it gives back (`generation_result.py`, written and read by `media_files.py`).

Imports no model, checkpoint or loader: the remote engine uses it without loading any."""

from .generation_result import GenerationResult

__all__ = ["GenerationResult"]
