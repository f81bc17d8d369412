"""Reading checkpoints: safetensors memory maps, the plumbing every loader shares (`checkpoint.py`: one checkpoint
record, one resolver skeleton, the strict key / shape / dtype check; `placement.py`: tensors into modules and
residencies), one loader per component, and `vae_common.py` for what the two VAE loaders share. Imports base,
runtime and models; never the pipeline."""
