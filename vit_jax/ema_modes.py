"""`config.eval_ema`: which parameters a run with Polyak averages evaluates.

'ema' (the default): the averages where there are any, else the parameters;
'raw': the parameters; 'both': the averages under the usual metric names and
the parameters under `RAW_PREFIX` + name (`evaluators.run_with_ema`). Here,
below both readers: the config check reads it before anything loads
TensorFlow, so `python -m vit_jax.main` refuses a bad value in seconds.
"""

EMA_MODES = ('ema', 'raw', 'both')
RAW_PREFIX = 'raw/'
