"""Engine: scheduling, KV cache, sampling."""
