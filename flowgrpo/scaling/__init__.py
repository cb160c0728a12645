"""Scaling out: FSDP2 sharding and sharded checkpoints (sharding), per-rank memory estimates (memory)."""
