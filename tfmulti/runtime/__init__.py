"""What a process runs on: devices (`devices`: virtual CPUs, logical GPUs),
strategies by name (`strategy`), the worker's role in a cluster (`roles`) and
the fixes for upstream Keras bugs that the strategies apply (`keras_fixes`)."""
