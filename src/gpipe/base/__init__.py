"""The floor of the package: the modules every layer may use (errors, the
re-materialization rule, per-layer seeds, micro-batches, the CPU allocator's
policy, small tensor helpers). They import nothing of gpipe above this package."""
