"""The Ray cluster engine: an edge actor per node, gateways that reach them, and `corral cluster`."""
