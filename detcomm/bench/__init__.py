"""detcomm-bench: latency, bandwidth and numerical divergence of every route, side by side (``python -m detcomm.bench``)."""
