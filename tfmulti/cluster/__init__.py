"""Cluster machinery, none of it importing TensorFlow.

* `tf_config`: TF_CONFIG building, parsing, validation and roles (who is chief);
* `launcher` (`launch`) and `supervisor`: the local multi-worker launcher
  behind `tfmulti launch` and the process that supervises the workers;
* `notebook_launcher` (`notebook_launcher.notebook_launcher`, also
  `tfmulti.notebook_launcher`): run a notebook function on N workers;
* `watchdog`: the startup watchdog of a worker waiting for its peers;
* `exit_codes`: the exit codes these processes share;
* `plan`: the pure functions that compute a launch.
"""

from __future__ import annotations

from tfmulti.cluster.launcher import launch

__all__ = ["launch"]
