"""The training engine: mesh and sharding, optimiser, jitted step, loop."""
