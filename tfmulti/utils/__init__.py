"""The bottom layer: argument checks (`checks`), aligned text tables and
sizes (`tables`), atomic file writes (`atomic`) and the failpoints production
code calls (`failpoints`). No TensorFlow, nothing above imported."""
