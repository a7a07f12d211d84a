"""Export formats by name: what each writes, and how its output is run.

A format is one module that registers a `Format`:

    registry.register(Format(
        name='myformat', requires=('mylib',),
        export=write,       # (trained, out_dir, options) -> {'files': [...], ...}
        run=run,            # (out_dir, f32 NHWC images) -> logits
        description='...'))

`vit_jax.export.export_model` calls `export`, then `run` on a few images
and compares the logits with the JAX model's (`run_bytes`, where a format
embeds the pre-processing, is checked on encoded images too).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import numbers
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

INSTALL = 'pip install -e ".[export]" -c constraints.txt'


@dataclasses.dataclass(frozen=True)
class Options:
  """What the command line asks of every format."""
  batch: Optional[int] = None         # None: dynamic batch size.
  with_preprocessing: bool = False    # Take encoded images (where possible).
  # Compute dtype of the exported model; None: the run's, as predict and
  # its evaluation compute (`resolve`).
  dtype: Optional[str] = None

  def __post_init__(self):
    """Refuses a batch size no export can take, here rather than as a
    ZeroDivisionError or a runtime's error deep inside a format."""
    batch = self.batch
    if batch is None:
      return
    if (isinstance(batch, bool)
        or not isinstance(batch, numbers.Integral) or batch < 1):
      raise ValueError(
          f'Options(batch={batch!r}): expected None (a dynamic batch size) '
          'or an integer >= 1 (a fixed one)')
    object.__setattr__(self, 'batch', int(batch))  # Not a numpy integer.


@dataclasses.dataclass(frozen=True)
class Format:
  name: str
  export: Callable[[Any, str, Options], Dict[str, Any]]
  run: Callable[[str, np.ndarray], np.ndarray]
  requires: Tuple[str, ...] = ()     # Importable modules it needs.
  description: str = ''
  run_bytes: Optional[Callable[[str, Sequence[bytes]], np.ndarray]] = None
  embeds_preprocessing: bool = False  # Supports --with-preprocessing.
  # Otherwise: why not, and what to do instead.
  no_preprocessing: str = 'it takes pre-processed float images only'
  # trained -> why this format cannot hold that model ('' if it can).
  unsupported: Optional[Callable[[Any], str]] = None
  # The --dtype values it honours (None: all), and what to do otherwise.
  dtypes: Optional[Tuple[str, ...]] = None
  other_dtypes: str = ''
  # The float input's layout: 'NHWC' (vit_jax's) or 'NCHW' (PyTorch's).
  layout: str = 'NHWC'
  # Names it writes that exports of earlier versions did not list in their
  # export.json 'files' (a folder ends in /): --overwrite replaces them.
  incidental: Tuple[str, ...] = ()


FORMATS: Dict[str, Format] = {}


def register(fmt: Format) -> Format:
  if fmt.name in FORMATS and FORMATS[fmt.name] is not fmt:
    raise ValueError(f'export format {fmt.name!r} is already registered')
  FORMATS[fmt.name] = fmt
  return fmt


def names() -> List[str]:
  return sorted(FORMATS)


def get(name: str) -> Format:
  if name not in FORMATS:
    close = difflib.get_close_matches(name, FORMATS, n=2)
    hint = f' Did you mean {" or ".join(close)}?' if close else ''
    raise ValueError(f'unknown export format {name!r}.{hint} Formats: '
                     f'{", ".join(names())}')
  return FORMATS[name]


def resolve(fmt: Format, options: Options, trained) -> Options:
  """`options` with the dtype decided: the one asked for, else the model's
  own (`Trained.compute_dtype`: the run's, as predict computes and the run
  evaluated), else, for a format that cannot export that, float32."""
  if options.dtype is not None:
    return options
  dtype = trained.compute_dtype()
  if fmt.dtypes is not None and dtype not in fmt.dtypes:
    dtype = fmt.dtypes[0]
  return dataclasses.replace(options, dtype=dtype)


def check_options(fmt: Format, options: Options) -> None:
  """ValueError for options the format or this machine cannot honour,
  saying why (a dtype of None, the model's, is checked once `resolve`d)."""
  import jax  # pylint: disable=g-import-not-at-top
  if options.dtype == 'float16' and jax.default_backend() == 'cpu':
    raise ValueError(
        '--dtype=float16: XLA:CPU has no float16 products with float32 '
        'accumulation, so the export cannot be verified on this machine. '
        'Export --dtype=bfloat16 or float32 here, or float16 on a GPU')
  if (fmt.dtypes is not None and options.dtype is not None
      and options.dtype not in fmt.dtypes):
    raise ValueError(
        f'--format={fmt.name} --dtype={options.dtype}: it exports '
        f'{" or ".join(fmt.dtypes)} only; {fmt.other_dtypes}')
  if options.with_preprocessing and not fmt.embeds_preprocessing:
    raise ValueError(
        f'--format={fmt.name} cannot embed the pre-processing: '
        f'{fmt.no_preprocessing}. Drop --with-preprocessing and apply the '
        'ops listed in export.json (docs/deploy.md), or use '
        '--format=savedmodel --with-preprocessing')


def check_model(fmt: Format, trained) -> None:
  """ValueError for a model the format cannot express, saying why."""
  why = fmt.unsupported(trained) if fmt.unsupported else ''
  if why:
    others = [n for n in names() if n != fmt.name and not (
        FORMATS[n].unsupported and FORMATS[n].unsupported(trained))]
    raise ValueError(f'--format={fmt.name} cannot export this model: {why}. '
                     f'Export it with --format={" or ".join(others)}')


def missing(fmt: Format) -> List[str]:
  """The modules `fmt` needs that are not installed."""
  return [m for m in fmt.requires if importlib.util.find_spec(m) is None]


def check_installed(fmt: Format) -> None:
  lacking = missing(fmt)
  if lacking:
    raise ImportError(
        f'--format={fmt.name} needs {", ".join(lacking)}, which is not '
        f'installed: {INSTALL}')
