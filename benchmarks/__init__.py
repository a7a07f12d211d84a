"""Benchmarks that compare vit_jax with other implementations (not part of
the installed package): `python -m benchmarks.peers`."""
