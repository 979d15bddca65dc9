"""TensorFlow Datasets as tfmulti uses it: imported on first use, with the fix
of a folder TFDS leaves in TMPDIR.

TFDS (4.9, `DatasetInfo.initialize_from_bucket`) makes a folder
(`tempfile.mkdtemp("tfds")`) each time a builder is made for a dataset not yet
prepared in its data dir, to copy the dataset's metadata from GCS into, and
never removes it; with GCS off (TFDS's default) nothing is copied and the
folder stays empty: one `/tmp/tmpXXXXXXXXtfds` per `tfmulti prepare-data`,
per load of data not prepared yet, per builder of a new dataset. Fixed here
for every builder in the process: the method is skipped where GCS has no
metadata files for the dataset, which is where TFDS returns right after making
the folder. A TFDS whose method differs is left as it is.
"""

from __future__ import annotations

import functools
import inspect

# What the method must do for the fix to be right: make the folder, then return
# when GCS lists no file (TFDS 4.9).
_LEAK = ('tempfile.mkdtemp("tfds")', "if not data_files:\n      return")


@functools.cache
def module():
    """`tensorflow_datasets`, with the fix applied (once per process)."""
    import tensorflow_datasets as tfds

    _fix_bucket_folder(tfds.core.dataset_info)
    return tfds


def _fix_bucket_folder(dataset_info) -> None:
    """Patches `dataset_info.DatasetInfo.initialize_from_bucket` (see the
    module's docstring), where its source is the one fixed."""
    original = dataset_info.DatasetInfo.initialize_from_bucket
    try:
        source = inspect.getsource(original)
    except (OSError, TypeError):
        return
    if not all(part in source for part in _LEAK):
        return

    @functools.wraps(original)
    def initialize_from_bucket(self) -> None:
        if not dataset_info.gcs_utils.gcs_dataset_info_files(self.full_name):
            return  # as TFDS does here, without the folder it would leave
        original(self)

    dataset_info.DatasetInfo.initialize_from_bucket = initialize_from_bucket
