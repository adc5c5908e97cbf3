"""Training without FSDP: gradient aggregation (all_reduce, parameter server, top-k),
gradient compression, and DiLoCo's outer synchronisation for slow links."""
