"""Inference engines: the vLLM server launcher, its HTTP client, the router, health monitoring."""
