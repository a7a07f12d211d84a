"""TPU VM / pod launch tooling. `topology.py`: what a TPU slice name means."""
