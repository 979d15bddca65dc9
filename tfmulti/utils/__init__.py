"""The bottom layer: argument checks (`checks`), aligned text tables
(`tables`), the bytes of dtypes and variables (`sizes`), numbers as people
read them (`human`), atomic file writes (`atomic`), the failpoints production
code calls (`failpoints`) and TensorFlow's start-up lines kept out of the
output (`quiet`). No TensorFlow, nothing above imported."""
