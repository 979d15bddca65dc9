"""The wheel holds the product only: the `tfmulti` package with every layer's
folder, none of the checkout's benchmarks, fault campaign, simulated hosts,
recipes or tests (setup.cfg, `[options.packages.find]`)."""

from __future__ import annotations

import configparser


from tests._util import REPO


def test_setup_cfg_finds_only_the_tfmulti_packages():
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    assert config["options"]["packages"].strip() == "find:"
    assert config["options.packages.find"]["include"].split(",") == ["tfmulti", " tfmulti.*"]
