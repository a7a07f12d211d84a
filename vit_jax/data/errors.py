"""The errors the input pipeline raises; each message says what to do."""

from __future__ import annotations


class DataError(ValueError):
  """Base class: a dataset, split or input config the pipeline cannot use."""


class UnknownDatasetError(DataError, KeyError):
  """`input.data` names no registry entry."""

  def __str__(self) -> str:  # KeyError would quote the message.
    return str(self.args[0])


class UnknownSplitError(DataError):
  """A split name or slice the dataset does not have."""


class DatasetNotPreparedError(DataError, FileNotFoundError):
  """The dataset is not where `data_dir` says; the message names the fix."""


class BadImageError(DataError):
  """Files of a folder dataset that cannot be decoded as images."""

  def __init__(self, message: str, paths=()):
    super().__init__(message)
    self.paths = tuple(paths)


class LabelRangeError(DataError):
  """Labels of the data outside the model head's classes [0, num_classes)."""
