"""The bottom layer: argument checks (`checks`), aligned text tables
(`tables`), the bytes of dtypes and variables (`sizes`), atomic file writes
(`atomic`) and the failpoints production code calls (`failpoints`). No
TensorFlow, nothing above imported."""
