"""The errors of checkpoint reading and conversion (one place, so the format
modules can use each other without an import cycle)."""


class CheckpointError(ValueError):
  """A checkpoint file that cannot be read or does not fit the model."""


class CheckpointNotFoundError(FileNotFoundError):
  """No checkpoint where one was asked for (the message says what to pass)."""
