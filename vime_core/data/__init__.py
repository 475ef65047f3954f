"""Samples, the prompt data source, the batch builder and the DP schedule (pure Python/torch)."""
