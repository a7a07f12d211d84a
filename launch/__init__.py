"""TPU VM / pod launch tooling (docs/tpu.md).

`topology.py`: what a TPU slice name means; `tpu.py`: the `python -m
launch.tpu` command line; `commands.py`: the gcloud commands and worker
scripts it issues; `runner.py`: runs (or, with --dry-run, prints) them;
`local.py`: the same launch as N local processes.
"""
