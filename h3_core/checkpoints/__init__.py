"""Reading checkpoints: safetensors memory maps, the plumbing every loader shares (`checkpoint.py`: one checkpoint
record, one resolver skeleton, the strict key / shape / dtype check; `placement.py`: tensors into modules and
residencies), and one loader per component. Imports base, runtime and models; never the pipeline."""
