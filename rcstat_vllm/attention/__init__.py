"""The plugin's attention backends (CPU and CUDA), head-as-sequence attention, what they can serve."""
