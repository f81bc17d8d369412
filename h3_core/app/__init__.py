"""The application: the `python -m h3_core` commands (`cli.py`; `remote_cli.py` for `--server`) and what they show
while they work (`progress.py`). The top of h3_core: it drives the local pipeline and the remote engine alike."""
