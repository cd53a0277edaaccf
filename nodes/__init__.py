"""Execution plane: shard backends, per-session Hot KV State, the activation server."""
