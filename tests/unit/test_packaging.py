"""What setup.cfg promises about the installed product: the TensorFlow and Keras
minors it allows are the ones checked (`make test` on the newer TensorFlow,
`make test-compat` on the older, and this file runs in both), the Keras-fix
guard on whichever Keras is installed (`make test-compat` runs it on Keras
3.14 too), the license and the Python classifiers.
"""

from __future__ import annotations

import configparser
import importlib
import os
import re
import shlex
import sys
import warnings
from importlib import metadata

import pytest
from packaging.requirements import Requirement

from tests._util import REPO


def _setup_cfg() -> configparser.ConfigParser:
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    return config


def _requirements() -> dict[str, Requirement]:
    lines = _setup_cfg()["options"]["install_requires"].splitlines()
    requirements = [Requirement(line.strip()) for line in lines
                    if line.strip() and not line.strip().startswith("#")]
    return {r.name.lower(): r for r in requirements if r.marker is None or r.marker.evaluate()}


def _compat_pins() -> dict[str, str]:
    """The older minors `make test-compat` installs (the Makefile's COMPAT_PINS)."""
    makefile = (REPO / "Makefile").read_text()
    line = re.search(r"^COMPAT_PINS := (.*)$", makefile, re.M).group(1)
    return dict(pin.split("==") for pin in shlex.split(line))


def test_the_installed_dependencies_lie_in_the_ranges_setup_cfg_declares():
    # In `make test-compat`'s environment too: TensorFlow 2.20 is allowed.
    for name, requirement in _requirements().items():
        installed = metadata.version(name)
        assert requirement.specifier.contains(installed, prereleases=True), (
            f"{name} {installed} is installed but setup.cfg requires {requirement}")


def test_the_ranges_hold_the_minors_checked_and_no_other():
    from tfmulti.runtime.keras_fixes import TESTED_KERAS

    requirements = _requirements()
    pins = _compat_pins()
    assert set(pins) == {"tensorflow", "keras"}, pins
    for name, pin in pins.items():
        major, minor = (int(part) for part in pin.removesuffix(".*").split("."))
        spec = requirements[name].specifier
        assert spec.contains(f"{major}.{minor}.0"), (name, spec)
        # Nothing below the minor `make test-compat` runs, at most the one after it.
        assert not spec.contains(f"{major}.{minor - 1}.99"), (name, spec)
        assert not spec.contains(f"{major}.{minor + 2}.0"), (name, spec)
    # The Keras the fixes' digests were read from is allowed.
    assert requirements["keras"].specifier.contains(f"{TESTED_KERAS}.0")


def _targets(names):
    """(owner, attribute) of each "module:qualified name" a fix replaces."""
    out = []
    for name in names:
        module, _, path = name.partition(":")
        owner = importlib.import_module(module)
        *holders, attribute = path.split(".")
        for holder in holders:
            owner = getattr(owner, holder)
        out.append((owner, attribute))
    return out


def test_the_keras_fix_guard_on_the_installed_keras(monkeypatch):
    """On the Keras installed (3.15; 3.14 in `make test-compat`'s last step),
    each fix whose Keras functions differ from the ones it was written for
    stays off with one RuntimeWarning naming them, the others are on, and the
    changed functions are left as Keras ships them."""
    import keras
    from keras.src.layers.normalization.batch_normalization import BatchNormalization

    from tfmulti.runtime import keras_fixes

    monkeypatch.setattr(keras_fixes, "_applied", set())
    monkeypatch.setattr(keras_fixes, "_off", set())
    monkeypatch.setattr(keras_fixes, "_announced", True)  # no line on stderr
    shipped = {}
    for name, (owner, attribute) in zip(keras_fixes.KERAS_ORIGINALS,
                                        _targets(keras_fixes.KERAS_ORIGINALS)):
        shipped[name] = getattr(owner, attribute)
        monkeypatch.setattr(owner, attribute, shipped[name])  # put back after the test
    had_add_weight = "add_weight" in vars(BatchNormalization)  # what the BN fix adds
    monkeypatch.setattr(BatchNormalization, "add_weight", BatchNormalization.add_weight)
    fixes = keras_fixes._needed(None)
    changed = {fix.name: keras_fixes.changed_keras_functions(
        {name: keras_fixes.KERAS_ORIGINALS[name] for name in fix.replaces}) for fix in fixes}
    off = [fix for fix in fixes if changed[fix.name]]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            active = keras_fixes.apply_keras_fixes()
        left = {name: getattr(owner, attribute) for fix in off for name, (owner, attribute)
                in zip(changed[fix.name], _targets(changed[fix.name]))}
    finally:
        monkeypatch.undo()
        if not had_add_weight and "add_weight" in vars(BatchNormalization):
            delattr(BatchNormalization, "add_weight")
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert active == [fix.name for fix in fixes if not changed[fix.name]]
    # The Keras the digests were read from changes nothing; `make test-compat` names
    # what another Keras turns off (TFMULTI_EXPECT_FIXES_OFF, ";" between names).
    expected = os.environ.get("TFMULTI_EXPECT_FIXES_OFF")
    if expected is not None:
        assert [fix.name for fix in off] == expected.split(";"), keras.__version__
    elif keras.__version__.startswith(f"{keras_fixes.TESTED_KERAS}."):
        assert off == [], keras.__version__
    assert len(messages) == len(off), messages
    for fix, message in zip(off, messages):
        assert message.startswith(f"tfmulti's fix for {fix} was written for Keras "
                                  f"{keras_fixes.TESTED_KERAS}, and in the installed Keras "
                                  f"{keras.__version__} these functions differ: "), message
        assert ", ".join(changed[fix.name]) in message and "The fix stays off" in message
    # A changed function was left as Keras ships it.
    assert all(left[name] is shipped[name] for name in left), left
    print(f"Keras {keras.__version__}: on {active}; off {[fix.name for fix in off]}")


def test_license_is_the_apache_license_setup_cfg_names():
    metadata_section = _setup_cfg()["metadata"]
    assert metadata_section["license"] == "Apache-2.0"
    assert metadata_section["license_files"].split() == ["LICENSE"]
    text = (REPO / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"], text[:200]
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text


@pytest.mark.parametrize("version", [f"{sys.version_info.major}.{sys.version_info.minor}"])
def test_the_python_this_suite_runs_on_is_a_classifier(version):
    classifiers = _setup_cfg()["metadata"]["classifiers"].split("\n")
    assert f"Programming Language :: Python :: {version}" in [c.strip() for c in classifiers]
