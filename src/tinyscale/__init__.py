"""tinyscale: how large models are trained across many GPUs, one small topic at a time."""
