"""Control plane: node registry, coverage map, route selection, route sessions, rebalance."""
