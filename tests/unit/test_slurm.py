"""The SLURM batch script and its page agree (no process: the script runs on a real
SLURM in tests/integration/test_slurm.py)."""

from __future__ import annotations

import os
import re

from tests._util import REPO

SCRIPT = REPO / "deploy" / "slurm" / "train.sbatch"
PAGE = REPO / "docs" / "how-to" / "slurm.md"


def test_the_page_shows_the_batch_scripts_own_lines():
    block = re.search(r"```sh\n(#SBATCH.*?)```", PAGE.read_text(), re.S).group(1)
    script = SCRIPT.read_text().splitlines()
    missing = [line for line in block.splitlines() if line not in script]
    assert not missing, \
        f"{PAGE.relative_to(REPO)} shows lines {SCRIPT.relative_to(REPO)} lacks: {missing}"


def test_the_batch_script_requeues_on_the_preempted_exit_code():
    from tfmulti.cluster import exit_codes

    text = SCRIPT.read_text()
    assert os.access(SCRIPT, os.X_OK)
    assert text.startswith("#!/bin/bash\n")
    assert "#SBATCH --requeue" in text.splitlines()
    assert f'if [ "$code" -eq {exit_codes.PREEMPTED} ]; then' in text
    assert "--distribution=multi_worker --cluster_resolver=slurm" in text
