"""Captured graphs: the cache per (slot, bucket) (cache.py), CUDA capture and warmup (cuda_graphs.py,
graph_record.py), the path a step takes (graph_choice.py), buckets, and the fixed layout of a mixed
step's graph (static_step.py)."""
