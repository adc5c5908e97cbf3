"""Training without FSDP: gradient aggregation (all_reduce, parameter server, top-k) and
gradient compression."""
