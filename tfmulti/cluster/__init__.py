"""Cluster machinery, none of it importing TensorFlow.

* `tf_config`: TF_CONFIG building, parsing, validation and roles (who is chief);
* `launcher` (`launch`) and `supervisor`: the multi-worker launcher behind
  `tfmulti launch` and the process that supervises a host's workers;
* `hosts` and `rendezvous`: a launch across hosts (`--hosts`), computed
  from the same arguments on every host, and the launchers' agreement on
  its start and restarts; `channel` and `auth`: their messages, each
  authenticated with the job's shared secret (HMAC);
* `save_notice`: a worker's notice that it saves a backup on SIGTERM, read
  when the launcher stops the workers;
* `gpus`: each local worker's GPUs (`--gpus_per_worker`);
* `notebook_launcher` (`notebook_launcher.notebook_launcher`, also
  `tfmulti.notebook_launcher`): run a notebook function on N workers;
* `watchdog`: the startup watchdog of a worker waiting for its peers;
* `exit_codes`: the exit codes these processes share;
* `plan`: the pure functions that compute a launch.
"""

from __future__ import annotations

from tfmulti.cluster.launcher import launch

__all__ = ["launch"]
