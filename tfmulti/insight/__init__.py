"""Tools that look at a training configuration without changing it:

* `timing`: the input, compute and `fit` timings of a training step;
* `diagnose`: where a configuration's time goes, and the measured gain of
  the changes that could help (`tfmulti diagnose`);
* `environment`: versions, devices, CPU and oneDNN (`tfmulti env`);
* `memory`: the training memory per device before anything is placed
  (`tfmulti estimate-memory`); `estimate_args` checks its arguments without
  TensorFlow.
"""

__all__ = ["diagnose", "environment", "estimate_args", "memory", "timing"]
