"""The tensor side: KV cache tensors, attention, the model runner and the sampler."""
