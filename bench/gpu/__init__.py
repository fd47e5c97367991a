"""`make gpu-check` (bench/gpu/check.py): every CUDA path and the published Crafter recipe on a GPU box."""
