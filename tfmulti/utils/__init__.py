"""The bottom layer: argument checks (`checks`), aligned text tables
(`tables`), the bytes of dtypes and variables (`sizes`), numbers as people
read them (`human`), atomic file writes (`atomic`), the failpoints production
code calls (`failpoints`), TensorFlow's start-up lines kept out of the
output (`quiet`) and Keras' optional imports (plotting, notebook, pandas)
deferred to their first use (`deferred_imports`): the last two are installed by
the processes tfmulti owns, not by importing it. No TensorFlow, nothing above imported."""
